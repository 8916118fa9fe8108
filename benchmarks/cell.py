"""Benchmark worker: one configuration's peak memory, step time and gradient check (`python -m benchmarks`
runs each in a fresh process through `--worker JSON`).

Letters: B sources, K beam size, N = B*K rows, S source length, T max length, H hidden, V vocabulary.
"""
from __future__ import annotations

import statistics
import time

import torch

from twophase import objectives
from twophase.models.seq2seq import Seq2Seq
from twophase.phase1.onephase import one_phase_backward, one_phase_beam_search
from twophase.phase1.search import beam_search
from twophase.phase2.rescoring import rescore_backward
from twophase.system.memory import AllocationPeak, SavedTensorMeter, reset_rss_peak, rss_bytes, rss_peak_bytes
from twophase.vocab import EOS

from .seedstyle import SeedStyleSeq2Seq


def _reset_peak(device: torch.device) -> int:
    """Start a peak-memory window; returns the baseline bytes the peak is measured above."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    reset_rss_peak()  # where that fails (not Linux), the peak includes imports and model creation
    return rss_bytes()


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return rss_peak_bytes()


def _first_step_allocations(cell: dict, model, src, src_lengths) -> int:
    """On the CPU, the peak bytes held by tensors during a first step (max_memory_allocated's counterpart): a
    step with a fresh optimizer and no gradients, so it allocates both as the process's first step did. Run
    after the timed steps because the profiler behind it is slow and its event list would raise the RSS."""
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    with AllocationPeak() as alloc:
        train_step(cell, model, optimizer, src, src_lengths)
    return alloc.peak_bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(cell: dict):
    """Model (random weights, EOS banned), optimizer and a batch of full-length random sources."""
    device, dtype = torch.device(cell["device"]), getattr(torch, cell.get("dtype", "float32"))
    torch.manual_seed(cell.get("seed", 0))
    model = Seq2Seq(cell["src_vocab"], cell["vocab"], embed_dim=cell["embed"], hidden_size=cell["hidden"])
    model = model.to(device=device, dtype=dtype)
    if cell["method"] == "seed-style":
        model = SeedStyleSeq2Seq.from_model(model)
    model.banned[EOS] = True  # every candidate runs to max_len (see NOTE)
    model.eval()  # no dropout: phase one and phase two score with the same function
    src = torch.randint(4, cell["src_vocab"], (cell["batch"], cell["src_len"]), device=device)  # (B, S)
    src_lengths = torch.full((cell["batch"],), cell["src_len"], dtype=torch.long)  # (B,)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4), src, src_lengths


def _coefficients(cand, B: int, seed: int) -> torch.Tensor:
    rewards = torch.rand(len(cand), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return objectives.beam(rewards.to(cand.scores.device), cand.scores, cand.owner, B, tokens=cand.tokens)  # (N,)


def train_step(cell: dict, model, optimizer, src, src_lengths, stats: dict | None = None) -> int:
    """One step of the cell's method; returns the candidates' length T. A two-phase step adds phase two's
    counts (rows, chunks, positions, nodes) into `stats`."""
    B, K, T = cell["batch"], cell["beam"], cell["max_len"]
    optimizer.zero_grad(set_to_none=True)
    if cell["method"] in ("two-phase", "two-phase-noshare"):
        cand = beam_search(model, (src, src_lengths), K, T)
        rescore_backward(model, (src, src_lengths), cand, _coefficients(cand, B, cell["seed"]), cell["chunk"],
                         prefix_sharing=cell["method"] == "two-phase", stats=stats)
    else:
        cand, log_p = one_phase_beam_search(model, (src, src_lengths), K, T)
        one_phase_backward(log_p, _coefficients(cand, B, cell["seed"]))
        del log_p
        if isinstance(model, SeedStyleSeq2Seq):
            model.release()
    optimizer.step()
    return cand.tokens.shape[1]


def grad_difference(cell: dict, model, src, src_lengths) -> tuple[float, float]:
    """|g_one - g_two| / |g_two| (L2 over all parameters, and the worst single parameter tensor): one backward
    through the search graph against `rescore_backward` on the same candidates and coefficients. The beam
    coefficients sum to zero per source, so tensors with small, heavily cancelling gradients (the bridge) show
    fp32 rounding far above the global figure; in fp64 both are ~1e-12."""
    cand, log_p = one_phase_beam_search(model, (src, src_lengths), cell["beam"], cell["max_len"])
    coef = _coefficients(cand, cell["batch"], cell["seed"])
    model.zero_grad(set_to_none=True)
    one_phase_backward(log_p, coef)
    del log_p
    one = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    rescore_backward(model, (src, src_lengths), cand, coef, cell.get("chunk") or 64)
    diff = torch.stack([(g1 - p.grad).norm() for g1, p in zip(one, model.parameters())]).double()  # (P,)
    norm = torch.stack([p.grad.norm() for p in model.parameters()]).double()  # (P,)
    model.zero_grad(set_to_none=True)
    return float(diff.norm() / norm.norm()), float((diff / norm.clamp_min(1e-30)).max())


def run_cell(cell: dict) -> dict:
    """Measure one configuration in this process: peak memory, graph bytes, median step time."""
    if cell.get("threads"):
        torch.set_num_threads(cell["threads"])
    model, optimizer, src, src_lengths = build(cell)
    device = src.device
    base = _reset_peak(device)
    resident = list(model.parameters()) + list(model.buffers())
    with SavedTensorMeter(resident) as meter:  # the warm-up step: the meter's hooks cost time, not bytes
        T = train_step(cell, model, optimizer, src, src_lengths)
    for _ in range(cell["warmup"] - 1):
        train_step(cell, model, optimizer, src, src_lengths)
    times, counts = [], {}
    for _ in range(cell["steps"]):
        _sync(device)
        start = time.perf_counter()
        train_step(cell, model, optimizer, src, src_lengths, counts)
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = _peak(device) - base
    alloc_bytes = peak if device.type == "cuda" else _first_step_allocations(cell, model, src, src_lengths)
    out = dict(cell, peak_mb=max(0, peak) / 2**20, alloc_mb=alloc_bytes / 2**20, graph_mb=meter.peak_bytes / 2**20,
               step_s=statistics.median(times), step_times=times, target_len=T, rows=cell["batch"] * cell["beam"])
    if counts:  # phase two's decoded nodes against the candidates' token positions, summed over the timed steps
        out.update(nodes=counts["nodes"], positions=counts["positions"], chunks=counts["chunks"] / cell["steps"])
    if cell.get("grad_check"):
        out["grad_rel_diff"], out["grad_rel_diff_worst_tensor"] = grad_difference(cell, model, src, src_lengths)
    return out
