"""An RL step's CPU time in two checkouts of twophase, side by side, their steps alternated in one run.

    python -m tools.beforeafter --before ../before --after . --jobs hf-t5,hf-causal,karel,g2p

Run from a checkout's folder (its `tools` and `twophase` on the path). For each job the two checkouts each get
a worker process (`stepworker.py`, run with that checkout's `twophase` on the path and its folder as the working
directory), both built first; then the driver asks them for one step at a time, in turns (before, after; then
after, before; ...), so that whatever else loads the machine loads both alike. The first --warmup steps of each
are not counted. Reported: the median over the steps of the step's process CPU seconds and of each part's, wall
seconds and steps per second (wall), and after / before.

Jobs (their sizes and flags in JOBS):
    hf-t5, hf-causal   benchmarks.hf's two-phase step on its T5 / Llama-style model, default sizes (B 8, K 16, P 128,
                       T 64, width 256, 4 layers, one thread): sampling, coefficients, phase two, no optimizer
    karel              the Karel recipe's RL step (`train.py --task karel`, K 16) with the grammar off (the
                       older checkouts have no --grammar), random weights, EOS's output bias at -30 and
                       rewards untied, as benchmarks.karel
    g2p                the default G2P run's RL step (B 32, K 8, beam objective, chunk 128) from a checkpoint
                       of its end of MLE (--g2p-checkpoint)
Every worker runs torch on one thread, under the niceness the driver itself was started with.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from twophase.config import OneLineParser

from . import stepworker

G2P_CHECKPOINT = "runs/g2p/checkpoint_mle_end.pt"  # the default run's end of MLE (python train.py writes it)
JOBS = {  # name: (worker job, default timed steps)
    "hf-t5": ({"kind": "hf", "model": "t5"}, 3),
    "hf-causal": ({"kind": "hf", "model": "causal"}, 3),
    "karel": ({"kind": "rl", "flags": ["--task", "karel", "--threads", "1"], "flags_if_known": [["--grammar", "off"]],
               "eos_bias": -30.0, "untie": True}, 20),
    "g2p": ({"kind": "rl", "flags": ["--task", "g2p", "--seed", "1", "--threads", "1", "--batch-size", "32",
                                     "--beam-size", "8", "--max-len", "32", "--rescore-chunk", "128", "--objective",
                                     "beam", "--reward", "edit", "--hidden-size", "256", "--embed-dim", "64",
                                     "--rl-lr", "2e-4"]}, 80),
}
PARTS = ("phase one", "rewards", "phase two", "update")


class Worker:
    """A stepworker process on one checkout: started (it builds its job), then asked for steps."""

    def __init__(self, side: str, checkout: Path, job: dict):
        env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   HF_HUB_DISABLE_TELEMETRY="1")
        self.proc = subprocess.Popen([sys.executable, "-c", Path(stepworker.__file__).read_text(), json.dumps(job)],
                                     cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.checkout, self.side = checkout, side

    def answer(self, key: str) -> dict:
        """The worker's next JSON line holding key (what a command prints on the way, e.g. its data, is skipped)."""
        for line in self.proc.stdout:
            if line.startswith("{"):
                row = json.loads(line)
                if key in row:
                    return row
            print(f"  {self.side}: {line.rstrip()}", flush=True)  # e.g. the data it loaded
        raise RuntimeError(f"the worker on {self.checkout} stopped (exit status {self.proc.wait()})")

    def step(self) -> dict:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self.answer("cpu_s")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def run_job(job: dict, checkouts: dict[str, Path], steps: int, warmup: int, log=print) -> dict:
    """{side: [step rows]} of the timed steps, the two sides asked in turns."""
    workers = {side: Worker(side, path, job) for side, path in checkouts.items()}  # built side by side
    rows = {side: [] for side in checkouts}
    try:
        for side, w in workers.items():
            log(f"  {side}: {w.answer('ready')['parameters']:,} parameters", flush=True)
        sides = list(checkouts)
        for i in range(warmup + steps):
            for side in sides if i % 2 == 0 else sides[::-1]:
                row = workers[side].step()
                if i >= warmup:
                    rows[side].append(row)
            if i >= warmup:
                log(f"  step {i + 1 - warmup}/{steps}: " + ", ".join(
                    f"{side} {rows[side][-1]['cpu_s']:.3f} s CPU" for side in sides), flush=True)
    finally:
        for w in workers.values():
            w.close()
    return rows


def summary(rows: list[dict]) -> dict:
    """Medians over the steps: CPU seconds of the step and of each part, wall seconds, steps per second."""
    out = {"steps": len(rows), "cpu_s": statistics.median(r["cpu_s"] for r in rows),
           "wall_s": statistics.median(r["wall_s"] for r in rows)}
    out["steps_per_s"] = 1.0 / out["wall_s"]
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    if rewards:  # the same batches and weights on both sides: about the same rewards
        out["reward_mean"] = statistics.fmean(rewards)
    for part in PARTS:
        if any(part in r["parts"] for r in rows):
            out[part] = statistics.median(r["parts"].get(part, 0.0) for r in rows)
    return out


def table(results: dict) -> str:
    """Markdown: one row per job and measure, before / after and their ratio."""
    lines = ["| job | measure | before | after | after / before |", "|---|---|---:|---:|---:|"]
    for name, sides in results.items():
        b, a = sides["before"], sides["after"]
        for key, label in [("cpu_s", "step, CPU s"), *((p, f"{p}, CPU s") for p in PARTS if p in b and p in a),
                           ("wall_s", "step, wall s"), ("steps_per_s", "steps/s (wall)"),
                           *([("reward_mean", "mean reward")] if "reward_mean" in b and "reward_mean" in a else [])]:
            ratio = a[key] / b[key] if b[key] else float("nan")
            lines.append(f"| {name} | {label} | {b[key]:.3f} | {a[key]:.3f} | {ratio:.2f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = OneLineParser(prog="python -m tools.beforeafter", description=__doc__.split("\n")[0])
    p.add_argument("--before", type=Path, required=True, help="the older checkout's folder (holds twophase/)")
    p.add_argument("--after", type=Path, required=True, help="the newer checkout's folder")
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated subset of {','.join(JOBS)}")
    p.add_argument("--steps", help="timed steps per side: one number for every job, or JOB=N,... "
                                   f"(defaults: {', '.join(f'{k} {v[1]}' for k, v in JOBS.items())})")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per side first (default: 1)")
    p.add_argument("--g2p-checkpoint", default=G2P_CHECKPOINT, help=f"the g2p job's weights ({G2P_CHECKPOINT})")
    p.add_argument("--out", type=Path, help="also write the table and the step rows to OUT.md / OUT.json")
    args = p.parse_args(argv)
    args.jobs = [j.strip() for j in args.jobs.split(",")]
    if any(j not in JOBS for j in args.jobs):
        p.error(f"--jobs: expected a comma-separated subset of {','.join(JOBS)}, got {','.join(args.jobs)!r}")
    for side in ("before", "after"):
        if not (getattr(args, side) / "twophase" / "__init__.py").is_file():
            p.error(f"--{side} {getattr(args, side)}: not a checkout of twophase (no twophase/__init__.py)")
    args.step_counts = _step_counts(p, args.steps, args.jobs)
    if "g2p" in args.jobs and not Path(args.g2p_checkpoint).is_file():
        p.error(f"--g2p-checkpoint {args.g2p_checkpoint}: no such file")
    return args


def _step_counts(p, text: str | None, jobs: list[str]) -> dict[str, int]:
    counts = {j: JOBS[j][1] for j in jobs}
    try:
        if text is None:
            return counts
        if "=" not in text:
            return dict.fromkeys(jobs, int(text))
        for item in text.split(","):
            name, _, n = item.partition("=")
            if name not in JOBS:
                raise ValueError
            counts[name] = int(n)
        return counts
    except ValueError:
        p.error(f"--steps: expected N or JOB=N,... with JOB in {','.join(JOBS)}, got {text!r}")


def commit_of(checkout: Path) -> str | None:
    """The checkout's commit (its git HEAD), or None outside git."""
    proc = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def main(argv=None) -> int:
    args = parse_args(argv)
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    commits = {side: commit_of(path) for side, path in checkouts.items()}
    print(", ".join(f"{side}: {checkouts[side]} at {commits[side]}" for side in checkouts), flush=True)
    results, raw = {}, {}
    for name in args.jobs:
        job = dict(JOBS[name][0])
        if name == "g2p":
            job["checkpoint"] = str(Path(args.g2p_checkpoint).resolve())
        print(f"{name}: {args.step_counts[name]} steps per side after {args.warmup} warm-up", flush=True)
        raw[name] = run_job(job, checkouts, args.step_counts[name], args.warmup)
        results[name] = {side: summary(rows) for side, rows in raw[name].items()}
    text = table(results)
    print("\n" + text)
    if args.out:
        args.out.with_suffix(".md").write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"checkouts": {k: str(v) for k, v in checkouts.items()},
                                                              "commits": commits, "results": results, "steps": raw},
                                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
