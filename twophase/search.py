"""Phase one: beam search and ancestral sampling, without an autograd graph.

Both return `Samples`: candidate rows with their source index (`owner`) and their log-probability under the
model at search time, which phase two must reproduce exactly (the model's own functions score both, in
evaluation mode). Any `SequenceModel` works; its `enc` and `state` are trees of tensors (`twophase.tree`).

Letters: B sources, K candidates per source, N = B*K rows, T max length, V vocabulary.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import tree
from .protocol import num_sources, scoring_mode, target_mask
from .samples import Samples, best_rows  # noqa: F401  (best_rows: re-exported, validation and decode use it)

# Beam search runs the decoder on its open hypotheses only once at least this fraction of its B*K rows has
# finished. Below it, gathering the open rows and their per-row attention reads (the B x K views are lost) cost
# more than the skipped rows save: one step broke even at 0.2 finished (B=32, K=8 and 64, H=256, V=60, CPU, one
# thread). Set it above 1 to never compact, to 0 to compact as soon as one row finished.
COMPACT_AT = 0.2
# Bytes of a block of (rows, V) log-probabilities and candidate scores: in a wide beam these are phase one's
# largest temporaries, so they are built a block of sources at a time.
BLOCK_BYTES = 8 * 2**20


class _Decoder:
    """A model's `step` as two calls: `advance` every row, then the log-probabilities of a slice of rows. A model
    with its own `advance` and `log_probs` computes the latter per slice, so no (N, V) tensor exists at once;
    otherwise `step`'s (N, V) result is sliced. Search never proposes pad_id or bos_id, unless it is eos_id."""

    def __init__(self, model):
        self.model = model
        self.split = callable(getattr(model, "advance", None)) and callable(getattr(model, "log_probs", None))
        self.last = None
        self.specials = None

    def advance(self, enc, owner: Tensor, prev: Tensor, state):
        if self.split:
            return self.model.advance(enc, owner, prev, state)
        state, self.last = self.model.step(enc, owner, prev, state)
        return state

    def log_probs(self, state, rows: slice) -> Tensor:
        """(n, V) for the rows `rows` of the state `advance` returned last."""
        if self.split:
            logp = self.model.log_probs(tree.map_tensors(lambda x: x[rows], state))
        else:
            logp = self.last[rows]
        return self.ban_specials(logp)

    def ban_specials(self, logp: Tensor) -> Tensor:
        if self.specials is None:  # eos_id stays open when pad_id or bos_id equal it (GPT-2's pad, BART's start)
            banned = sorted({self.model.pad_id, self.model.bos_id} - {self.model.eos_id})
            self.specials = torch.tensor(banned, dtype=torch.long, device=logp.device)
        # Out of place: with a graph (one-phase) logp is saved for backward. Skipped when already impossible.
        if bool(torch.isneginf(logp.index_select(1, self.specials)).all()):
            return logp
        return logp.index_fill(1, self.specials, float("-inf"))


def _score_dtype(logp: Tensor) -> torch.dtype:
    """Sums of log-probabilities: at least float32 (a bf16/fp16 logp under autocast), float64 in a float64 model."""
    return torch.promote_types(logp.dtype, torch.float32)


def _finish(model, tokens: Tensor, scores: Tensor, owner: Tensor) -> Samples:
    """Drop impossible rows (score -inf), trim trailing padding columns. Runs outside inference mode: the
    clones are ordinary tensors, which phase two may save for backward (it embeds these tokens)."""
    keep = torch.isfinite(scores)
    tokens, scores, owner = tokens[keep], scores[keep], owner[keep]
    lengths = target_mask(tokens, model.pad_id, model.eos_id).sum(dim=1)
    T = int(lengths.max()) if len(lengths) else 0
    return Samples(tokens[:, :T].clone(), lengths.clone(), owner.clone(), scores.clone())


def beam_search(model, source, beam_size: int, max_len: int) -> Samples:
    """The beam_size best sequences per source, best first. A hypothesis that produced EOS stays in the beam
    with its final score and competes with the open ones, so a beam at least as wide as the number of
    possible prefixes returns the exact top-K sequences of length <= max_len."""
    with scoring_mode(model), torch.inference_mode():
        found = _beam_search(model, source, beam_size, max_len)
    return _finish(model, *found)


def _beam_search(model, source, beam_size: int, max_len: int):
    """The search loop under the caller's grad mode: phase one runs it in inference mode, `onephase` with a
    graph, so both find the same candidates. Hence no in-place writes into tensors autograd may have saved.
    Once COMPACT_AT of the rows finished, steps skip them (`_compact_step`): the same candidates, less work."""
    enc = model.encode(source)
    B, K, device = num_sources(enc), beam_size, tree.device_of(enc)
    dec = _Decoder(model)
    owner = torch.arange(B, device=device).repeat_interleave(K)  # (B*K,)
    state = model.init_state(enc, owner)
    scores = None  # (B, K), made at the first step, in the log-probabilities' summing dtype
    tokens = torch.full((B * K, max_len), model.pad_id, dtype=torch.long, device=device)
    done = torch.zeros(B * K, dtype=torch.bool, device=device)
    prev = torch.full((B * K,), model.bos_id, dtype=torch.long, device=device)
    base = torch.arange(B, device=device)[:, None] * K  # (B, 1) first row of each source
    for t in range(max_len):
        n_done = int(done.sum())  # the only host sync a step adds to the full step's own
        if n_done == B * K:
            break
        if n_done and n_done >= COMPACT_AT * B * K:
            found = _compact_step(dec, enc, owner, prev, state, scores, done, per_block, V)
            if found is None:  # nothing open: every hypothesis finished or impossible
                break
            state, scores, flat, slot = found
        else:  # all rows, in the B x K layout a model may read as per-source views
            state = dec.advance(enc, owner, prev, state)
            if scores is None:
                probe = dec.log_probs(state, slice(0, 1))  # (1, V): the vocabulary size and dtype
                V = probe.shape[-1]
                per_block = max(1, BLOCK_BYTES // max(1, K * V * probe.element_size()))
                scores = torch.full((B, K), float("-inf"), dtype=_score_dtype(probe), device=device)
                scores[:, 0] = 0.0  # one live hypothesis at first, or the K copies would fill the beam with duplicates
            top = [_best_extensions(dec.log_probs(state, slice(b * K, min(b + per_block, B) * K)),
                                    scores[b:b + per_block], done[b * K:(b + per_block) * K], model.pad_id)
                   for b in range(0, B, per_block)]
            scores, flat = torch.cat([s for s, _ in top]), torch.cat([f for _, f in top])  # (B, K) each, best first
            slot = None
        rows = (base + flat // V).reshape(-1)  # (B*K,) which hypothesis each new one extends
        prev = (flat % V).reshape(-1)  # (B*K,)
        tokens = tokens[rows]
        tokens[:, t] = prev
        done = done[rows] | (prev == model.eos_id)
        at = rows if slot is None else slot[rows]  # (B*K,) each new hypothesis' row of state
        state = tree.select_rows(state, at)
    if scores is None:  # max_len 0
        scores = torch.zeros(B, K, device=device).index_fill_(1, torch.arange(1, K, device=device), float("-inf"))
    return tokens, scores.reshape(-1), owner


def _finished_row(V: int, like: Tensor, pad_id: int) -> Tensor:
    """(V,) a finished hypothesis' log-probabilities: its one continuation, pad_id, at no cost (search never
    proposes pad_id otherwise)."""
    finished = torch.full((V,), float("-inf"), dtype=like.dtype, device=like.device)
    finished[pad_id] = 0.0
    return finished


def _best_extensions(logp: Tensor, scores: Tensor, done: Tensor, pad_id: int):
    """The K best one-token extensions of n sources' hypotheses, given their log-probabilities logp (n*K, V):
    (n, K) scores and flat indices into (K*V) candidates."""
    (n, K), V = scores.shape, logp.shape[-1]
    if bool(done.any()):  # a (n*K, V) pass, skipped while every hypothesis is open
        logp = torch.where(done[:, None], _finished_row(V, logp, pad_id), logp)  # (n*K, V)
    cand = (scores.reshape(-1, 1) + logp).reshape(n, K * V)  # (n, K*V)
    return cand.topk(K, dim=1)


def _compact_step(dec: _Decoder, enc, owner, prev, state, scores: Tensor, done: Tensor, per_block: int, V: int):
    """The loop's step with the decoder run on the open rows only. Returns the new state of the nO open rows,
    scores and flat (B, K) as the full step gives them, and slot (B*K,): each row's index into that state;
    None when no row is open.

    A finished row's candidates are its score at pad_id and -inf elsewhere; an impossible row's (score -inf) are
    -inf whatever its log-probs. Neither needs the decoder, and the candidates, hence topk's choices, are the
    full step's. A source with no open row would get its K rows back in order (its scores come sorted), padding
    appended, so it is left out altogether; only exactly tied scores could have come back swapped."""
    B, K = scores.shape
    pad_id = dec.model.pad_id
    live = ~(done.reshape(B, K) | torch.isneginf(scores))  # (B, K)
    act = live.any(dim=1).nonzero().squeeze(1)  # (nA,) sources that can still change
    if act.numel() == 0:
        return None
    open_a = live[act].reshape(-1)  # (nA*K,) which of the active sources' rows are open
    pos = open_a.nonzero().squeeze(1)  # (nO,) the open rows' positions among those nA*K
    rows = (act[:, None] * K + torch.arange(K, device=act.device)).reshape(-1)[pos]  # (nO,) their rows in B*K
    state_o = dec.advance(enc, owner[rows], prev[rows], tree.select_rows(state, rows))  # nO rows
    ends = open_a.reshape(-1, K).sum(dim=1).cumsum(0).tolist()  # open rows up to each active source, inclusive
    act_scores = scores[act]  # (nA, K)
    top = []
    for j in range(0, len(ends), per_block):  # blocks of sources, as the full step's (rows, V) temporaries
        j1 = min(j + per_block, len(ends))
        o = slice(ends[j - 1] if j else 0, ends[j1 - 1])
        top.append(_best_open_extensions(dec.log_probs(state_o, o), act_scores[j:j1], pos[o] - j * K, pad_id))
    kept = (torch.arange(K, device=act.device) * V + pad_id).expand(B, K)  # (B, K) row k extended by padding
    flat = kept.index_copy(0, act, torch.cat([f for _, f in top]))  # (B, K)
    scores = scores.index_copy(0, act, torch.cat([s for s, _ in top]))  # (B, K)
    # A dead row's descendants are dead: whatever finite state they get (an open row's), nothing reads it but
    # a full step, which discards what it computes from it.
    slot = torch.zeros(B * K, dtype=torch.long, device=act.device).index_copy_(
        0, rows, torch.arange(len(rows), device=act.device))  # (B*K,)
    return state_o, scores, flat, slot


def _best_open_extensions(logp: Tensor, scores: Tensor, at: Tensor, pad_id: int):
    """`_best_extensions` for n sources given the log-probabilities logp (m, V) of their open rows only, which
    sit at positions at (m,) among the sources' n*K rows; every other row gets the finished row's candidates."""
    (n, K), V = scores.shape, logp.shape[-1]
    flat = scores.reshape(-1)  # (n*K,)
    # Open rows: score + log p, the full step's very sum. Writing them over the fresh sum is safe with a graph:
    # an addition saves nothing for backward.
    cand = (flat[:, None] + _finished_row(V, logp, pad_id)).index_copy_(0, at, flat[at, None] + logp)  # (n*K, V)
    return cand.reshape(n, K * V).topk(K, dim=1)


def sample(model, source, num_samples: int, max_len: int, temperature: float = 1.0,
           generator: torch.Generator | None = None, *, top_k: int | None = None, top_p: float | None = None,
           min_len: int = 0) -> Samples:
    """num_samples independent draws per source. Tokens are drawn from softmax(log p / temperature), truncated
    as `generate` truncates it (`truncate`: eos banned before min_len tokens, then the top_k most probable
    tokens, then the nucleus of mass top_p); scores are always the model's own log p (temperature 1, no
    truncation), the quantity phase two differentiates, as TRL's. So with any of these REINFORCE's gradient is
    biased: the samples come from another distribution than the one whose grad log p it weighs."""
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (or None), got {top_p}")
    with scoring_mode(model), torch.inference_mode():
        found = _sample(model, source, num_samples, max_len, temperature, generator, top_k, top_p, min_len)
    return _finish(model, *found)


def truncate(logits: Tensor, eos_id: int, t: int, top_k: int | None, top_p: float | None,
             min_len: int) -> Tensor:
    """(N, V) the draw's logits at step t (0-based): -inf on eos while t < min_len, then outside each row's
    top_k, then outside its nucleus (the most probable tokens whose mass, before the last of them, is below
    top_p; at least one token). Ties at the k-th logit are all kept, as `generate`'s TopKLogitsWarper keeps them."""
    if t < min_len:
        logits = logits.index_fill(1, torch.tensor([eos_id], device=logits.device), float("-inf"))
    if top_k is not None and top_k < logits.shape[1]:
        kth = logits.topk(top_k, dim=1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=1, descending=True)  # (N, V)
        probs = torch.softmax(sorted_logits, dim=1)
        before = probs.cumsum(dim=1) - probs  # (N, V) mass of the more probable tokens
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(1, order, before >= top_p)  # vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw(probs: Tensor, generator: torch.Generator | None = None, block: int = 64) -> Tensor:
    """(N,) one token per row of probs (N, V) (non-negative, each row's mass positive, not necessarily 1), by
    inverting the row's cumulative distribution at one uniform draw: first among blocks of `block` tokens, then
    within the chosen block. `torch.multinomial` draws V exponential variates per row for one sample: on CPU a
    quarter of a sampling step's time with a small model (14 of 60 ms at N = 32, V = 8000); one cumulative sum
    over V still took 3 ms there, the blocks' sums 0.5. The sums are in float64, so each token's probability is
    kept to about 1e-16 of its row's mass, and a token (a block) of probability 0 is never drawn: the uniform
    stays strictly below the mass it is compared with."""
    N, V = probs.shape
    p = torch.nn.functional.pad(probs, (0, (-V) % block)).double().reshape(N, -1, block)  # (N, V / block, block)
    mass = p.sum(dim=2)  # (N, V / block) each block's
    cdf = mass.cumsum(dim=1)
    if not bool((cdf[:, -1] > 0).all()):  # also NaN: as torch.multinomial, refuse rather than draw anything
        raise ValueError("draw: a row of probabilities has no positive mass (or holds NaN)")
    u = torch.rand((N, 1), dtype=torch.float64, device=probs.device, generator=generator) * cdf[:, -1:]  # (N, 1)
    u = torch.minimum(u, torch.nextafter(cdf[:, -1:], torch.zeros_like(u)))
    j = torch.searchsorted(cdf, u, right=True)  # (N, 1) the first block whose cumulative mass exceeds u
    u = u - (cdf.gather(1, j) - mass.gather(1, j))  # (N, 1) what is left of u past the blocks before
    inner = p[torch.arange(N, device=probs.device), j.squeeze(1)].cumsum(dim=1)  # (N, block)
    u = torch.minimum(u.clamp_min(0), torch.nextafter(inner[:, -1:], torch.zeros_like(u)))
    return (j * block + torch.searchsorted(inner, u, right=True)).squeeze(1)


def _sample(model, source, num_samples: int, max_len: int, temperature: float, generator,
            top_k: int | None = None, top_p: float | None = None, min_len: int = 0):
    """The sampling loop under the caller's grad mode (see `_beam_search`)."""
    enc = model.encode(source)
    B, K, device = num_sources(enc), num_samples, tree.device_of(enc)
    dec = _Decoder(model)
    owner = torch.arange(B, device=device).repeat_interleave(K)  # (B*K,)
    state = model.init_state(enc, owner)
    scores = None  # (B*K,)
    tokens = torch.full((B * K, max_len), model.pad_id, dtype=torch.long, device=device)
    done = torch.zeros(B * K, dtype=torch.bool, device=device)
    prev = torch.full((B * K,), model.bos_id, dtype=torch.long, device=device)
    for t in range(max_len):
        state, logp = model.step(enc, owner, prev, state)  # (B*K, V)
        logp = dec.ban_specials(logp)
        if scores is None:
            scores = torch.zeros(B * K, dtype=_score_dtype(logp), device=device)
        with torch.no_grad():  # the draw is not differentiated: keep its (B*K, V) out of any graph
            if top_k or top_p or min_len:
                probs = torch.softmax(truncate(logp / temperature, model.eos_id, t, top_k, top_p, min_len), dim=-1)
            else:
                probs = torch.softmax(logp / temperature, dim=-1) if temperature != 1.0 else logp.exp()
        drawn = draw(probs, generator)  # (B*K,)
        prev = drawn.masked_fill(done, model.pad_id)
        scores = scores + logp.gather(1, drawn[:, None]).squeeze(1).masked_fill(done, 0.0)
        tokens[:, t] = prev
        done = done | (prev == model.eos_id)
        if bool(done.all()):
            break
    if scores is None:
        scores = torch.zeros(B * K, device=device)
    return tokens, scores, owner


def greedy(model, source, max_len: int) -> Samples:
    """The single most probable continuation at every step: a beam of one."""
    return beam_search(model, source, beam_size=1, max_len=max_len)
