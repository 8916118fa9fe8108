"""`Samples`: candidate rows from phase one (or reference rows for MLE), with their sources and scores.

`token_scores` holds each row's per-token log-probabilities as search computed them (0 past the row's end), so
that a token-level objective (`twophase.objectives.policy`) can take phase one's policy as the old one; `scores` is
their sum. Hand-made Samples may leave it None.

Letters: N rows, T longest row.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .protocol import target_mask


@dataclass
class Samples:
    """Candidate sequences: tokens, then eos_id (when produced within max_len), then pad_id; never bos_id."""

    tokens: Tensor  # (N, T) long
    lengths: Tensor  # (N,) positions each row scores: its tokens, EOS included. Where pad_id == eos_id a row
    #                  that ends without EOS before T (`from_completions`) has padding that reads as an EOS: phase
    #                  two scores `lengths` positions (at most up to the first eos_id), never that padding
    owner: Tensor  # (N,) index of each row's source
    scores: Tensor  # (N,) sum of the tokens' log-probabilities at search time (0 for reference rows)
    token_scores: Tensor | None = None  # (N, T) each position's log-probability at search time, 0 past the end
    # Stochastic beam search (`phase1.sbs`) only, None otherwise; float64. A part of `cat` without them gets NaN.
    perturbed: Tensor | None = None  # (N,) each candidate's Gumbel-perturbed score G_y ~ Gumbel(scores)
    threshold: Tensor | None = None  # (N,) kappa of the row's source: the (K+1)-th largest perturbed score of all
    #                                  its sequences (-inf when it has at most K), which all its G_y exceed
    # (N, T) float64, 0 past the end: another engine's per-token log-probabilities of the rows it generated
    # (`from_completions`' sampling_token_logps: vLLM's, SGLang's), for `policy_loss`'s mismatch correction
    sampling_token_scores: Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def of_targets(tgt: Tensor, owner: Tensor, pad_id: int, eos_id: int) -> "Samples":
        """Target rows (N, T) that no search scored: references, the MLE rows."""
        lengths = target_mask(tgt, pad_id, eos_id).sum(1)
        zeros = torch.zeros(tgt.shape, device=tgt.device)  # (N, T)
        return Samples(tgt, lengths, owner, zeros.sum(1), zeros)

    @staticmethod
    def from_completions(completion_ids, owner, pad_id: int, eos_id: int, token_logps=None, *,
                         sampling_token_logps=None, vocab_size: int | None = None, device=None) -> "Samples":
        """Phase two's rows from any generator's output (vLLM, SGLang, `generate`, a file of sampled completions).

        completion_ids: N lists of ids, or an (N, T) tensor; row i completes source owner[i] (N,). The ids are
        the completion alone (no prompt, no decoder start token). A row ends at its first eos_id (kept: the
        generator produced it), at its first pad_id (dropped, with what follows) or, for a list, at its own end:
        a row cut at the length limit, or by a stop string, has no eos_id and none is added. `lengths` counts
        each row's own positions; where pad_id == eos_id (GPT-2) the padding of a shorter row without eos_id
        reads as an eos_id in `tokens`, and phase two scores `lengths` positions, never that padding. (In an
        (N, T) tensor padded with pad_id == eos_id the first eos_id is taken as generated: pass lists to keep
        rows cut without one.)

        token_logps (the same layout): the generator's log-probability (finite, <= 0) of each id, one per kept
        id: the token_scores (0 past a row's end), and the scores their sums. Without them the scores are NaN,
        unknown: `objectives.reinforce` never reads them, `beam` and `mrt` refuse them. vocab_size, where given,
        bounds the ids. The rows are built on `device`: by default owner's (a tensor), else completion_ids',
        else the CPU; pass the model's, `next(model.parameters()).device`, for list inputs.

        sampling_token_logps (the same layout, checked as token_logps): the generating engine's own
        log-probabilities where they differ from the trainer's (vLLM, SGLang), kept as `sampling_token_scores`
        for `policy_loss`'s correction of the mismatch (TRL's vllm_importance_sampling_*); token_logps are then
        the trainer's own (`twophase.objectives.mismatch.own_token_logps`).

        Inconsistent inputs (counts, shapes, ids outside [0, vocab_size), log-probabilities that are positive,
        NaN or missing) raise ValueError in one line naming the argument and the row."""
        device = torch.device(device) if device is not None else _device_of(owner, completion_ids, token_logps)
        owner = torch.as_tensor(owner, dtype=torch.long, device=device)
        if owner.dim() != 1:
            raise ValueError(f"owner must hold one source index per completion, shape (N,); got shape "
                             f"{tuple(owner.shape)}")
        tokens, own = _padded(completion_ids, pad_id, torch.long, device, "completion_ids")  # (N, T), (N,)
        if len(tokens) != len(owner):
            raise ValueError(f"{len(tokens)} completions but {len(owner)} owners")
        if len(owner) and int(owner.min()) < 0:
            raise ValueError(f"owner row {_first(owner < 0)} is {int(owner.min())}: owners index the sources")
        N, width = tokens.shape
        at = torch.arange(width, device=device)  # (T,)
        # the first eos_id ends a row after itself, the first pad_id (other than an eos_id) before itself
        is_eos = tokens == eos_id
        is_pad = (tokens == pad_id) & ~is_eos
        stops = torch.cat([torch.where(is_eos, at + 1, width), torch.where(is_pad, at, width),
                           torch.full((N, 1), width, device=device)], dim=1)  # (N, 2T + 1)
        ends = stops.amin(1)  # (N,)
        lengths = torch.minimum(ends, own)  # (N,) a list row's own end: nothing past it was generated
        kept = at[None, :] < lengths[:, None]  # (N, T)
        _check_ids(tokens, kept, vocab_size)
        T = int(lengths.max()) if N else 0
        tokens = tokens.masked_fill(~kept, pad_id)[:, :T]  # (N, T)
        kept = kept[:, :T]
        sampling = None if sampling_token_logps is None else _log_probs(
            sampling_token_logps, "sampling_token_logps", lengths, kept, device)
        if token_logps is None:
            scores = torch.full((N,), float("nan"), dtype=torch.float64, device=device)
            return Samples(tokens, lengths, owner, scores, sampling_token_scores=sampling)
        token_scores = _log_probs(token_logps, "token_logps", lengths, kept, device)  # (N, T)
        return Samples(tokens, lengths, owner, token_scores.sum(1), token_scores, sampling_token_scores=sampling)

    def select(self, rows: Tensor) -> "Samples":
        return Samples(*(None if getattr(self, f.name) is None else getattr(self, f.name)[rows] for f in fields(self)))

    @staticmethod
    def cat(parts: list["Samples"], pad_id: int) -> "Samples":
        T = max(p.tokens.shape[1] for p in parts)
        tokens = torch.cat([torch.nn.functional.pad(p.tokens, (0, T - p.tokens.shape[1]), value=pad_id)
                            for p in parts])  # (sum N, T)
        token_scores = None
        if all(p.token_scores is not None for p in parts):  # (sum N, T), 0 past every row's end
            dtype = functools.reduce(torch.promote_types, [p.token_scores.dtype for p in parts])
            token_scores = torch.cat([torch.nn.functional.pad(p.token_scores.to(dtype), (0, T - p.tokens.shape[1]))
                                      for p in parts])
        sampling = None
        if all(p.sampling_token_scores is not None for p in parts):  # (sum N, T)
            sampling = torch.cat([torch.nn.functional.pad(p.sampling_token_scores, (0, T - p.tokens.shape[1]))
                                  for p in parts])
        out = Samples(tokens, *(torch.cat([getattr(p, f) for p in parts]) for f in ("lengths", "owner", "scores")),
                      token_scores, sampling_token_scores=sampling)
        for f in OPTIONAL:
            if any(getattr(p, f) is not None for p in parts):
                setattr(out, f, torch.cat([getattr(p, f) if getattr(p, f) is not None
                                           else torch.full((len(p),), float("nan"), dtype=torch.float64,
                                                           device=p.owner.device) for p in parts]))
        return out


OPTIONAL = ("perturbed", "threshold")  # the optional (N,) fields, carried by select and cat


def _device_of(*values) -> torch.device:
    """The device of the first tensor among values (the CPU where none is one)."""
    return next((v.device for v in values if isinstance(v, Tensor)), torch.device("cpu"))


def _first(flags: Tensor) -> int:
    """The index of the first True of a 1-D bool tensor (an error message's row)."""
    return int(flags.long().argmax())


def _padded(rows, fill, dtype, device, name: str) -> tuple[Tensor, Tensor]:
    """((N, T) rows of a tensor, or of N lists of any lengths padded with fill (at least one column), (N,) each
    row's own length: T for a tensor's rows, each list's length)."""
    if isinstance(rows, Tensor):
        if rows.dim() != 2:
            raise ValueError(f"{name} must be N rows, an (N, T) tensor or N lists; got shape {tuple(rows.shape)}")
        rows = rows.to(device=device, dtype=dtype)
        return rows, torch.full((len(rows),), rows.shape[1], dtype=torch.long, device=device)
    try:
        rows = [[float(x) if dtype.is_floating_point else int(x) for x in r] for r in rows]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be N rows of numbers (N lists, or an (N, T) tensor): {e}") from None
    out = torch.full((len(rows), max([len(r) for r in rows] + [1])), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=dtype)
    own = torch.tensor([len(r) for r in rows], dtype=torch.long)
    return out.to(device), own.to(device)


def _log_probs(values, name: str, lengths: Tensor, kept: Tensor, device) -> Tensor:
    """(N, T) float64 log-probabilities of the kept positions kept (N, T), 0 elsewhere, from values in
    completion_ids' layout; ValueError naming the argument and the row where they are missing, positive,
    infinite or NaN."""
    N, T = kept.shape
    logps, given = _padded(values, 0.0, torch.float64, device, name)  # (N', T'), (N',)
    if len(logps) != N:
        raise ValueError(f"{name} has {len(logps)} rows but completion_ids {N}")
    short = given < lengths
    if bool(short.any()):
        i = _first(short)
        raise ValueError(f"{name} row {i} has {int(given[i])} log-probabilities for its {int(lengths[i])} tokens")
    logps = torch.nn.functional.pad(logps, (0, max(0, T - logps.shape[1])))[:, :T]
    bad = kept & ~((logps <= 0) & (logps > float("-inf")))  # positive, infinite or NaN
    if bool(bad.any()):
        i = _first(bad.any(1))
        t = _first(bad[i])
        raise ValueError(f"{name} row {i} position {t} is {float(logps[i, t])}: log-probabilities are finite and "
                         f"<= 0 (the generator's logprobs of the ids it drew, not probabilities or logits)")
    return logps.masked_fill(~kept, 0.0)


def _check_ids(tokens: Tensor, kept: Tensor, vocab_size: int | None) -> None:
    """ValueError naming the first row whose kept ids (N, T) fall outside [0, vocab_size) (or below 0)."""
    outside = tokens < 0 if vocab_size is None else (tokens < 0) | (tokens >= vocab_size)  # (N, T)
    bad = kept & outside
    if bool(bad.any()):
        i = _first(bad.any(1))
        t = _first(bad[i])
        bound = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"completion_ids row {i} holds id {int(tokens[i, t])} at position {t}: ids must be "
                         f"{bound} (end a row with eos_id or pad it with pad_id, not -100)")


def best_rows(s: Samples) -> Tensor:
    """(B', T) the first row of each source present: the best one, as search returns rows best first."""
    first = torch.ones(len(s), dtype=torch.bool, device=s.owner.device)
    first[1:] = s.owner[1:] != s.owner[:-1]
    return s.tokens[first]
