"""The same short train.py runs on two checkouts of twophase, each in its own process: equal metrics rows (timings
left out) and equal checkpoint tensors, or the first difference of each run.

    python -m tools.samerun --before ../before --after . [--jobs beam,policy] [--keep DIR] [--ignore config.x]

Run from a checkout's folder (its `tools` on the path). Each job is a train.py command on a small synthetic TSV
task (`reverse` of digit strings, written here; or a --task of its own) with the given flags, run once with each checkout's `twophase`
on the path and its folder as the working directory, on one thread, into one path (a checkpoint records its
--save-dir), then moved aside. Then, for each job: every metrics.jsonl row of the two runs, field by field (the
timings left out: `timing`), and every checkpoint_*.pt of the two run directories, tensor by tensor (dtype,
shape, torch.equal) and every other value by ==. Exit status 1 where any differs.

Jobs (JOBS): one per objective family: the MLE phase alone, beam (with --include-reference and --mle-weight),
reinforce (sampled, greedy baseline), mrt (--rescore-chunk auto), priority (--sampler sbs), policy (two updates
per generation, KL to the start), g2p (the built-in task's recipe and data, 8 validation words), countdown (the
default task, its grammar around the model: phase two through `step`), distill (the teacher: the MLE job's
end checkpoint, the before checkout's, the same file for both sides).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TIMINGS = ("seconds", "time", "peak_mb", "peak_memory_mb")  # and every field ending in _s or naming seconds
COMMON = ["--hidden-size", "16", "--embed-dim", "8", "--batch-size", "4", "--mle-batch-size", "8", "--beam-size",
          "3", "--max-len", "8", "--eval-every", "2", "--save-every", "2", "--seed", "3", "--threads", "1",
          "--no-compare-mle"]  # the control runs for the RL phase's time: its step count varies
JOBS = {
    "mle": ["--mle-steps", "4", "--rl-steps", "0"],
    "beam": ["--mle-steps", "2", "--rl-steps", "3", "--objective", "beam", "--include-reference",
             "--mle-weight", "0.3", "--grad-accum", "2"],
    "reinforce": ["--mle-steps", "2", "--rl-steps", "3", "--objective", "reinforce", "--sampler", "sample",
                  "--baseline", "greedy"],
    "mrt": ["--mle-steps", "2", "--rl-steps", "3", "--objective", "mrt", "--sampler", "sample",
            "--rescore-chunk", "auto", "--memory-budget", "64MiB"],
    "priority": ["--mle-steps", "2", "--rl-steps", "2", "--objective", "priority", "--sampler", "sbs"],
    "policy": ["--mle-steps", "2", "--rl-steps", "4", "--objective", "policy", "--sampler", "sample",
               "--updates-per-generation", "2", "--kl-beta", "0.1", "--grad-accum", "2"],
    "g2p": ["--task", "g2p", "--valid-size", "8", "--mle-steps", "2", "--rl-steps", "2"],
    # the default task: its grammar wraps the model, so phase two decodes through `step` with autograd; MLE steps
    # of 96 rows (phase two's per-step products of 64 to 255 rows are summed once per chunk)
    "countdown": ["--task", "countdown", "--valid-size", "8", "--mle-steps", "2", "--rl-steps", "2",
                  "--mle-batch-size", "96", "--rescore-chunk", "128"],
    "distill": ["--mle-steps", "0", "--rl-steps", "3", "--objective", "distill", "--sampler", "sample",
                "--teacher", "{teacher}"],
}


def write_task(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            src = [rng.choice("abcdefg") for _ in range(rng.randint(1, 6))]
            f.write(" ".join(src) + "\t" + " ".join(src[::-1]) + "\n")


def run(checkout: Path, flags: list[str], save: Path, data: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    files = [] if "--task" in flags else ["--train", str(data / "train.tsv"), "--valid", str(data / "valid.tsv")]
    argv = [sys.executable, "train.py", *files, *COMMON, *flags, "--save-dir", str(save)]
    done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {' '.join(argv[1:])} exited {done.returncode}:\n{done.stderr[-2000:]}")


def rows(save: Path) -> list[dict]:
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not timing(k)} for line in lines]


def timing(key: str) -> bool:
    return key in TIMINGS or key.endswith("_s") or "seconds" in key


# A checkpoint's values that differ between any two processes: Python's and numpy's global streams, which no run
# seeds (and training does not draw from); their states are saved with the others.
UNSEEDED = (".rng.python", ".rng.numpy")


def differs(a, b, where: str, ignore: tuple = ()) -> str | None:
    """Where a and b (a checkpoint's values, nested) first differ, or None; a value whose path ends with one of
    `ignore` (".config.one_phase") is left out on both sides."""
    import torch
    if where.endswith(UNSEEDED) or timing(where.rpartition(".")[2]):  # the run's stats hold its seconds too
        return None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return None if same else where
    if isinstance(a, dict) and isinstance(b, dict):
        a, b = ({k: v for k, v in d.items() if not f"{where}.{k}".endswith(ignore)} for d in (a, b))
        if list(a) != list(b):
            return f"{where}: keys {sorted(set(a) ^ set(b)) or 'in another order'}"
        return next((d for k in a if (d := differs(a[k], b[k], f"{where}.{k}", ignore)) is not None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: lengths {len(a)} / {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := differs(x, y, f"{where}[{i}]", ignore))
                     is not None), None)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if a == b else f"{where}: {a!r} / {b!r}"


def compare(before: Path, after: Path, ignore: tuple = ()) -> list[str]:
    import torch
    out = []
    a, b = rows(before), rows(after)
    if len(a) != len(b):
        out.append(f"metrics.jsonl: {len(a)} / {len(b)} rows")
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            keys = sorted(k for k in set(x) | set(y) if x.get(k, "absent") != y.get(k, "absent"))
            out.append(f"metrics row {i}: " + ", ".join(f"{k} {x.get(k, 'absent')!r} / {y.get(k, 'absent')!r}"
                                                        for k in keys))
    names = sorted(p.name for p in before.glob("checkpoint_*.pt"))
    if names != sorted(p.name for p in after.glob("checkpoint_*.pt")):
        out.append(f"checkpoints: {names} / {sorted(p.name for p in after.glob('checkpoint_*.pt'))}")
    for name in names:
        if (after / name).exists():
            load = lambda p: torch.load(p, map_location="cpu", weights_only=False)  # noqa: E731
            d = differs(load(before / name), load(after / name), name, ignore)
            if d is not None:
                out.append(d)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.samerun", description=__doc__.split("\n")[0])
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated subset of {','.join(JOBS)}")
    p.add_argument("--keep", type=Path, help="write the runs here (default: a temporary folder)")
    p.add_argument("--ignore", default="", help="comma-separated checkpoint fields left out, an intended difference "
                                                "(e.g. config.one_phase: a Config field one side no longer has)")
    args = p.parse_args(argv)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="samerun-"))
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    write_task(data / "train.tsv", 40, 0)
    write_task(data / "valid.tsv", 8, 1)
    jobs = args.jobs.split(",")
    if "distill" in jobs and "mle" not in jobs:
        jobs.insert(0, "mle")  # the teacher
    bad = 0
    for job in jobs:
        flags = [f.format(teacher=folder / "before" / "mle" / "checkpoint_last.pt") for f in JOBS[job]]
        for side, checkout in (("before", args.before), ("after", args.after)):
            # both sides write to one path (a checkpoint's config records it), then the run moves aside
            shutil.rmtree(folder / side / job, ignore_errors=True)
            run(checkout.resolve(), flags, folder / "run", data)
            (folder / side).mkdir(exist_ok=True)
            shutil.move(folder / "run", folder / side / job)
        ignore = tuple("." + x for x in args.ignore.split(",") if x)
        found = compare(folder / "before" / job, folder / "after" / job, ignore)
        n = len(rows(folder / "before" / job))
        print(f"{job}: " + ("equal" if not found else "DIFFERENT") + f" ({n} metrics rows, "
              f"{len(list((folder / 'before' / job).glob('checkpoint_*.pt')))} checkpoints)")
        for line in found[:10]:
            print("   " + line)
        bad += bool(found)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
