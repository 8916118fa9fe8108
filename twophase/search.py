"""Phase one: beam search and ancestral sampling, without an autograd graph.

Both return `Samples`: candidate rows with their source index (`owner`) and their log-probability under the
model at search time, which phase two must reproduce exactly (the same `Seq2Seq` functions score both).

Letters: B sources, K candidates per source, N = B*K rows, S source length, T max length, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .models import fused
from .models.seq2seq import Seq2Seq
from .vocab import BOS, EOS, PAD

# Beam search runs the decoder on its open hypotheses only once at least this fraction of its B*K rows has
# finished. Below it, gathering the open rows and their per-row attention reads (the B x K views are lost) cost
# more than the skipped rows save: one step broke even at 0.2 finished (B=32, K=8 and 64, H=256, V=60, CPU, one
# thread). Set it above 1 to never compact, to 0 to compact as soon as one row finished.
COMPACT_AT = 0.2


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
    graph, so both find the same candidates. Hence no in-place writes into tensors autograd may have saved.
    Once COMPACT_AT of the rows finished, steps skip them (`_compact_step`): the same candidates, less work."""
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
        n_done = int(done.sum())  # the only host sync a step adds to the full step's own
        if n_done == B * K:
            break
        if n_done and n_done >= COMPACT_AT * B * K:
            found = _compact_step(model, enc, owner, prev, state, scores, done, per_block)
            if found is None:  # nothing open: every hypothesis finished or impossible
                break
            state, scores, flat, slot = found
        else:  # all rows, in the B x K layout `fused.groups` reads as per-source views
            state = model.advance(enc, owner, prev, state)
            top = [_best_extensions(model, state[0], scores, done, b, min(b + per_block, B), K)
                   for b in range(0, B, per_block)]
            scores, flat = torch.cat([s for s, _ in top]), torch.cat([f for _, f in top])  # (B, K) each, best first
            slot = None
        rows = (base + flat // V).reshape(-1)  # (B*K,) which hypothesis each new one extends
        prev = (flat % V).reshape(-1)  # (B*K,)
        tokens = tokens[rows]
        tokens[:, t] = prev
        done = done[rows] | (prev == EOS)
        at = rows if slot is None else slot[rows]  # (B*K,) each new hypothesis' row of state
        state = (state[0][at], state[1][at])
    return tokens, scores.reshape(-1), owner


def _finished_row(V: int, like: Tensor) -> Tensor:
    """(V,) a finished hypothesis' log-probabilities: its one continuation, PAD, at no cost (PAD is impossible
    otherwise)."""
    finished = torch.full((V,), float("-inf"), dtype=like.dtype, device=like.device)
    finished[PAD] = 0.0
    return finished


def _best_extensions(model, h: Tensor, scores: Tensor, done: Tensor, b0: int, b1: int, K: int):
    """The K best one-token extensions of sources b0..b1's hypotheses: (b1-b0, K) scores and flat indices
    into (K*V) candidates."""
    rows = slice(b0 * K, b1 * K)
    logp = model.log_probs(h[rows])  # (n*K, V)
    V = logp.shape[-1]
    if bool(done[rows].any()):  # a (n*K, V) pass, skipped while every hypothesis is open
        logp = torch.where(done[rows, None], _finished_row(V, logp), logp)  # (n*K, V)
    cand = (scores[b0:b1].reshape(-1, 1) + logp).reshape(b1 - b0, K * V)  # (n, K*V)
    return cand.topk(K, dim=1)


def _compact_step(model, enc, owner, prev, state, scores: Tensor, done: Tensor, per_block: int):
    """The loop's step with the decoder run on the open rows only. Returns the new states of the nO open rows
    ((nO, H) each), scores and flat (B, K) as the full step gives them, and slot (B*K,): each row's index into
    those states; None when no row is open.

    A finished row's candidates are its score at PAD and -inf elsewhere; an impossible row's (score -inf) are
    -inf whatever its log-probs. Neither needs the decoder, and the candidates, hence topk's choices, are the
    full step's. A source with no open row would get its K rows back in order (its scores come sorted), PAD
    appended, so it is left out altogether; only exactly tied scores could have come back swapped."""
    (B, K), V = scores.shape, model.out.out_features
    live = ~(done.reshape(B, K) | torch.isneginf(scores))  # (B, K)
    act = live.any(dim=1).nonzero().squeeze(1)  # (nA,) sources that can still change
    if act.numel() == 0:
        return None
    open_a = live[act].reshape(-1)  # (nA*K,) which of the active sources' rows are open
    pos = open_a.nonzero().squeeze(1)  # (nO,) the open rows' positions among those nA*K
    rows = (act[:, None] * K + torch.arange(K, device=act.device)).reshape(-1)[pos]  # (nO,) their rows in B*K
    h, c = state
    h_o, c_o = model.advance(enc, owner[rows], prev[rows], (h[rows], c[rows]))  # (nO, H) each
    ends = open_a.reshape(-1, K).sum(dim=1).cumsum(0).tolist()  # open rows up to each active source, inclusive
    act_scores = scores[act]  # (nA, K)
    top = []
    for j in range(0, len(ends), per_block):  # blocks of sources, as the full step's (rows, V) temporaries
        j1 = min(j + per_block, len(ends))
        o = slice(ends[j - 1] if j else 0, ends[j1 - 1])
        top.append(_best_open_extensions(model, h_o[o], act_scores[j:j1], pos[o] - j * K))
    kept = (torch.arange(K, device=act.device) * V + PAD).expand(B, K)  # (B, K) row k extended by PAD
    flat = kept.index_copy(0, act, torch.cat([f for _, f in top]))  # (B, K)
    scores = scores.index_copy(0, act, torch.cat([s for s, _ in top]))  # (B, K)
    # A dead row's descendants are dead: whatever finite state they get (an open row's), nothing reads it but
    # a full step, which discards what it computes from it.
    slot = torch.zeros(B * K, dtype=torch.long, device=act.device).index_copy_(
        0, rows, torch.arange(len(rows), device=act.device))  # (B*K,)
    return (h_o, c_o), scores, flat, slot


def _best_open_extensions(model, h: Tensor, scores: Tensor, at: Tensor):
    """`_best_extensions` for n sources given the states h (m, H) of their open rows only, which sit at
    positions at (m,) among the sources' n*K rows; every other row gets the finished row's candidates."""
    n, K = scores.shape
    logp = model.log_probs(h)  # (m, V)
    V = logp.shape[-1]
    flat = scores.reshape(-1)  # (n*K,)
    # Open rows: score + log p, the full step's very sum. Writing them over the fresh sum is safe with a graph:
    # an addition saves nothing for backward.
    cand = (flat[:, None] + _finished_row(V, logp)).index_copy_(0, at, flat[at, None] + logp)  # (n*K, V)
    return cand.reshape(n, K * V).topk(K, dim=1)


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
