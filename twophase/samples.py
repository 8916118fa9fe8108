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

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def of_targets(tgt: Tensor, owner: Tensor, pad_id: int, eos_id: int) -> "Samples":
        """Target rows (N, T) that no search scored: references, the MLE rows."""
        lengths = target_mask(tgt, pad_id, eos_id).sum(1)
        zeros = torch.zeros(tgt.shape, device=tgt.device)  # (N, T)
        return Samples(tgt, lengths, owner, zeros.sum(1), zeros)

    def select(self, rows: Tensor) -> "Samples":
        return Samples(*(None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                         for f in fields(self)))

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
        return Samples(tokens, *(torch.cat([getattr(p, f) for p in parts]) for f in ("lengths", "owner", "scores")),
                       token_scores)


def best_rows(s: Samples) -> Tensor:
    """(B', T) the first row of each source present: the best one, as search returns rows best first."""
    first = torch.ones(len(s), dtype=torch.bool, device=s.owner.device)
    first[1:] = s.owner[1:] != s.owner[:-1]
    return s.tokens[first]
