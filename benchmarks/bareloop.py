"""The LSTM's beam search against a bare decoding loop of the same arithmetic (`python -m benchmarks
--vs-loop ROUNDS`).

`bare_beam_search` is what a hand-written beam search of `Seq2Seq` computes per step when no hypothesis ever
ends (EOS banned, as in every bench cell): attention energies over the source, the context, the LSTM cell, the
output layer, log-softmax, the top K of the K*V extensions per source and the reordering of the state. None of
`search.beam_search`'s generality (finished hypotheses, compaction, V-sized blocks, the `SequenceModel`
protocol, per-token scores, the special-token ban) is in it, so the ratio of the two times is what that
generality costs. Both run without a graph on the same model and sources, alternated round by round in this
process (median of the rounds, process CPU seconds and wall seconds).

Letters: B sources, K beam size, N = B*K rows, S source length, T steps, A attention size, D encoder output
size, E embedding size, H hidden size, V vocabulary.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from twophase.phase1.search import beam_search
from twophase.vocab import BOS


def bare_beam_search(model, src, src_lengths, K: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B*K, T), scores (B, K)) of a plain beam search of the LSTM `model`, best first; every hypothesis
    runs T steps (the model must ban EOS, as the bench's do)."""
    with torch.inference_mode():
        enc = model.encode((src, src_lengths))
        B, S, D = enc.memory.shape
        A = enc.keys.shape[-1]
        h, c = enc.h0.repeat_interleave(K, 0), enc.c0.repeat_interleave(K, 0)  # (N, H) each
        dev = h.device
        mask = torch.zeros(B, 1, S, dtype=h.dtype, device=dev)  # (B, 1, S) 0 on real source tokens, -inf on padding
        mask.masked_fill_(~enc.mask[:, None, :], float("-inf"))
        bias = model.out.bias.masked_fill(model.banned, float("-inf"))  # (V,)
        v = model.attn_v.weight  # (1, A)
        scores = torch.full((B, K), float("-inf"), dtype=h.dtype, device=dev)
        scores[:, 0] = 0.0  # one live hypothesis per source at first
        prev = torch.full((B * K,), BOS, dtype=torch.long, device=dev)  # (N,)
        tokens = torch.empty(B * K, 0, dtype=torch.long, device=dev)
        base = torch.arange(B, device=dev)[:, None] * K  # (B, 1) first row of each source
        for _ in range(T):
            q = model.attn_W(h).view(B, K, 1, A)
            # (B, K, S, A) tanh in place on its own temporary, then v . it -> (B, K, S)
            energy = F.linear((q + enc.keys[:, None]).tanh_(), v).squeeze(-1)
            alpha = torch.softmax(energy + mask, dim=-1)  # (B, K, S)
            ctx = torch.bmm(alpha, enc.memory).view(B * K, D)  # (B, K, S) @ (B, S, D)
            h, c = model.cell(torch.cat([model.tgt_embed(prev), ctx], dim=-1), (h, c))  # (N, H) each
            logp = F.log_softmax(F.linear(h, model.out.weight, bias), dim=-1)  # (N, V)
            V = logp.shape[-1]
            scores, flat = (scores.view(B, K, 1) + logp.view(B, K, V)).view(B, K * V).topk(K, dim=1)  # (B, K)
            rows = (base + flat // V).view(-1)  # (N,) the hypothesis each new one extends
            prev = (flat % V).view(-1)  # (N,)
            h, c = h[rows], c[rows]
            tokens = torch.cat([tokens[rows], prev[:, None]], dim=1)  # (N, t + 1)
        return tokens, scores


def _seconds(fn, device: torch.device) -> tuple[float, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.process_time() - cpu, time.perf_counter() - wall


def vs_loop(cell: dict, rounds: int) -> dict:
    """beam_search and bare_beam_search on the cell's model and sources (bench.cell.build), one warm-up each,
    then `rounds` rounds alternating the two; median seconds and their ratios (search / loop)."""
    from .cell import build  # the bench's model: random weights, EOS banned
    if cell.get("threads"):
        torch.set_num_threads(cell["threads"])
    model, _, src, lengths = build(dict(cell, method="two-phase"))
    K, T = cell["beam"], cell["max_len"]
    runs = {"search": lambda: beam_search(model, (src, lengths), K, T),
            "loop": lambda: bare_beam_search(model, src, lengths, K, T)}
    times = {name: [] for name in runs}
    for r in range(rounds + 1):
        for name, fn in runs.items():
            seconds = _seconds(fn, src.device)
            if r:  # round 0 warms both up
                times[name].append(seconds)
    out = dict(cell, rounds=rounds)
    for name in runs:
        out[f"{name}_cpu_s"] = statistics.median(t[0] for t in times[name])
        out[f"{name}_wall_s"] = statistics.median(t[1] for t in times[name])
    out["cpu_ratio"] = out["search_cpu_s"] / out["loop_cpu_s"]
    out["wall_ratio"] = out["search_wall_s"] / out["loop_wall_s"]
    return out
