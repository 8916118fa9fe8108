"""Phase one: beam search and ancestral sampling, without an autograd graph.

Both return `Samples`: candidate rows with their source index (`owner`) and their log-probability under the
model at search time, which phase two must reproduce exactly (the model's own functions score both, in
evaluation mode). Any `SequenceModel` works; its `enc` and `state` are trees of tensors (`twophase.nested`).

Letters: B sources, K candidates per source, N = B*K rows, T max length, V vocabulary.
"""
from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from .. import nested, owners
from ..blocks import block_bytes
from ..protocol import eval_mode, num_sources, target_mask
from ..samples import Samples, best_rows  # noqa: F401  (best_rows: re-exported, validation and decode use it)
from .truncation import draw, draw_unchecked, truncate  # noqa: F401  (draw: tests reach it here)
from .stepchecks import Checks

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
    otherwise `step`'s (N, V) result is sliced. Search never proposes pad_id or bos_id, unless it is eos_id: the
    beam bans them in its candidate scores (`_extensions`), the sampler in a copy (`ban_specials`)."""

    def __init__(self, model, choose=None):
        self.model = model
        # choose(cand (n, K*V), K, sources (n,)) -> ((n, K) scores, (n, K) flat indices): which extensions each
        # source keeps; beam search keeps the K most probable, stochastic beam search (`twophase.phase1.sbs`) others.
        self.choose = choose if choose is not None else _top_k
        self.split = callable(getattr(model, "advance", None)) and callable(getattr(model, "log_probs", None))
        self.last = None
        self.specials = None
        self.checks = Checks()

    def advance(self, enc, owner: Tensor, prev: Tensor, state):
        if self.split:
            return self.model.advance(enc, owner, prev, state)
        state, self.last = self.model.step(enc, owner, prev, state)
        return state

    def log_probs(self, state, rows: slice) -> Tensor:
        """(n, V) the model's log-probabilities (not banned) for the rows `rows` of the state `advance` returned
        last, checked (`Checks.finite`)."""
        if self.split:
            logp = self.model.log_probs(nested.map_tensors(lambda x: x[rows], state))
        else:
            logp = self.last[rows]
        self.checks.finite(self.model, logp)
        return logp

    def banned(self, like: Tensor) -> Tensor:
        """(S,) the token ids search never proposes; eos_id stays open when pad_id or bos_id equal it (GPT-2's
        pad, BART's start)."""
        if self.specials is None:
            banned = sorted({self.model.pad_id, self.model.bos_id} - {self.model.eos_id})
            # made by fills, not torch.tensor(list): no copy from host memory
            self.specials = torch.cat([torch.full((1,), i, dtype=torch.long, device=like.device) for i in banned]
                                      or [torch.zeros(0, dtype=torch.long, device=like.device)])
        return self.specials

    def ban_specials(self, logp: Tensor) -> Tensor:
        """logp (n, V) checked, with -inf at the banned ids: out of place (with a graph, one-phase, logp is saved
        for backward, and a model's tensor is not ours to write)."""
        self.checks.finite(self.model, logp)
        return logp.index_fill(1, self.banned(logp), float("-inf"))


def _check_count(name: str, value, minimum: int = 1) -> None:
    """Misuse named in one line (a beam of 0 used to fail inside topk, a temperature of 0 with NaN draws)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
def _top_k(cand: Tensor, K: int, sources: Tensor):
    return cand.topk(K, dim=1)


def _score_dtype(logp: Tensor) -> torch.dtype:
    """Sums of log-probabilities: at least float32 (a bf16/fp16 logp under autocast), float64 in a float64 model."""
    return torch.promote_types(logp.dtype, torch.float32)


def _finish(model, tokens: Tensor, scores: Tensor, owner: Tensor, token_scores: Tensor | None = None,
            **extra: Tensor) -> Samples:
    """Drop impossible rows (score -inf; `Checks.finite` refused NaN and +inf), trim trailing padding columns;
    `extra` (N,) row fields of `Samples` follow the rows. Runs outside inference mode: the clones are ordinary
    tensors, which phase two may save for backward (it embeds these tokens)."""
    keep = ~torch.isneginf(scores)
    tokens, scores, owner = tokens[keep], scores[keep], owner[keep]
    lengths = target_mask(tokens, model.pad_id, model.eos_id).sum(dim=1)
    T = int(lengths.max()) if len(lengths) else 0
    if token_scores is not None:  # (N, T), never with a graph (the one-phase baseline differentiates `scores`)
        token_scores = token_scores.detach()[keep][:, :T].clone()
    return Samples(tokens[:, :T].clone(), lengths.clone(), owner.clone(), scores.clone(), token_scores,
                   **{k: v[keep].clone() for k, v in extra.items()})


def beam_search(model, source, beam_size: int, max_len: int) -> Samples:
    """The beam_size best sequences per source, best first. A hypothesis that produced EOS stays in the beam
    with its final score and competes with the open ones, so a beam at least as wide as the number of
    possible prefixes returns the exact top-K sequences of length <= max_len."""
    with eval_mode(model), torch.inference_mode():
        found = _beam_search(model, source, beam_size, max_len)
    return _finish(model, *found)


def _beam_search(model, source, beam_size: int, max_len: int, choose=None):
    """The search loop under the caller's grad mode: phase one runs it in inference mode, `onephase` with a
    graph, so both find the same candidates. Hence no in-place writes into tensors autograd may have saved.
    Once COMPACT_AT of the rows finished, steps skip them (`_compact_step`): the same candidates, less work.
    `choose(B, K, device)`, where given, makes the choice of each step's extensions (see `_Decoder`) that
    replaces the top K."""
    _check_count("beam_size", beam_size)
    _check_count("max_len", max_len, minimum=0)
    enc = model.encode(source)
    B, K, device = num_sources(enc), beam_size, nested.device_of(enc)
    dec = _Decoder(model, None if choose is None else choose(B, K, device))
    owner = owners.repeated(B, K, device)  # (B*K,) K rows per source, in order
    state = model.init_state(enc, owner)
    scores = None  # (B, K), made at the first step, in the log-probabilities' summing dtype
    tokens = torch.full((B * K, max_len), model.pad_id, dtype=torch.long, device=device)
    token_scores = None  # (B*K, max_len) each hypothesis' per-token log-probabilities, made with scores
    done = torch.zeros(B * K, dtype=torch.bool, device=device)
    prev = torch.full((B * K,), model.bos_id, dtype=torch.long, device=device)
    base = torch.arange(B, device=device)[:, None] * K  # (B, 1) first row of each source
    for t in range(max_len):
        if scores is None:  # the first step: nothing finished yet
            n_done, open_rows = 0, None
        else:  # the one read a step adds to the full step's own
            n_done, *open_rows = _counts(done, scores)
        if n_done == B * K:
            break
        if n_done and n_done >= COMPACT_AT * B * K:
            found = _compact_step(dec, enc, owner, prev, state, scores, done, per_block, V, open_rows)
            if found is None:  # nothing open: every hypothesis finished or impossible
                break
            state, scores, flat, picked, slot = found
        else:  # all rows, in the B x K layout a model may read as per-source views
            state = dec.advance(enc, owner, prev, state)
            if scores is None:
                probe = dec.log_probs(state, slice(0, 1))  # (1, V): the vocabulary size and dtype
                V = probe.shape[-1]
                per_block = max(1, block_bytes(device, BLOCK_BYTES) // max(1, K * V * probe.element_size()))
                scores = torch.full((B, K), float("-inf"), dtype=_score_dtype(probe), device=device)
                # one live hypothesis at first, or the K copies would fill the beam with duplicates
                scores[:, 0].fill_(0.0)
                token_scores = torch.zeros(B * K, max_len, dtype=scores.dtype, device=device)
            top = [_chosen(dec, dec.log_probs(state, slice(b * K, min(b + per_block, B) * K)),
                           scores[b:b + per_block], done[b * K:(b + per_block) * K], model.pad_id,
                           torch.arange(b, min(b + per_block, B), device=device))
                   for b in range(0, B, per_block)]
            scores, flat, picked = top[0] if len(top) == 1 else (torch.cat(parts) for parts in zip(*top))  # (B, K)
            slot = None
        rows = (base + flat // V).reshape(-1)  # (B*K,) which hypothesis each new one extends
        prev = (flat % V).reshape(-1)  # (B*K,)
        tokens = tokens[rows]
        tokens[:, t] = prev
        token_scores = token_scores[rows]
        token_scores[:, t] = picked.detach().reshape(-1)  # the chosen token's log p (0 extending a finished row)
        done = done[rows] | (prev == model.eos_id)
        at = rows if slot is None else slot[rows]  # (B*K,) each new hypothesis' row of state
        state = nested.select_rows(state, at)
    if scores is None:  # max_len 0
        scores = torch.zeros(B, K, device=device).index_fill_(1, torch.arange(1, K, device=device), float("-inf"))
        token_scores = torch.zeros(B * K, 0, device=device)
    dec.checks.raise_first()
    return tokens, scores.reshape(-1), owner, token_scores


def _counts(done: Tensor, scores: Tensor) -> list[int]:
    """[finished rows, then each source's open rows (neither finished nor impossible)], read in one go: the
    step's stop and compaction decisions, and compaction's whole bookkeeping."""
    B, K = scores.shape
    live = ~(done.reshape(B, K) | torch.isneginf(scores))  # (B, K)
    return torch.cat([done.sum().reshape(1), live.sum(dim=1)]).tolist()


def _positions(mask: Tensor, count: int) -> Tensor:
    """(count,) the indices of the True entries of mask (M,), in order, where the host knows there are count:
    `nonzero` without reading its size from the device (a stable sort puts them first)."""
    return torch.sort((~mask).to(torch.uint8), stable=True).indices[:count]


def _finished_row(V: int, like: Tensor, pad_id: int) -> Tensor:
    """(V,) a finished hypothesis' log-probabilities: its one continuation, pad_id, at no cost (search never
    proposes pad_id otherwise)."""
    finished = torch.full((V,), float("-inf"), dtype=like.dtype, device=like.device)
    finished[pad_id:pad_id + 1].fill_(0.0)  # a fill, not an assignment of a Python number (a copy from the host)
    return finished


def _extensions(logp: Tensor, scores: Tensor, done: Tensor, pad_id: int, banned: Tensor) -> Tensor:
    """(n, K*V) the scores of every one-token extension of n sources' hypotheses, given their log-probabilities
    logp (n*K, V), not banned: a flat index k*V + v is hypothesis k extended by token v. Banned tokens (banned
    (S,)) get -inf; a finished hypothesis, whatever its logp, its score at pad_id and -inf elsewhere. Both are
    written into the one fresh (n*K, V) sum, whether or not any hypothesis finished: no read of `done`, no
    second pass. In place but safe with a graph: an addition saves nothing for backward."""
    (n, K), V = scores.shape, logp.shape[-1]
    flat = scores.reshape(-1)  # (n*K,)
    # a finished hypothesis' sum is -inf + logp = -inf (`Checks.finite` refuses NaN and +inf in logp)
    cand = torch.where(done, float("-inf"), flat)[:, None] + logp  # (n*K, V)
    cand.index_fill_(1, banned, float("-inf"))
    cand.select(1, pad_id).copy_(torch.where(done, flat, cand.select(1, pad_id)))  # flat + 0: padding is free
    return cand.reshape(n, K * V)


def _chosen(dec: _Decoder, logp: Tensor, scores: Tensor, done: Tensor, pad_id: int, sources: Tensor):
    """The K extensions `dec.choose` keeps for n sources given their hypotheses' log-probabilities logp (n*K, V)
    (not banned): (n, K) scores, flat indices into the (K*V) candidates, and the log-probabilities of the tokens
    they add (0 where a finished hypothesis is extended by padding; where a banned token was chosen, the
    hypothesis' score is -inf and it is dropped whatever it holds)."""
    K, V = scores.shape[1], logp.shape[-1]
    best, flat = dec.choose(_extensions(logp, scores, done, pad_id, dec.banned(logp)), K, sources)
    rows = flat // V + K * torch.arange(len(flat), device=flat.device)[:, None]  # (n, K) among the n*K rows
    return best, flat, logp[rows, flat % V].masked_fill(done[rows], 0.0)


def _compact_step(dec: _Decoder, enc, owner, prev, state, scores: Tensor, done: Tensor, per_block: int, V: int,
                  open_rows: list[int]):
    """The loop's step with the decoder run on the open rows only, given how many each source has (open_rows,
    read by `_counts`: the host knows every size, so nothing more is read). Returns the new state of the nO open
    rows, scores and flat (B, K) as the full step gives them, and slot (B*K,): each row's index into that
    state; None when no row is open.

    A finished row's candidates are its score at pad_id and -inf elsewhere; an impossible row's (score -inf) are
    -inf whatever its log-probs. Neither needs the decoder, and the candidates, hence topk's choices, are the
    full step's. A source with no open row would get its K rows back in order (its scores come sorted), padding
    appended, so it is left out altogether; only exactly tied scores could have come back swapped."""
    B, K = scores.shape
    pad_id = dec.model.pad_id
    ends = list(itertools.accumulate(n for n in open_rows if n))  # open rows up to each active source, inclusive
    if not ends:
        return None
    live = ~(done.reshape(B, K) | torch.isneginf(scores))  # (B, K)
    act = _positions(live.any(dim=1), len(ends))  # (nA,) sources that can still change
    open_a = live[act].reshape(-1)  # (nA*K,) which of the active sources' rows are open
    pos = _positions(open_a, ends[-1])  # (nO,) the open rows' positions among those nA*K
    rows = (act[:, None] * K + torch.arange(K, device=act.device)).reshape(-1)[pos]  # (nO,) their rows in B*K
    owner_o = owners.declare(owner[rows], _runs(open_rows))  # (nO,) its layout, known from the counts
    state_o = dec.advance(enc, owner_o, prev[rows], nested.select_rows(state, rows))  # nO rows
    act_scores = scores[act]  # (nA, K)
    top = []
    for j in range(0, len(ends), per_block):  # blocks of sources, as the full step's (rows, V) temporaries
        j1 = min(j + per_block, len(ends))
        o = slice(ends[j - 1] if j else 0, ends[j1 - 1])
        logp, at = dec.log_probs(state_o, o), pos[o] - j * K
        best, idx = dec.choose(_open_extensions(logp, act_scores[j:j1], at, pad_id, dec.banned(logp)), K,
                               act[j:j1])
        top.append((best, idx, _open_picked(logp, at, idx, K)))
    kept = (torch.arange(K, device=act.device) * V + pad_id).expand(B, K)  # (B, K) row k extended by padding
    flat = kept.index_copy(0, act, torch.cat([f for _, f, _ in top]))  # (B, K)
    scores = scores.index_copy(0, act, torch.cat([s for s, _, _ in top]))  # (B, K)
    picked = scores.new_zeros(B, K).index_copy(0, act, torch.cat([p for _, _, p in top]).to(scores.dtype))  # (B, K)
    # A dead row's descendants are dead: whatever finite state they get (an open row's), nothing reads it but
    # a full step, which discards what it computes from it.
    slot = torch.zeros(B * K, dtype=torch.long, device=act.device).index_copy_(
        0, rows, torch.arange(len(rows), device=act.device))  # (B*K,)
    return state_o, scores, flat, picked, slot


def _runs(open_rows: list[int]) -> owners.Groups | None:
    """(b0, G) where the open rows are G per source of sources b0, b0 + 1, ... in order (each source with open
    rows has G of them, and they are consecutive); None otherwise (`owners.of_counts` of the counts)."""
    return owners.of_counts(0, open_rows)


def _open_extensions(logp: Tensor, scores: Tensor, at: Tensor, pad_id: int, banned: Tensor) -> Tensor:
    """`_extensions` for n sources given the log-probabilities logp (m, V) (not banned) of their open rows only,
    which sit at positions at (m,) among the sources' n*K rows; every other row gets the finished row's
    candidates."""
    (n, K), V = scores.shape, logp.shape[-1]
    flat = scores.reshape(-1)  # (n*K,)
    # Open rows: score + log p, the full step's very sum, banned tokens -inf. Writing them over the fresh sums is
    # safe with a graph: an addition saves nothing for backward.
    open_cand = (flat[at, None] + logp).index_fill_(1, banned, float("-inf"))  # (m, V)
    cand = (flat[:, None] + _finished_row(V, logp, pad_id)).index_copy_(0, at, open_cand)  # (n*K, V)
    return cand.reshape(n, K * V)


def _open_picked(logp: Tensor, at: Tensor, idx: Tensor, K: int) -> Tensor:
    """(n, K) the log-probability of the token each chosen extension idx (n, K) adds, read from the open rows'
    logp (m, V) at positions at (m,) among the n*K rows; 0 for a finished row's padding."""
    n, V = idx.shape[0], logp.shape[-1]
    slot = torch.full((n * K,), -1, dtype=torch.long, device=at.device).index_copy_(
        0, at, torch.arange(len(at), device=at.device))[(idx // V) + K * torch.arange(n, device=at.device)[:, None]]
    return torch.where(slot >= 0, logp[slot.clamp(min=0), idx % V], torch.zeros((), dtype=logp.dtype,
                                                                                device=logp.device))


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
    with eval_mode(model), torch.inference_mode():
        found = _sample(model, source, num_samples, max_len, temperature, generator, top_k, top_p, min_len)
    return _finish(model, *found)


def _sample(model, source, num_samples: int, max_len: int, temperature: float, generator,
            top_k: int | None = None, top_p: float | None = None, min_len: int = 0):
    """The sampling loop under the caller's grad mode (see `_beam_search`)."""
    _check_count("num_samples", num_samples)
    _check_count("max_len", max_len, minimum=0)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    enc = model.encode(source)
    B, K, device = num_sources(enc), num_samples, nested.device_of(enc)
    dec = _Decoder(model)
    owner = owners.repeated(B, K, device)  # (B*K,) K rows per source, in order
    state = model.init_state(enc, owner)
    scores = None  # (B*K,)
    tokens = torch.full((B * K, max_len), model.pad_id, dtype=torch.long, device=device)
    token_scores = None  # (B*K, max_len)
    done = torch.zeros(B * K, dtype=torch.bool, device=device)
    prev = torch.full((B * K,), model.bos_id, dtype=torch.long, device=device)
    for t in range(max_len):
        state, logp = model.step(enc, owner, prev, state)  # (B*K, V)
        logp = dec.ban_specials(logp)
        if scores is None:
            scores = torch.zeros(B * K, dtype=_score_dtype(logp), device=device)
            token_scores = torch.zeros(B * K, max_len, dtype=scores.dtype, device=device)
        with torch.no_grad():  # the draw is not differentiated: keep its (B*K, V) out of any graph
            # A row with no possible token (a constrained model's dead end, twophase.constraints) draws eos_id
            # at log p = -inf: it ends, impossible, and `_finish` drops it. Its eos gets logit 0 (probability
            # 1), written into the fresh logits or probabilities: one column, whether or not a row is stuck.
            stuck = torch.isneginf(logp.amax(1))  # (B*K,): one pass, no (B*K, V) temporary
            if top_k or top_p or min_len or temperature != 1.0:
                logits = truncate(logp / temperature, model.eos_id, t, top_k, top_p, min_len)  # (B*K, V) fresh
                probs = torch.softmax(_unstick(logits, stuck, model.eos_id, 0.0), dim=-1)
            else:
                probs = _unstick(logp.exp(), stuck, model.eos_id, 1.0)
        drawn, has_mass = draw_unchecked(probs, generator)  # (B*K,) each
        dec.checks.positive(has_mass)
        prev = drawn.masked_fill(done, model.pad_id)
        picked = logp.gather(1, drawn[:, None]).squeeze(1).masked_fill(done, 0.0)  # (B*K,)
        scores = scores + picked
        token_scores[:, t] = picked.detach()
        tokens[:, t] = prev
        done = done | (prev == model.eos_id)
        if bool(done.all()):  # the one read a step adds to the model's own
            break
    if scores is None:
        scores = torch.zeros(B * K, device=device)
        token_scores = torch.zeros(B * K, 0, device=device)
    dec.checks.raise_first()
    return tokens, scores, owner, token_scores


def _unstick(x: Tensor, stuck: Tensor, eos_id: int, value: float) -> Tensor:
    """x (N, V), fresh, with `value` at eos_id in the stuck (N,) rows, in place."""
    column = x.select(1, eos_id)
    column.copy_(torch.where(stuck, value, column))
    return x


def greedy(model, source, max_len: int) -> Samples:
    """The single most probable continuation at every step: a beam of one."""
    return beam_search(model, source, beam_size=1, max_len=max_len)
