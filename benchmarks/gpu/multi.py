"""Section (f): with 2 or more GPUs, 2 processes train the same parameters as 1 (torchrun, NCCL).

The same short `train.py` run three times on the built-in Karel task (tiny sizes; its data generated locally):
one process on one GPU, 2 processes data-parallel, 2 processes with --fsdp (FSDP2 shards). Each two-process
run's final parameters (checkpoint_last.pt) against the one-process run's: relative L2 distance, which should
be float32 rounding across shardings (~1e-5), not a different trajectory. Skipped (with the reason) on fewer
than 2 GPUs or on the CPU, where tests/system/test_fsdp.py and tests/system/test_distributed.py check the same
over gloo.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .common import one_line
from .karelrate import ROOT, TRAIN
from .runner import Skip

FLAGS = ["--task", "karel", "--train-size", "16", "--valid-size", "4", "--hidden-size", "32", "--embed-dim", "16",
         "--mle-batch-size", "8", "--batch-size", "4", "--beam-size", "4", "--max-len", "31", "--rescore-chunk", "4",
         "--eval-beam", "2", "--no-compare-mle", "--eval-every", "100", "--mle-steps", "3", "--rl-steps", "3",
         "--device", "cuda", "--seed", "0"]
RUNS = {"one": ([], False), "ddp": ([], True), "fsdp": (["--fsdp"], True)}  # name: (extra flags, two processes)


def train(folder: Path, name: str, extra: list, two: bool, timeout: float) -> Path:
    save = folder / name
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               TWOPHASE_CACHE_DIR=str(folder / "cache"))
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if two else \
        [sys.executable]
    proc = subprocess.run([*launch, str(TRAIN), *FLAGS, *extra, "--save-dir", str(save)], capture_output=True,
                          text=True, env=env, cwd=folder, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise RuntimeError(f"{name}: {tail[:250]}")
    return save / "checkpoint_last.pt"


def relative(a: dict, b: dict) -> float:
    diff = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a) ** 0.5
    return diff / max(sum(float(v.double().norm() ** 2) for v in a.values()) ** 0.5, 1e-300)


def run(options: dict) -> dict:
    if not options["device"].startswith("cuda"):
        raise Skip(f"needs 2 CUDA devices; running on {options['device']} (tests/system/test_fsdp.py covers gloo)")
    if torch.cuda.device_count() < 2:
        raise Skip(f"needs 2 CUDA devices; this machine has {torch.cuda.device_count()}")
    out = {"flags": FLAGS}
    with tempfile.TemporaryDirectory(prefix="twophase-gpu-multi-") as tmp:
        folder = Path(tmp)
        states = {}
        for name, (extra, two) in RUNS.items():
            try:
                path = train(folder, name, extra, two, timeout=options["limit_s"] / 2)
                states[name] = torch.load(path, map_location="cpu", weights_only=True)["model"]
            except Exception as err:  # noqa: BLE001 (the other runs still go)
                out[f"{name}_error"] = one_line(err)
        for name in ("ddp", "fsdp"):
            if "one" in states and name in states:
                out[f"{name}_rel_diff_vs_one"] = relative(states["one"], states[name])
    return out
