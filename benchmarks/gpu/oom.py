"""Section (c): phase two's out-of-memory halving, forced.

`train.py --rescore-chunk auto --memory-budget SIZE` sizes phase two's chunks from a probe of the graph's bytes
per row-step (`system.profiling.ChunkPlanner`); whatever the size, `rescore_backward` catches CUDA's
`OutOfMemoryError` inside a chunk, frees it and redoes it at half the rows (down to one), the step's gradient
staying exact because a chunk's gradient is only added once it is whole (`oom_retry`, on for CUDA).

Here phase two is asked for all N rows in one chunk while the device may hold only what the budget's chunk
needs: on CUDA the caching allocator is capped (`torch.cuda.set_per_process_memory_fraction`) at what is
allocated now plus the parameters' gradient twice, two output-layer blocks and 1.5 times the budget, so real
OOMs halve the chunk until it fits. On the CPU, whose allocator failures are not CUDA's, the OOM is simulated:
a chunk of more rows than the budget's chunk raises `OutOfMemoryError` as it starts (`simulated` true). The
report lists every chunk tried (rows, and whether it ran out of memory) and the halved run's gradient against
the same step in the budget's chunks.
"""
from __future__ import annotations

import contextlib
import re

import torch

from twophase.blocks import block_bytes
from twophase.phase2.rescoring import rescore_backward
from twophase.phase1.search import beam_search
from twophase.system.profiling import ChunkPlanner
from .common import cudnn_retry, grads, relative_error, seed_lstm, synchronize

FULL = dict(batch=16, beam=64, src_len=50, max_len=50, hidden=512, embed=256, vocab=10000, src_vocab=1000)
QUICK = dict(batch=2, beam=4, src_len=5, max_len=6, hidden=16, embed=8, vocab=40, src_vocab=20)
CHUNK_ROWS = re.compile(r"chunk of (\d+) rows")


class ChunkLog:
    """A `rescore_backward` profiler that records each chunk's rows and whether it ran out of memory; with
    `simulate_above` set, a chunk of more rows raises OutOfMemoryError as it starts."""

    def __init__(self, simulate_above: int | None = None):
        self.tried: list[dict] = []
        self.simulate_above = simulate_above

    @contextlib.contextmanager
    def section(self, name: str):
        found = CHUNK_ROWS.search(name)
        if found is None:
            yield
            return
        rows = int(found.group(1))
        entry = {"rows": rows, "out_of_memory": False}
        self.tried.append(entry)
        try:
            if self.simulate_above is not None and rows > self.simulate_above:
                raise torch.cuda.OutOfMemoryError(f"simulated: {rows} rows > {self.simulate_above}")
            yield
        except torch.cuda.OutOfMemoryError:
            entry["out_of_memory"] = True
            raise


def run(options: dict) -> dict:
    out, refusal = cudnn_retry(halving, options)
    return dict(out, cudnn_refused=refusal, cudnn="off") if refusal else out


def halving(options: dict) -> dict:
    device = torch.device(options["device"])
    sizes = QUICK if options["quick"] else FULL
    model, _, source = seed_lstm(sizes, device)
    with torch.no_grad():
        samples = beam_search(model, source, sizes["beam"], sizes["max_len"])
    N = len(samples)
    g = torch.Generator().manual_seed(3)
    coefficients = (torch.rand(N, generator=g) - 0.5).to(device)  # (N,)
    budget = options["memory_budget"]
    planned = ChunkPlanner(budget).chunk_size(model, source, samples)
    model.zero_grad(set_to_none=True)
    rescore_backward(model, source, samples, coefficients, planned, oom_retry=True)
    reference = grads(model)
    model.zero_grad(set_to_none=True)
    out = {"config": sizes, "rows": N, "memory_budget_bytes": budget, "budget_chunk": planned,
           "asked_chunk": N, "simulated": device.type != "cuda"}
    log = ChunkLog(simulate_above=planned if device.type != "cuda" else None)
    if device.type == "cuda":
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        synchronize(device)
        torch.cuda.empty_cache()
        cap = torch.cuda.memory_allocated(device) + 2 * param_bytes + 2 * block_bytes(device) + 3 * budget // 2
        total = torch.cuda.get_device_properties(device).total_memory
        out["allocator_cap_bytes"] = cap
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    try:
        rescore_backward(model, source, samples, coefficients, N, profiler=log, oom_retry=True)
        halved = grads(model)
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    out["chunks_tried"] = log.tried
    out["chunk_sizes_tried"] = sorted({e["rows"] for e in log.tried}, reverse=True)
    out["out_of_memory_errors"] = sum(e["out_of_memory"] for e in log.tried)
    out["rel_error_vs_budget_chunks"] = relative_error(halved, reference)
    if device.type == "cuda" and not out["out_of_memory_errors"]:
        out["note"] = "no chunk ran out of memory under the cap: the halving was not exercised"
    return out
