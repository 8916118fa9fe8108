"""`Samples`: candidate rows from phase one (or reference rows for MLE), with their sources and scores.

Letters: N rows, T longest row.
"""
from __future__ import annotations

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
        return Samples(tgt, lengths, owner, torch.zeros(len(owner), device=tgt.device))

    def select(self, rows: Tensor) -> "Samples":
        return Samples(*(None if getattr(self, f.name) is None else getattr(self, f.name)[rows] for f in fields(self)))

    @staticmethod
    def cat(parts: list["Samples"], pad_id: int) -> "Samples":
        T = max(p.tokens.shape[1] for p in parts)
        tokens = torch.cat([torch.nn.functional.pad(p.tokens, (0, T - p.tokens.shape[1]), value=pad_id)
                            for p in parts])  # (sum N, T)
        out = Samples(tokens, *(torch.cat([getattr(p, f) for p in parts]) for f in ("lengths", "owner", "scores")))
        for f in OPTIONAL:
            if any(getattr(p, f) is not None for p in parts):
                setattr(out, f, torch.cat([getattr(p, f) if getattr(p, f) is not None
                                           else torch.full((len(p),), float("nan"), dtype=torch.float64,
                                                           device=p.owner.device) for p in parts]))
        return out


OPTIONAL = ("perturbed", "threshold")  # the optional (N,) fields, carried by select and cat


def best_rows(s: Samples) -> Tensor:
    """(B', T) the first row of each source present: the best one, as search returns rows best first."""
    first = torch.ones(len(s), dtype=torch.bool, device=s.owner.device)
    first[1:] = s.owner[1:] != s.owner[:-1]
    return s.tokens[first]
