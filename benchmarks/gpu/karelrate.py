"""Section (h): `train.py --task karel --preset karel-paper` on the device, its steps per second, to size the paper's
whole schedule (PRESETS["karel-paper"]: its MLE steps, then its RL steps).

Two runs of the command, each stopped (SIGINT: the trainer's graceful stop) after half of --karel-seconds of
training, counted from its first step's row in metrics.jsonl (so the data's generation and the start are not
counted): the preset as it is (MLE steps), then with --mle-steps 1 (one MLE step, the end-of-MLE validation, then RL
steps; `--quick`: one run of both, --mle-steps 4 --rl-steps 4, to its end). Only flags train.py has had all along are used; --valid-size
keeps the validations short. A phase's rate is 1 / the median seconds between its consecutive step rows (a
validation's pause does not count); `paper_schedule_hours` is the preset's MLE steps / the MLE rate + its RL steps /
the RL rate, without validation and test. `--quick` shrinks the model and data so each run takes seconds.
"""
from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from twophase.config import PRESETS

from .. import ROOT, checkout_env

TRAIN = ROOT / "train.py"
PRESET = "karel-paper"
BASE = ["--task", "karel", "--preset", PRESET, "--valid-size", "16", "--log-every", "0", "--no-compare-mle"]
TINY = ["--train-size", "8", "--valid-size", "2", "--hidden-size", "8", "--embed-dim", "8", "--karel-channels", "4",
        "--karel-blocks", "1", "--karel-pair-dim", "8", "--karel-layers", "1", "--mle-batch-size", "4",
        "--batch-size", "2", "--beam-size", "2", "--eval-beam", "2", "--threads", "1"]
RUNS = {"mle": [], "rl": ["--mle-steps", "1"]}  # the phase a run measures: its extra flags
QUICK_RUNS = {"mle+rl": ["--mle-steps", "4", "--rl-steps", "4"]}  # --quick: one run of both, to its end


def step_rows(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the line being written
            continue
        if row.get("phase") in ("mle", "rl") and "step" in row and "elapsed_s" in row and "loss" in row:
            rows.append(row)
    return rows


def train_for(seconds: float, flags: list, save: Path, deadline: float) -> tuple[list[dict], str]:
    """train.py with flags until `seconds` after its first step row, its end or the monotonic `deadline`,
    whichever comes first; its step rows and how it ended. Its stderr goes to a file (a pipe nobody reads
    while it runs could fill and stall it)."""
    env = checkout_env()
    save.mkdir(parents=True, exist_ok=True)
    log = save.parent / f"{save.name}.stderr"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(TRAIN), *flags, "--save-dir", str(save)],
                                stdout=subprocess.DEVNULL, stderr=stderr, env=env, cwd=save.parent)
        first = None
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
                if first is None and step_rows(save / "metrics.jsonl"):
                    first = time.monotonic()
                if first is not None and time.monotonic() - first >= seconds:
                    break
        except BaseException:  # the inline time limit, ^C: the run goes with this section
            proc.kill()
            proc.wait()
            raise
        ended = "finished"
        if proc.poll() is None:
            ended = "stopped"
            proc.send_signal(signal.SIGINT)  # the trainer's graceful stop
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                ended = "killed"
    if ended == "finished" and proc.returncode != 0:
        tail = (log.read_text().strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise RuntimeError(f"train.py {' '.join(flags)}: {tail[:250]}")
    return step_rows(save / "metrics.jsonl"), ended


def rate(rows: list[dict], phase: str) -> dict:
    """Steps per second of `phase`'s rows: 1 / the median gap between consecutive steps (the first step, with
    its warm-up, excluded), and the mean over the whole span."""
    mine = [r for r in rows if r["phase"] == phase][1:]
    gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(mine, mine[1:]) if b["step"] == a["step"] + 1]
    if not gaps:
        return {"steps": len(mine), "steps_per_s": None}
    span = mine[-1]["elapsed_s"] - mine[0]["elapsed_s"]
    return {"steps": len(mine), "steps_per_s": 1.0 / max(statistics.median(gaps), 1e-9),
            "mean_steps_per_s": (len(mine) - 1) / max(span, 1e-9)}


def run(options: dict) -> dict:
    seconds, quick = options["karel_seconds"], options["quick"]
    flags = [*BASE, "--device", options["device"], *(TINY if quick else [])]
    runs = QUICK_RUNS if quick else RUNS
    out = {"preset": PRESET, "flags": flags, "seconds_per_run": seconds / len(runs), "runs": {}}
    rows = {}
    end = time.monotonic() + options["limit_s"] - 10  # the section's own limit, less time to stop and report
    with tempfile.TemporaryDirectory(prefix="twophase-gpu-karel-") as tmp:
        for i, (name, extra) in enumerate(runs.items()):
            later = len(runs) - 1 - i  # each later run keeps its share and ~40 s to start and validate
            deadline = end - later * (seconds / len(runs) + 40)
            rows[name], ended = train_for(seconds / len(runs), [*flags, *extra], Path(tmp) / name, deadline)
            out["runs"][name] = {"extra_flags": extra, "ended": ended}
    for phase in ("mle", "rl"):
        out[phase] = rate(rows[phase if phase in rows else "mle+rl"], phase)
    paper = PRESETS[PRESET]
    mle, rl = out["mle"]["steps_per_s"], out["rl"]["steps_per_s"]
    out["paper_steps"] = {"mle": paper["mle_steps"], "rl": paper["rl_steps"]}
    if mle and rl:
        out["paper_schedule_hours"] = (paper["mle_steps"] / mle + paper["rl_steps"] / rl) / 3600
    return out
