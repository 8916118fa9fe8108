"""The Countdown experiment as one command, and its shuffled-reward control (docs/results/2026-12-05-countdown.md).

    python -m benchmarks.countdown --seeds 1,2 --out runs/countdown-exp     # every run, two at a time; the table
    python -m benchmarks.countdown --seeds 1,2 --out runs/countdown-exp --table   # the table of the runs done

Per seed, first the recipe (`train.py --task countdown --rescore-chunk 128 --seed S`): the MLE warm start, beam-RL
(Bunel et al.'s objective, K 8) and MLE continued for the RL phase's CPU time. Then, each from that run's
checkpoint_mle_end.pt (`--init-from`, `--mle-steps 0`, the recipe's other flags), RL alone with the recipe's
steps for each variant:
- `reinforce`: K sampled candidates (--sampler sample), REINFORCE with the mean baseline;
- `shuffled`: the beam objective on the checker's rewards permuted among each source's candidates (`shuffled`,
  below): the same numbers, carrying no information about which candidate is right;
- `solved-only`: the beam objective on the training problems that have a solution, alone (a TSV of those lines
  of the recipe's --train, given as --train).
Runs whose test rows are logged already are not run again. Each run's output is <out>/seed<S>/<variant>/train.log.
The table: valid and test `solved` / `solved_at_k` of every model, the training CPU time of its last phase, and
the exhaustive solver (100% by construction).

Everything after `--` is passed to every train.py command (a smaller --train-size to try the driver, say).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

from twophase.tasks.countdown.reward import countdown

from . import ROOT, checkout_env

VARIANTS = {
    "reinforce": ["--objective", "reinforce", "--sampler", "sample", "--baseline", "mean"],
    "shuffled": ["--reward", "benchmarks.countdown:shuffled"],
    "solved-only": [],  # its --train is added where the recipe's files are known
}
_shuffling = random.Random(0)


def shuffled(hypotheses: list[str], references: list[list[str]], sources: list[str]) -> list[float]:
    """The checker's rewards, permuted among the candidates of each source (grouped by their source text): each
    source keeps how many of its candidates are right, but not which."""
    true = countdown(hypotheses, references, sources)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, source in enumerate(sources):
        groups[source].append(i)
    out = list(true)
    for rows in groups.values():
        values = [true[i] for i in rows]
        _shuffling.shuffle(values)
        for i, v in zip(rows, values):
            out[i] = v
    return out


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def done(run: Path) -> bool:
    return any(r["phase"] == "test" for r in rows(run))


def train(run: Path, flags: list[str], lock: threading.Lock) -> None:
    if done(run):
        return
    run.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "train.py"), "--task", "countdown", "--rescore-chunk", "128",
               "--save-dir", str(run), "--overwrite", *flags]
    with lock:
        print(" ".join(command), flush=True)
    with open(run / "train.log", "w") as log:
        status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=checkout_env(), cwd=ROOT).returncode
    with lock:
        print(f"{run}: exit {status}", flush=True)


def solved_lines(train_tsv: Path, out: Path) -> Path:
    """The lines of the recipe's training file that carry a solution."""
    lines = [line for line in train_tsv.read_text().splitlines() if line.partition("\t")[2].strip()]
    out.write_text("".join(line + "\n" for line in lines))
    return out


def chain(out: Path, seed: int, extra: list[str], lock: threading.Lock) -> None:
    """The recipe of one seed, then each variant from its MLE warm start, one after another."""
    recipe = out / f"seed{seed}" / "beam"
    train(recipe, ["--seed", str(seed), *extra], lock)
    config = json.loads((recipe / "config.json").read_text())["config"]
    for name, flags in VARIANTS.items():
        if name == "solved-only":
            flags = ["--train", str(solved_lines(Path(config["train"]), out / f"seed{seed}" / "solved.tsv"))]
        train(out / f"seed{seed}" / name, ["--seed", str(seed), *extra, "--init-from",  # the variant's flags win
                                          str(recipe / "checkpoint_mle_end.pt"), "--mle-steps", "0",
                                          "--no-compare-mle", *flags], lock)


def cpu_seconds(run: Path) -> list[int]:
    """The closing table's `training CPU time (s)` row: one figure per column."""
    log = run / "train.log"
    for line in (log.read_text().splitlines() if log.exists() else []):
        if line.startswith("training CPU time (s)"):
            return [int(x) for x in re.findall(r"\d+", line[len("training CPU time (s)"):])]
    return []


def scores(run: Path) -> dict:
    """{model: {"valid": eval row, "test": test row}} of a run: its last validation of each model (the best MLE
    one for "mle", where RL started), and its test rows."""
    out: dict = defaultdict(dict)
    for r in rows(run):
        if r["phase"] == "eval":
            model = r["after"]
            if model != "mle" or r["solved"] >= out[model].get("valid", {}).get("solved", -1):
                out[model]["valid"] = r
        elif r["phase"] == "test":
            out[r["model"]]["test"] = r
    return out


def table(out: Path, seeds: list[int]) -> str:
    head = ("| seed | model | valid solved | valid solved@K | test solved | test solved@K | CPU s |\n"
            "|---|---|---|---|---|---|---|")
    lines = [head]
    for seed in seeds:
        recipe = out / f"seed{seed}" / "beam"
        s, cpu = scores(recipe), cpu_seconds(recipe)
        named = [("MLE warm start (end of MLE)", s.get("mle"), cpu[0] if len(cpu) == 3 else None),
                 ("MLE continued", s.get("mle-continued"), cpu[1] if len(cpu) == 3 else None),
                 ("beam-RL (the recipe)", s.get("rl"), cpu[2] if len(cpu) == 3 else None)]
        for name in VARIANTS:
            v, c = scores(out / f"seed{seed}" / name), cpu_seconds(out / f"seed{seed}" / name)
            label = {"reinforce": "REINFORCE, sampled, mean baseline", "shuffled": "beam-RL, shuffled rewards",
                     "solved-only": "beam-RL, solved problems only"}[name]
            named.append((label, v.get("rl"), c[-1] if c else None))
        for name, m, c in named:
            if not m:
                lines.append(f"| {seed} | {name} | - | - | - | - | - |")
                continue
            cells = [f"{100 * m[split][key]:.1f}" if split in m else "-" for split in ("valid", "test")
                     for key in ("solved", "solved_at_k")]
            lines.append(f"| {seed} | {name} | {' | '.join(cells)} | {c if c is not None else '-'} |")
    lines.append("| all | exhaustive solver (rpn.solve) | 100.0 | 100.0 | 100.0 | 100.0 | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.countdown", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="1,2", help="comma-separated training seeds (default: 1,2)")
    parser.add_argument("--out", default="runs/countdown-exp", help="where the runs go")
    parser.add_argument("--table", action="store_true", help="print the table of the runs done, run nothing")
    args = parser.parse_args(ours)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out).resolve()
    if not args.table:
        lock = threading.Lock()  # one chain per seed, the seeds' chains side by side (two runs at a time for two)
        threads = [threading.Thread(target=chain, args=(out, seed, extra, lock)) for seed in seeds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    print(table(out, seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
