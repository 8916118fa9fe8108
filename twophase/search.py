"""Phase one: beam search and ancestral sampling, without an autograd graph.

Both return `Samples`: candidate rows with their source index (`owner`) and their log-probability under the
model at search time, which phase two must reproduce exactly (the same `Seq2Seq` functions score both).

Letters: B sources, K candidates per source, N = B*K rows, S source length, T max length, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from . import fused
from .model import Seq2Seq
from .vocab import BOS, EOS, PAD


@dataclass
class Samples:
    """Candidate sequences: tokens then EOS (when produced within max_len) then PAD, never BOS."""

    tokens: Tensor  # (N, T) long
    lengths: Tensor  # (N,) tokens before padding, EOS included
    owner: Tensor  # (N,) index of each row's source
    scores: Tensor  # (N,) sum of the tokens' log-probabilities at search time

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def of_targets(tgt: Tensor, owner: Tensor) -> "Samples":
        """Given target rows (N, T) (references: MLE rows), which no search scored."""
        return Samples(tgt, (tgt != PAD).sum(1), owner, torch.zeros(len(owner), device=tgt.device))

    def select(self, rows: Tensor) -> "Samples":
        return Samples(*(getattr(self, f.name)[rows] for f in fields(self)))

    @staticmethod
    def cat(parts: list["Samples"]) -> "Samples":
        T = max(p.tokens.shape[1] for p in parts)
        tokens = torch.cat([torch.nn.functional.pad(p.tokens, (0, T - p.tokens.shape[1]), value=PAD)
                            for p in parts])  # (sum N, T)
        return Samples(tokens, *(torch.cat([getattr(p, f) for p in parts]) for f in ("lengths", "owner", "scores")))


def best_rows(s: Samples) -> Tensor:
    """(B', T) the first row of each source present: the best one, as search returns rows best first."""
    first = torch.ones(len(s), dtype=torch.bool, device=s.owner.device)
    first[1:] = s.owner[1:] != s.owner[:-1]
    return s.tokens[first]


def _finish(tokens: Tensor, scores: Tensor, owner: Tensor) -> Samples:
    """Drop impossible rows (score -inf), trim trailing all-PAD columns. Runs outside inference mode: the
    clones are ordinary tensors, which phase two may save for backward (it embeds these tokens)."""
    keep = torch.isfinite(scores)
    tokens, scores, owner = tokens[keep], scores[keep], owner[keep]
    lengths = (tokens != PAD).sum(dim=1)
    T = int(lengths.max()) if len(lengths) else 0
    return Samples(tokens[:, :T].clone(), lengths.clone(), owner.clone(), scores.clone())


def beam_search(model: Seq2Seq, src: Tensor, src_lengths: Tensor, beam_size: int, max_len: int) -> Samples:
    """The beam_size best sequences per source, best first. A hypothesis that produced EOS stays in the beam
    with its final score and competes with the open ones, so a beam at least as wide as the number of
    possible prefixes returns the exact top-K sequences of length <= max_len."""
    with torch.inference_mode():
        found = _beam_search(model, src, src_lengths, beam_size, max_len)
    return _finish(*found)


def _beam_search(model, src, src_lengths, beam_size, max_len):
    """The search loop under the caller's grad mode: phase one runs it in inference mode, `onephase` with a
    graph, so both find the same candidates. Hence no in-place writes into tensors autograd may have saved."""
    B, K = src.shape[0], beam_size
    enc = model.encode(src, src_lengths)
    owner = torch.arange(B, device=src.device).repeat_interleave(K)  # (B*K,)
    state = model.init_state(enc, owner)
    scores = torch.full((B, K), float("-inf"), dtype=enc.h0.dtype, device=src.device)
    scores[:, 0] = 0.0  # one live hypothesis at first, or the K copies would fill the beam with duplicates
    tokens = torch.full((B * K, max_len), PAD, dtype=torch.long, device=src.device)
    done = torch.zeros(B * K, dtype=torch.bool, device=src.device)
    prev = torch.full((B * K,), BOS, dtype=torch.long, device=src.device)
    base = torch.arange(B, device=src.device)[:, None] * K  # (B, 1) first row of each source
    V = model.out.out_features
    # Sources per block of the (rows, V) log-probabilities and candidate scores: in a wide beam these V-sized
    # temporaries are phase one's largest, so they are built a block of sources at a time.
    per_block = max(1, fused.BLOCK_BYTES // max(1, K * V * enc.h0.element_size()))
    for t in range(max_len):
        state = model.advance(enc, owner, prev, state)
        top = [_best_extensions(model, state[0], scores, done, b, min(b + per_block, B), K)
               for b in range(0, B, per_block)]
        scores, flat = torch.cat([s for s, _ in top]), torch.cat([f for _, f in top])  # (B, K) each, best first
        rows = (base + flat // V).reshape(-1)  # (B*K,) which hypothesis each new one extends
        prev = (flat % V).reshape(-1)  # (B*K,)
        tokens = tokens[rows]
        tokens[:, t] = prev
        done = done[rows] | (prev == EOS)
        state = (state[0][rows], state[1][rows])
        if bool(done.all()):
            break
    return tokens, scores.reshape(-1), owner


def _best_extensions(model, h: Tensor, scores: Tensor, done: Tensor, b0: int, b1: int, K: int):
    """The K best one-token extensions of sources b0..b1's hypotheses: (b1-b0, K) scores and flat indices
    into (K*V) candidates."""
    rows = slice(b0 * K, b1 * K)
    logp = model.log_probs(h[rows])  # (n*K, V)
    V = logp.shape[-1]
    if bool(done[rows].any()):  # a (n*K, V) pass, skipped while every hypothesis is open
        # A finished hypothesis has exactly one continuation, PAD, at no cost (PAD is impossible otherwise).
        finished = torch.full((V,), float("-inf"), dtype=logp.dtype, device=logp.device)
        finished[PAD] = 0.0
        logp = torch.where(done[rows, None], finished, logp)  # (n*K, V)
    cand = (scores[b0:b1].reshape(-1, 1) + logp).reshape(b1 - b0, K * V)  # (n, K*V)
    return cand.topk(K, dim=1)


def sample(model: Seq2Seq, src: Tensor, src_lengths: Tensor, num_samples: int, max_len: int,
           temperature: float = 1.0, generator: torch.Generator | None = None) -> Samples:
    """num_samples independent draws per source. Tokens are drawn from softmax(log p / temperature); scores
    are always the model's own log p (temperature 1), the quantity phase two differentiates."""
    with torch.inference_mode():
        found = _sample(model, src, src_lengths, num_samples, max_len, temperature, generator)
    return _finish(*found)


def _sample(model, src, src_lengths, num_samples, max_len, temperature, generator):
    """The sampling loop under the caller's grad mode (see `_beam_search`)."""
    B, K = src.shape[0], num_samples
    enc = model.encode(src, src_lengths)
    owner = torch.arange(B, device=src.device).repeat_interleave(K)  # (B*K,)
    state = model.init_state(enc, owner)
    scores = torch.zeros(B * K, dtype=enc.h0.dtype, device=src.device)
    tokens = torch.full((B * K, max_len), PAD, dtype=torch.long, device=src.device)
    done = torch.zeros(B * K, dtype=torch.bool, device=src.device)
    prev = torch.full((B * K,), BOS, dtype=torch.long, device=src.device)
    for t in range(max_len):
        state, logp = model.step(enc, owner, prev, state)  # (B*K, V)
        with torch.no_grad():  # the draw is not differentiated: keep its (B*K, V) out of any graph
            probs = torch.softmax(logp / temperature, dim=-1) if temperature != 1.0 else logp.exp()
        drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B*K,)
        prev = drawn.masked_fill(done, PAD)
        scores += logp.gather(1, drawn[:, None]).squeeze(1).masked_fill(done, 0.0)
        tokens[:, t] = prev
        done = done | (prev == EOS)
        if bool(done.all()):
            break
    return tokens, scores, owner


def greedy(model: Seq2Seq, src: Tensor, src_lengths: Tensor, max_len: int) -> Samples:
    """The single most probable continuation at every step: a beam of one."""
    return beam_search(model, src, src_lengths, beam_size=1, max_len=max_len)
