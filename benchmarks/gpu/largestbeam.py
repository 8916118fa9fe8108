"""Section (g): the largest beam K that fits a 32 GiB card, two-phase against one-phase, at the seed's setting (the
LSTM at hidden 512 with additive attention, B 16 sources, S 50, T 50 steps, V 10,000; phase two in chunks of 64
rows), and both methods' `max_memory_reserved` at K 64.

The card is a memory cap on this one: `torch.cuda.set_per_process_memory_fraction(32 GiB / this device's memory)`,
so the caching allocator raises out of memory where a 32 GiB card's would (the CUDA context, about half a GiB,
is outside the cap: a real card fits a little less). A K fits when one training step (`benchmarks.cell.train_step`:
search, coefficients, backward, Adam) runs under the cap; phase two may halve its chunks on the way, as training
does. The search doubles K from 64 until a step runs out of memory or K passes K_MAX, then bisects between the
last K that fitted and the first that did not, to 1/16 of K; it stops early where the next step would not end
within the section's time (a step costs about K times the last one's per-K time), and says which way it ended.

On the CPU there is no allocator to cap: the same search runs at toy sizes against a simulated card, a step
"running out of memory" (a raised `torch.OutOfMemoryError`) when the peak bytes its graph holds
(`SavedTensorMeter`: one-phase's grows with K, two-phase's is one chunk's) pass a cap of twice one-phase's at the
first K, so the search, the OOM handling and the report are exercised.
"""
from __future__ import annotations

import time

import torch

from twophase import oom
from twophase.system.memory import SavedTensorMeter

from ..__main__ import SEED_CONFIG, SPEED_CONFIG
from ..cell import build, train_step
from .common import MemoryWindow, one_line, synchronize

CARD_GIB = 32
AT_K = 64  # the seed's K: both methods' memory there
K_MAX = 8192  # 128 times the seed's K: "fits at least this" beyond
PRECISION = 1 / 16  # bisection stops where the first failing K is within this fraction of the largest fitting
QUICK = dict(batch=2, src_len=6, max_len=5, hidden=16, embed=8, vocab=40, src_vocab=20, chunk=4)
QUICK_AT_K, QUICK_K_MAX = 2, 64
METHODS = ("one-phase", "two-phase")


def largest_fitting(fits, start: int, k_max: int, seconds_left=lambda: float("inf"),
                    precision: float = PRECISION) -> dict:
    """The largest K in [1, k_max] for which `fits(K)` returns (it raises out of memory above it): doubling from
    `start`, then bisection. `fits(K)` returns the step's figures; any error but out of memory propagates.
    A probe is not started where its expected seconds (the last probe's seconds per K, times K) exceed
    `seconds_left()`. Returns {"largest_k", "first_failing_k", "stopped" (bisected, k_max, time, or
    start_failed), "probes": [{"k", "fits", "seconds", figures or "error"}]}."""
    probes, per_k = [], None  # per_k: the seconds per K of the last step that ran whole
    lo, hi = None, None  # the largest K that fitted, the smallest that did not

    def probe(k: int) -> bool | None:
        nonlocal per_k
        if per_k is not None and per_k * k > seconds_left():
            return None
        start_s = time.perf_counter()
        try:
            figures, ok = fits(k), True
        except Exception as err:  # noqa: BLE001 (only out of memory is an answer; anything else propagates)
            if not oom.is_out_of_memory(err):
                raise
            figures, ok = {"error": one_line(err)}, False
        if not ok:
            oom.release()  # outside the except block: the failed step's tensors are gone with its traceback
        seconds = time.perf_counter() - start_s
        if ok:
            per_k = seconds / k
        probes.append(dict(k=k, fits=ok, seconds=round(seconds, 3), **figures))
        return ok

    k, stopped = start, None
    while stopped is None:  # doubling
        ok = probe(k)
        if ok is None:
            stopped = "time"
        elif ok:
            lo = k
            if k >= k_max:
                stopped = "k_max"
            else:
                k = min(2 * k, k_max)
        else:
            hi = k
            stopped = "start_failed" if lo is None else "bisected"
    while stopped == "bisected" and hi - lo > max(1, int(lo * precision)):  # bisection
        mid = (lo + hi) // 2
        ok = probe(mid)
        if ok is None:
            stopped = "time"
        elif ok:
            lo = mid
        else:
            hi = mid
    return {"largest_k": lo, "first_failing_k": hi, "stopped": stopped, "probes": probes}


def cuda_step(method: str, sizes: dict, device: torch.device):
    """fits(K) on a capped CUDA device: one step at K, its memory and seconds."""
    def fits(k: int) -> dict:
        cell = dict(sizes, beam=k, method=method, device=str(device), seed=0)
        model, optimizer, src, lengths = build(cell)
        try:
            with MemoryWindow(device) as window:
                start = time.perf_counter()
                train_step(cell, model, optimizer, src, lengths)
                synchronize(device)
            return dict(step_s=round(time.perf_counter() - start, 3), **window.figures)
        finally:
            del model, optimizer, src, lengths
    return fits


def simulated_step(method: str, sizes: dict, cap_bytes: int):
    """fits(K) on the CPU against a simulated card of `cap_bytes`: the peak bytes a step's graph holds, or a
    raised out of memory above the cap."""
    def fits(k: int) -> dict:
        cell = dict(sizes, beam=k, method=method, device="cpu", seed=0)
        model, optimizer, src, lengths = build(cell)
        with SavedTensorMeter() as graph:
            train_step(cell, model, optimizer, src, lengths)
        if graph.peak_bytes > cap_bytes:
            raise torch.OutOfMemoryError(f"simulated: a graph of {graph.peak_bytes} bytes over the card's {cap_bytes}")
        return {"graph_peak_bytes": graph.peak_bytes}
    return fits


def memory_cap(device: torch.device) -> dict:
    """Cap this process's CUDA memory to a CARD_GIB card; what was set."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, CARD_GIB * 2 ** 30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return {"card_gib": CARD_GIB, "device_gib": round(total / 2 ** 30, 1), "fraction": round(fraction, 4)}


def run(options: dict) -> dict:
    device = torch.device(options["device"])
    quick = device.type != "cuda"
    end = time.monotonic() + options["limit_s"] - 5  # the section's limit, less time to report
    sizes = QUICK if quick else dict(SEED_CONFIG, chunk=SPEED_CONFIG["chunk"])
    at_k, k_max = (QUICK_AT_K, QUICK_K_MAX) if quick else (AT_K, K_MAX)
    out = {"config": {k: v for k, v in sizes.items() if k != "beam"}, "at_k": at_k, "k_max": k_max}
    if quick:
        # one-phase's graph grows with K and soon fails; two-phase's is a chunk's, whatever K
        cap = 2 * simulated_step("one-phase", sizes, 2 ** 62)(at_k)["graph_peak_bytes"]
        out["card"] = {"simulated": True, "cap_bytes": cap}
        steps = {m: simulated_step(m, sizes, cap) for m in METHODS}
    else:
        out["card"] = dict(memory_cap(device), simulated=False)
        steps = {m: cuda_step(m, sizes, device) for m in METHODS}
    out["methods"] = {}
    for method in METHODS:
        # one-phase first, with half of what is left at each probe: its graph stops it at a small K, quickly;
        # two-phase's steps at large K are the long ones, and it has the rest
        share = 2 if method == "one-phase" else 1
        try:
            steps[method](at_k)  # warm-up (kernels' first launch, lazy imports), so steps' seconds are the work's
            out["methods"][method] = largest_fitting(steps[method], at_k, k_max,
                                                     seconds_left=lambda: (end - time.monotonic()) / share)
        except Exception as err:  # noqa: BLE001 (the other method still runs)
            out["methods"][method] = {"error": one_line(err)}
    for found in out["methods"].values():  # the step at the seed's K (the search's first)
        found["at_k"] = next((p for p in found.get("probes", []) if p["k"] == at_k), None)
    if not quick:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    return out
