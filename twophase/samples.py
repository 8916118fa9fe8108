"""`Samples`: candidate rows from phase one (or reference rows for MLE), with their sources and scores.

`token_scores` holds each row's per-token log-probabilities as search computed them (0 past the row's end), so
that a token-level objective (`twophase.policy`) can take phase one's policy as the old one; `scores` is their
sum. Hand-made Samples may leave it None.

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
    lengths: Tensor  # (N,) positions each row scores: its tokens, EOS included
    owner: Tensor  # (N,) index of each row's source
    scores: Tensor  # (N,) sum of the tokens' log-probabilities at search time (0 for reference rows)
    token_scores: Tensor | None = None  # (N, T) each position's log-probability at search time, 0 past the end
    # Stochastic beam search (`twophase.sbs`) only, None otherwise; float64. A part of `cat` without them gets NaN.
    perturbed: Tensor | None = None  # (N,) each candidate's Gumbel-perturbed score G_y ~ Gumbel(scores)
    threshold: Tensor | None = None  # (N,) kappa of the row's source: the (K+1)-th largest perturbed score of all
    #                                  its sequences (-inf when it has at most K), which all its G_y exceed

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def of_targets(tgt: Tensor, owner: Tensor, pad_id: int, eos_id: int) -> "Samples":
        """Target rows (N, T) that no search scored: references, the MLE rows."""
        lengths = target_mask(tgt, pad_id, eos_id).sum(1)
        zeros = torch.zeros(tgt.shape, device=tgt.device)  # (N, T)
        return Samples(tgt, lengths, owner, zeros.sum(1), zeros)

    @staticmethod
    def from_completions(completion_ids, owner, pad_id: int, eos_id: int, token_logps=None) -> "Samples":
        """Phase two's rows from any generator's output (vLLM, SGLang, `generate`, a file of sampled completions).

        completion_ids: N lists of ids, or an (N, T) tensor; row i completes source owner[i] (N,). The ids are
        the completion alone (no prompt, no decoder start token); a row ends at its first eos_id (what follows,
        padding included, is dropped) or at pad_id. token_logps (the same layout): the generator's
        log-probability of each id: the token_scores (0 past a row's end), and the scores their sums. Without them the
        scores are NaN, unknown: `objectives.reinforce` never reads them, `beam` and `mrt` refuse them."""
        owner = torch.as_tensor(owner, dtype=torch.long)
        tokens = _padded(completion_ids, pad_id, torch.long, owner.device)  # (N, T)
        if len(tokens) != len(owner):
            raise ValueError(f"{len(tokens)} completions but {len(owner)} owners")
        mask = target_mask(tokens, pad_id, eos_id)  # (N, T) the positions each row keeps
        tokens = tokens.masked_fill(~mask, pad_id)
        lengths = mask.sum(1)
        T = int(lengths.max()) if len(tokens) else 0
        if token_logps is None:
            scores = torch.full((len(tokens),), float("nan"), dtype=torch.float64, device=owner.device)
            return Samples(tokens[:, :T], lengths, owner, scores)
        logps = _padded(token_logps, 0.0, torch.float64, owner.device)[:, :tokens.shape[1]]  # (N, <= T)
        logps = logps.masked_fill(~mask[:, :logps.shape[1]], 0.0)
        token_scores = torch.nn.functional.pad(logps, (0, tokens.shape[1] - logps.shape[1]))[:, :T]  # (N, T)
        return Samples(tokens[:, :T], lengths, owner, logps.sum(1), token_scores)

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
        out = Samples(tokens, *(torch.cat([getattr(p, f) for p in parts]) for f in ("lengths", "owner", "scores")),
                      token_scores)
        for f in OPTIONAL:
            if any(getattr(p, f) is not None for p in parts):
                setattr(out, f, torch.cat([getattr(p, f) if getattr(p, f) is not None
                                           else torch.full((len(p),), float("nan"), dtype=torch.float64,
                                                           device=p.owner.device) for p in parts]))
        return out


OPTIONAL = ("perturbed", "threshold")  # the optional (N,) fields, carried by select and cat


def _padded(rows, fill, dtype, device) -> Tensor:
    """(N, T) rows of a tensor, or of N lists of any lengths padded with fill (at least one column)."""
    if isinstance(rows, Tensor):
        return rows.to(device=device, dtype=dtype).reshape(len(rows), -1)
    rows = [list(r) for r in rows]
    out = torch.full((len(rows), max([len(r) for r in rows] + [1])), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=dtype)
    return out.to(device)


def best_rows(s: Samples) -> Tensor:
    """(B', T) the first row of each source present: the best one, as search returns rows best first."""
    first = torch.ones(len(s), dtype=torch.bool, device=s.owner.device)
    first[1:] = s.owner[1:] != s.owner[:-1]
    return s.tokens[first]
