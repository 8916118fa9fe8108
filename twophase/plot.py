"""`python -m twophase.plot RUN_DIR... [--out FILE.png]`: learning curves of training runs from their metrics.jsonl.

One PNG: one column per validation metric the runs log (the task's own: word accuracy, WER, PER for G2P;
generalization, exact match, ... for Karel; a custom task's keys; then the reward), or those --metrics names,
against wall time (top row) and against the step (bottom row); per run, the MLE warm start and RL as one line (RL
dashed) and --compare-mle's continued MLE as a dotted line from the same branch point, both drawn at their own
time and step since that point. matplotlib is imported only here (the `plot` extra); without it the command ends
with one line and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROG = "python -m twophase.plot"
# Keys of validation rows that are not metrics (metrics.jsonl's bookkeeping, docs/metrics.md).
NOT_METRICS = {"step", "phase", "after", "continued", "since_branch_s", "time", "elapsed_s", "n", "model"}
TITLES = {"word_acc": "word / sequence accuracy", "wer": "word / sequence error rate",
          "per": "phoneme / token error rate", "wer_nostress": "WER without stress", "reward": "reward"}


class PlotError(Exception):
    """One line for the user, naming the file (and line) at fault."""


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


def _metrics_path(arg: str) -> Path:
    path = Path(arg)
    return path / "metrics.jsonl" if path.is_dir() else path


def _draw_run(axes, label: str, branches: dict, color, metrics: list[str]) -> None:
    main = branches["main"]
    mle_end = max((r["step"] for r in main if r.get("after") == "mle"), default=None)
    for col, key in enumerate(metrics):
        for row, x in enumerate(("minutes", "step")):
            ax = axes[row][col]
            mle = [r for r in main if r.get("after") == "mle" and key in r]
            rl = [r for r in main if key in r and (r.get("after") == "rl" or r["step"] == mle_end)]
            if mle:
                ax.plot([r[x] for r in mle], [r[key] for r in mle], "-o", ms=3, color=color, label=f"{label} MLE")
            if len(rl) > 1:
                ax.plot([r[x] for r in rl], [r[key] for r in rl], "--o", ms=3, color=color, label=f"{label} RL")
            cont = [r for r in branches.get("mle-continued", []) if key in r]
            if len(cont) > 1:
                ax.plot([r[x] for r in cont], [r[key] for r in cont], ":s", ms=3, color=color,
                        label=f"{label} MLE continued")


def plot(paths: list[Path], out: Path, labels: list[str], metrics: list[str] | None = None) -> list[str]:
    """Draw the runs into `out`; returns the metrics drawn (`metrics`, default: all the rows hold)."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("matplotlib is not installed (pip install 'twophase[plot]')") from None
    rows = [read_rows(p) for p in paths]
    runs = [(label, curves(r)) for label, r in zip(labels, rows)]
    if not any(branches["main"] for _, branches in runs):
        raise PlotError(f"{paths[0]}: no validation rows to plot" if len(paths) == 1 else
                        "no validation rows to plot in any of the runs")
    found = metric_keys(rows)
    unknown = [k for k in metrics or [] if k not in found]
    if unknown:
        raise PlotError(f"--metrics: no validation row holds {', '.join(unknown)} (they hold {', '.join(found)})")
    metrics = metrics or found
    fig, axes = plt.subplots(2, len(metrics), figsize=(4.5 * len(metrics), 8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, branches) in enumerate(runs):
        _draw_run(axes, label, branches, colors[i % len(colors)], metrics)
    for col, key in enumerate(metrics):
        for row, xlabel in enumerate(("wall time (minutes)", "step")):
            ax = axes[row][col]
            ax.set_title("valid " + TITLES.get(key, key.replace("_", " ")), fontsize=10)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return metrics


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
