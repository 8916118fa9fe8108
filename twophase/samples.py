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

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def of_targets(tgt: Tensor, owner: Tensor, pad_id: int, eos_id: int) -> "Samples":
        """Target rows (N, T) that no search scored: references, the MLE rows."""
        lengths = target_mask(tgt, pad_id, eos_id).sum(1)
        return Samples(tgt, lengths, owner, torch.zeros(len(owner), device=tgt.device))

    @staticmethod
    def from_completions(completion_ids, owner, pad_id: int, eos_id: int, token_logps=None) -> "Samples":
        """Phase two's rows from any generator's output (vLLM, SGLang, `generate`, a file of sampled completions).

        completion_ids: N lists of ids, or an (N, T) tensor; row i completes source owner[i] (N,). The ids are
        the completion alone (no prompt, no decoder start token); a row ends at its first eos_id (what follows,
        padding included, is dropped) or at pad_id. token_logps (the same layout): the generator's
        log-probability of each id; the scores are their sums over each row's kept positions. Without them the
        scores are NaN, unknown: `objectives.reinforce` never reads them, `beam` and `mrt` refuse them."""
        rows = [list(map(int, r)) for r in (completion_ids.tolist() if isinstance(completion_ids, Tensor)
                                            else completion_ids)]
        owner = torch.as_tensor(owner, dtype=torch.long)
        if len(rows) != len(owner):
            raise ValueError(f"{len(rows)} completions but {len(owner)} owners")
        T = max([len(r) for r in rows] + [1])
        tokens = torch.full((len(rows), T), pad_id, dtype=torch.long, device=owner.device)  # (N, T)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask = target_mask(tokens, pad_id, eos_id)  # (N, T) the positions each row keeps
        tokens = torch.where(mask, tokens, torch.full_like(tokens, pad_id))
        lengths = mask.sum(1)
        if token_logps is None:
            scores = torch.full((len(rows),), float("nan"), dtype=torch.float64, device=owner.device)
        else:
            scores = torch.stack([torch.as_tensor(lp, dtype=torch.float64)[:n].sum() if n else
                                  torch.zeros((), dtype=torch.float64) for lp, n in zip(token_logps, lengths.tolist())])
        T = int(lengths.max()) if len(rows) else 0
        return Samples(tokens[:, :T], lengths, owner, scores.to(owner.device))

    def select(self, rows: Tensor) -> "Samples":
        return Samples(*(getattr(self, f.name)[rows] for f in fields(self)))

    @staticmethod
    def cat(parts: list["Samples"], pad_id: int) -> "Samples":
        T = max(p.tokens.shape[1] for p in parts)
        tokens = torch.cat([torch.nn.functional.pad(p.tokens, (0, T - p.tokens.shape[1]), value=pad_id)
                            for p in parts])  # (sum N, T)
        return Samples(tokens, *(torch.cat([getattr(p, f) for p in parts]) for f in ("lengths", "owner", "scores")))


def best_rows(s: Samples) -> Tensor:
    """(B', T) the first row of each source present: the best one, as search returns rows best first."""
    first = torch.ones(len(s), dtype=torch.bool, device=s.owner.device)
    first[1:] = s.owner[1:] != s.owner[:-1]
    return s.tokens[first]
