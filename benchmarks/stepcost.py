"""One step's cost as the benchmarks report it: the median CPU seconds of repeated runs and its tensors' peak."""
from __future__ import annotations

import statistics
import time

import torch

from twophase.system.memory import AllocationPeak


def measure(step, model, repeats: int, keep_grads: bool = False) -> dict:
    """{"cpu_s": median process seconds of step() over `repeats` runs after a warm-up, "peak_mb": the tensors' peak
    of one more run, and with keep_grads "grads": that run's gradients (zeros where a parameter got none)}.
    Gradients are cleared before each run, so every run starts from the same memory."""
    model.zero_grad(set_to_none=True)
    step()  # warm-up
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    model.zero_grad(set_to_none=True)
    with AllocationPeak() as peak:
        step()
    out = {"cpu_s": statistics.median(times), "peak_mb": peak.peak_bytes / 2**20}
    if keep_grads:
        out["grads"] = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out
