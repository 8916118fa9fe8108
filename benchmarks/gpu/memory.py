"""Section (b): the seed's setting (the LSTM at hidden 512 with additive attention, B 16 sources, K 64 beams,
S 50 source tokens, T 50 target steps, V 10,000) trained two-phase against one-phase, with `python -m
benchmarks`'s own model, step and synthetic reward (`benchmarks.cell`).

For each method: one warm-up step, then timed steps (the device synchronised around each), inside a memory
window (`max_memory_allocated`, `max_memory_reserved`, after emptying the cache and resetting the peaks); then
one more step's host syncs, counted by the operators that read a value (`count_host_syncs`) and on CUDA by CUDA
itself (`torch.cuda.set_sync_debug_mode("warn")`, `count_cuda_syncs`): two-phase's split into phase one's per
decoder step and phase two's per chunk, one-phase's per decoder step of its search and in its backward. Where cuDNN refuses the
LSTM's backward in evaluation mode, the method is measured with cuDNN off (`cudnn: "off"`, the refusal in
`cudnn_refused`): slower, so its step time is not cuDNN's.
"""
from __future__ import annotations

import statistics

import torch

from twophase.phase1.onephase import one_phase_backward, one_phase_beam_search
from twophase.phase1.search import beam_search
from twophase.phase2.rescoring import rescore_backward
from ..__main__ import SEED_CONFIG, SPEED_CONFIG
from ..cell import _coefficients, train_step
from .common import NO_CUDA_SYNCS, MemoryWindow, cudnn_retry, one_line, seed_lstm, syncs_counted, timed

QUICK = dict(batch=2, beam=4, src_len=6, max_len=5, hidden=16, embed=8, vocab=40, src_vocab=20)
STEPS = {"full": 3, "quick": 1}


def host_syncs(method: str, cell: dict, model, source, device: torch.device) -> dict:
    """One step's host syncs, by phase, with the busiest lines: counted by the operators that read a value
    (`count_host_syncs`, any device) and, on CUDA, by CUDA itself (`cuda`)."""
    B, K, T = cell["batch"], cell["beam"], cell["max_len"]
    model.zero_grad(set_to_none=True)
    if method == "two-phase":
        with syncs_counted(device) as (one, one_cuda):
            cand = beam_search(model, source, K, T)
        coefficients = _coefficients(cand, B, cell["seed"])
        stats = {}
        with syncs_counted(device) as (two, two_cuda):
            rescore_backward(model, source, cand, coefficients, cell["chunk"], stats=stats)
        chunks = max(1, stats.get("chunks", 0))
        out = {"phase_one": one.total, "phase_one_per_decoder_step": one.total / T, "phase_two": two.total,
               "phase_two_chunks": stats.get("chunks", 0), "phase_two_per_chunk": two.total / chunks}
        cuda = None if one_cuda is None else {
            "phase_one": one_cuda.total, "phase_one_per_decoder_step": one_cuda.total / T,
            "phase_two": two_cuda.total, "phase_two_per_chunk": two_cuda.total / chunks}
    else:
        with syncs_counted(device) as (one, one_cuda):
            cand, log_p = one_phase_beam_search(model, source, K, T)
        coefficients = _coefficients(cand, B, cell["seed"])
        with syncs_counted(device) as (two, two_cuda):
            one_phase_backward(log_p, coefficients)
        del log_p
        out = {"search": one.total, "search_per_decoder_step": one.total / T, "backward": two.total}
        cuda = None if one_cuda is None else {
            "search": one_cuda.total, "search_per_decoder_step": one_cuda.total / T, "backward": two_cuda.total}
    out["top_sites"] = dict((one.by_site + two.by_site).most_common(8))
    if cuda is None:
        out["cuda"] = {"skipped": NO_CUDA_SYNCS}
    else:
        out["cuda"] = dict(cuda, top_sites=dict((one_cuda.by_site + two_cuda.by_site).most_common(8)))
    model.zero_grad(set_to_none=True)
    return out


def measure(method: str, cell: dict, device: torch.device, steps: int) -> dict:
    model, optimizer, source = seed_lstm(cell, device, cell["seed"])
    src, lengths = source
    cell = dict(cell, method=method)
    train_step(cell, model, optimizer, src, lengths)  # warm-up: allocator, kernels' first launch
    times = []
    with MemoryWindow(device) as window:
        for _ in range(steps):
            times.append(timed(lambda: train_step(cell, model, optimizer, src, lengths), device)[1])
    row = dict(method=method, chunk=cell["chunk"] if method == "two-phase" else None,
               step_s=statistics.median(times), step_times_s=times, **window.figures)
    row["host_syncs"] = host_syncs(method, cell, model, source, device)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run(options: dict) -> dict:
    device = torch.device(options["device"])
    quick = options["quick"]
    cell = dict(QUICK if quick else SEED_CONFIG, chunk=4 if quick else SPEED_CONFIG["chunk"], seed=0)
    steps = STEPS["quick" if quick else "full"]
    rows, errors = [], {}
    for method in ("two-phase", "one-phase"):
        try:
            row, refusal = cudnn_retry(measure, method, cell, device, steps)
            rows.append(dict(row, cudnn_refused=refusal, cudnn="off") if refusal else row)
        except Exception as err:  # noqa: BLE001 (the other method still runs; one-phase may not fit)
            errors[method] = one_line(err)
    out = {"config": cell, "steps": steps, "methods": rows, "errors": errors}
    by = {r["method"]: r for r in rows}
    if len(by) == 2 and min(by[m].get("max_memory_reserved_mib", by[m].get("rss_peak_above_start_mib", 0))
                            for m in by) > 0:
        key = "max_memory_reserved_mib" if device.type == "cuda" else "rss_peak_above_start_mib"
        out["ratios_one_over_two"] = {
            "memory": by["one-phase"][key] / max(by["two-phase"][key], 1e-9), "memory_figure": key,
            "step_time": by["one-phase"]["step_s"] / max(by["two-phase"]["step_s"], 1e-9)}
    return out
