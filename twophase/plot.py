"""`python -m twophase.plot RUN_DIR... [--out FILE.png]`: a run's picture from its metrics.jsonl.

One PNG, one column per validation metric the runs log (the task's own: word accuracy, WER, PER for G2P;
generalization, exact match, ... for Karel; a custom task's keys; then the reward), or those --metrics names:
- top row, the comparison the run exists for: from the branch point on, RL and MLE continued against the
  training time each spent since the branch (the budget --compare-mle equalises: CPU time on a CPU), the end of
  MLE as a dotted reference line, and the closing table's test figures under each panel;
- then the whole run against wall time and against the step: the MLE warm start, RL and MLE continued, each
  drawn at its own time and step since the branch.
Each arm has its own colour (MLE grey, MLE continued blue, RL orange); several runs (seeds) get a hue family
each, the arms three shades of it. train.py draws <save-dir>/curves.png at the end of a run (--no-picture).
matplotlib is imported only here (the `plot` extra); without it the command ends with one line and exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import OneLineError

PROG = "python -m twophase.plot"
# Keys of validation rows that are not metrics (metrics.jsonl's bookkeeping, docs/metrics.md).
NOT_METRICS = {"step", "phase", "after", "continued", "since_branch_s", "train_s", "time", "elapsed_s", "n", "model"}
ARMS = ("mle", "mle-continued", "rl")
ARM_LABELS = {"mle": "MLE", "mle-continued": "MLE continued", "rl": "RL"}
STYLE = {"mle": dict(ls="-", marker="o", ms=3, lw=1.2), "mle-continued": dict(ls="--", marker="s", ms=3, lw=1.6),
         "rl": dict(ls="-", marker="o", ms=3.5, lw=2.0)}
SINGLE = {"mle": "Greys", "mle-continued": "Blues", "rl": "Oranges"}  # one run: a hue per arm
FAMILIES = ("Oranges", "Blues", "Greens", "Purples", "Reds", "Greys")  # several runs: a hue family per run
SHADE = {"mle": 0.4, "mle-continued": 0.65, "rl": 0.95}  # ... and a shade per arm within it
TITLES = {"word_acc": "word / sequence accuracy", "wer": "word / sequence error rate",
          "per": "phoneme / token error rate", "wer_nostress": "WER without stress", "reward": "reward"}


class PlotError(OneLineError):
    """One line for the user, naming the file (and line) at fault."""


class NoMatplotlib(PlotError):
    """matplotlib is not installed: the `plot` extra."""


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl -> its rows; a line that is not a JSON object is refused naming FILE:LINE."""
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise PlotError(f"{path}: {err.strerror or err}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise PlotError(f"{path}:{number}: not a JSON line") from None
        if not isinstance(row, dict):
            raise PlotError(f"{path}:{number}: not a JSON object")
        rows.append(row)
    return rows


def curves(rows: list[dict]) -> dict[str, list[dict]]:
    """Validation rows by branch: "main" (MLE then RL) and "mle-continued", each point with x values "step" and
    "minutes" (the continued branch placed from the end-of-MLE validation, where it starts) and the metrics."""
    evals = [r for r in rows if r.get("phase") == "eval" and "step" in r]
    main = [r for r in evals if r.get("after") in ("mle", "rl")]
    continued = [r for r in evals if r.get("after") == "mle-continued"]
    out = {"main": [{**r, "minutes": r.get("elapsed_s", 0) / 60} for r in main]}
    ends = [r for r in main if r.get("after") == "mle"]
    if continued and ends:
        branch = max(ends, key=lambda r: r["step"])
        out["mle-continued"] = [{**branch, "minutes": branch.get("elapsed_s", 0) / 60}] + [
            {**r, "step": branch["step"] + r.get("continued", 0),
             "minutes": (branch.get("elapsed_s", 0) + r.get("since_branch_s", 0)) / 60} for r in continued]
    return out


def metric_keys(runs: list[list[dict]]) -> list[str]:
    """Every numeric metric of the runs' validation rows, in the order they first appear (the task's, then
    the reward)."""
    keys: dict[str, None] = {}
    for rows in runs:
        for row in rows:
            if row.get("phase") == "eval":
                keys.update((k, None) for k, v in row.items() if k not in NOT_METRICS
                            and isinstance(v, (int, float)) and not isinstance(v, bool))
    return list(keys)


def branch_curves(rows: list[dict]) -> dict:
    """The arms from the branch point on: {"mle": the end-of-MLE row, "rl": [...], "mle-continued": [...],
    "clock": "training" or "wall"}, each point with "since" = seconds of training since the branch. `train_s`
    (the phase's training seconds in the clock --compare-mle budgets) is read where the rows hold it; older rows
    fall back to wall time since the branch, validation included, and "clock" says so. Empty without RL rows."""
    evals = [r for r in rows if r.get("phase") == "eval" and "step" in r]
    ends = [r for r in evals if r.get("after") == "mle"]
    rl = [r for r in evals if r.get("after") == "rl"]
    continued = [r for r in evals if r.get("after") == "mle-continued"]
    if not ends or not (rl or continued):
        return {}
    branch = max(ends, key=lambda r: r["step"])
    restored = [r for r in rows if r.get("phase") == "schedule" and r.get("action") == "restore_best"]
    best = [r for r in ends if restored and r["step"] == restored[-1].get("from_step")]
    if best:  # --rl-from-best: both arms start from the best validation's model, at the end of MLE
        branch = {**best[0], "step": branch["step"], "elapsed_s": branch.get("elapsed_s", 0)}
    arms = {"rl": rl, "mle-continued": continued}
    training = all("train_s" in r for arm in arms.values() for r in arm)
    start = {"rl": branch.get("elapsed_s", 0), "mle-continued": 0}
    out = {"mle": branch, "clock": "training" if training else "wall"}
    for arm, points in arms.items():
        since = [r["train_s"] if training else
                 (r.get("since_branch_s", 0) if arm == "mle-continued" else r.get("elapsed_s", 0) - start[arm])
                 for r in points]
        out[arm] = [{**branch, "since": 0.0}] + [{**r, "since": x} for r, x in zip(points, since)]
    return out


def test_scores(rows: list[dict]) -> dict[str, dict]:
    """The test rows of the closing table: model ("mle", "mle-continued", "rl") -> its row."""
    return {r["model"]: r for r in rows if r.get("phase") == "test" and "model" in r}


def _metrics_path(arg: str) -> Path:
    path = Path(arg)
    return path / "metrics.jsonl" if path.is_dir() else path


def arm_colors(n_runs: int, plt) -> list[dict[str, tuple]]:
    """A colour per arm of each run: one run, three distinct hues; several, one hue family per run with the
    arms in three clearly different shades of it (the line styles tell the arms apart too)."""
    if n_runs == 1:
        return [{arm: plt.get_cmap(SINGLE[arm])(0.8) for arm in ARMS}]
    families = [plt.get_cmap(FAMILIES[i % len(FAMILIES)]) for i in range(n_runs)]
    return [{arm: cmap(SHADE[arm]) for arm in ARMS} for cmap in families]


def _draw_run(axes, label: str, branches: dict, colors: dict, metrics: list[str]) -> None:
    main = branches["main"]
    mle_end = max((r["step"] for r in main if r.get("after") == "mle"), default=None)
    for col, key in enumerate(metrics):
        for row, x in enumerate(("minutes", "step")):
            ax = axes[row][col]
            mle = [r for r in main if r.get("after") == "mle" and key in r]
            rl = [r for r in main if key in r and (r.get("after") == "rl" or r["step"] == mle_end)]
            cont = [r for r in branches.get("mle-continued", []) if key in r]
            for arm, points in (("mle", mle), ("rl", rl if len(rl) > 1 else []),
                                ("mle-continued", cont if len(cont) > 1 else [])):
                if points:
                    ax.plot([r[x] for r in points], [r[key] for r in points], color=colors[arm],
                            label=f"{label} {ARM_LABELS[arm]}", **STYLE[arm])


def _draw_branch(axes, label: str, arms: dict, colors: dict, metrics: list[str]) -> None:
    for col, key in enumerate(metrics):
        ax = axes[col]
        if key in arms["mle"]:
            ax.axhline(arms["mle"][key], color=colors["mle"], ls=":", lw=1.2, label=f"{label} end of MLE")
        for arm in ("mle-continued", "rl"):
            points = [r for r in arms[arm] if key in r]
            if len(points) > 1:
                ax.plot([r["since"] for r in points], [r[key] for r in points], color=colors[arm],
                        label=f"{label} {ARM_LABELS[arm]}", **STYLE[arm])


def test_lines(runs: list[tuple[str, dict]], key: str) -> str:
    """The closing table's test figures of `key`, one line per run: "label test: MLE 0.6344, ...", or ""."""
    lines = []
    for label, tests in runs:
        scored = [f"{ARM_LABELS[m]} {tests[m][key]:.4g}" for m in ARMS if key in tests.get(m, {})]
        if scored:
            lines.append(f"{label} test: " + ", ".join(scored))
    return "\n".join(lines)


def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise NoMatplotlib("matplotlib is not installed (pip install 'twophase[plot]')") from None
    return plt


def plot(paths: list[Path], out: Path, labels: list[str], metrics: list[str] | None = None) -> list[str]:
    """Draw the runs into `out`; returns the metrics drawn (`metrics`, default: all the rows hold)."""
    fig, metrics = figure(paths, labels, metrics)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    pyplot().close(fig)
    return metrics


def figure(paths: list[Path], labels: list[str], metrics: list[str] | None = None):
    """(the figure, the metrics drawn). One column per metric; rows: the arms from the branch point on (where
    a run has RL or MLE continued), then the whole run against wall time and against the step."""
    plt = pyplot()
    rows = [read_rows(p) for p in paths]
    runs = [(label, curves(r), branch_curves(r), test_scores(r)) for label, r in zip(labels, rows)]
    if not any(branches["main"] for _, branches, _, _ in runs):
        raise PlotError(f"{paths[0]}: no validation rows to plot" if len(paths) == 1 else
                        "no validation rows to plot in any of the runs")
    found = metric_keys(rows)
    unknown = [k for k in metrics or [] if k not in found]
    if unknown:
        raise PlotError(f"--metrics: no validation row holds {', '.join(unknown)} (they hold {', '.join(found)})")
    metrics = metrics or found
    branched = any(arms for _, _, arms, _ in runs)
    n_rows = 2 + branched
    fig, axes = plt.subplots(n_rows, len(metrics), figsize=(4.5 * len(metrics), 3.9 * n_rows + 0.4 * len(runs)),
                             squeeze=False)
    whole = axes[branched:]
    for (label, branches, arms, tests), colors in zip(runs, arm_colors(len(runs), plt)):
        _draw_run(whole, label, branches, colors, metrics)
        if arms:
            _draw_branch(axes[0], label, arms, colors, metrics)
    clocks = {arms["clock"] for _, _, arms, _ in runs if arms}
    since = "training time since the branch (s)" if clocks == {"training"} else "wall time since the branch (s)"
    for col, key in enumerate(metrics):
        title = "valid " + TITLES.get(key, key.replace("_", " "))
        for row, xlabel in enumerate(([since] if branched else []) + ["wall time (minutes)", "step"]):
            ax = axes[row][col]
            ax.set_title(title + (" from the branch point" if branched and row == 0 else ""), fontsize=10)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
        if branched:
            axes[0][col].set_xlim(left=0)  # the branch point
        text = test_lines([(label, tests) for label, _, _, tests in runs], key) if branched else ""
        if text:  # under the branch view's x label
            axes[0][col].annotate(text, xy=(0, 0), xycoords="axes fraction", xytext=(0, -34),
                                  textcoords="offset points", fontsize=7, va="top")
    for row in axes:
        if row[0].get_legend_handles_labels()[0]:
            row[0].legend(fontsize=7)
    fig.tight_layout()
    return fig, metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or their metrics.jsonl)")
    parser.add_argument("--out", default="curves.png", help="the PNG to write (default: curves.png)")
    parser.add_argument("--labels", help="comma-separated legend labels, one per run (default: the directories)")
    parser.add_argument("--metrics", help="comma-separated validation metrics to draw, e.g. word_acc,reward "
                                          "(default: every metric the runs log: the task's own, then reward)")
    args = parser.parse_args(argv)
    paths = [_metrics_path(r) for r in args.runs]
    labels = args.labels.split(",") if args.labels else [Path(r).name or r for r in args.runs]
    try:
        if len(labels) != len(paths):
            raise PlotError(f"--labels: {len(labels)} labels for {len(paths)} runs")
        drawn = plot(paths, Path(args.out), labels, args.metrics.split(",") if args.metrics else None)
    except PlotError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
