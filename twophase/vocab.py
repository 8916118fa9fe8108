"""Token vocabularies.

Every vocabulary starts with the same four specials, so model code can use the ids as constants:
PAD (0) pads batches and never receives probability, BOS (1) starts decoding and never receives probability,
EOS (2) ends a sequence, UNK (3) stands for anything unseen in training.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import torch

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


class Vocab:
    """A bijection between tokens and ids; ids 0-3 are the specials."""

    def __init__(self, tokens: Sequence[str]):
        if tuple(tokens[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a vocabulary must start with {SPECIALS}")
        self.itos = list(tokens)
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ValueError("duplicate tokens in vocabulary")

    @classmethod
    def build(cls, sequences: Iterable[Sequence[str]], min_count: int = 1) -> "Vocab":
        """Most frequent first (ties alphabetical), so the same data always gives the same ids."""
        counts = Counter(t for seq in sequences for t in seq)
        kept = sorted((t for t, c in counts.items() if c >= min_count and t not in SPECIALS),
                      key=lambda t: (-counts[t], t))
        return cls(list(SPECIALS) + kept)

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: Sequence[str]) -> list[int]:
        return [self.stoi.get(t, UNK) for t in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Tokens up to (not including) the first EOS; PAD and BOS are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i not in (PAD, BOS):
                out.append(self.itos[i])
        return out


def pad_batch(seqs: list[list[int]], device: torch.device | str | None = None,
              pad_id: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) long tensor right-padded with pad_id, and (B,) lengths: the built-in model's source."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    width = int(lengths.max()) if seqs else 0
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for row, seq in enumerate(seqs):
        out[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out.to(device), lengths.to(device)


def pad_targets(seqs: list[list[int]], device: torch.device | str | None = None, pad_id: int = PAD,
                eos_id: int = EOS) -> torch.Tensor:
    """(N, T) target rows: each sequence's ids followed by eos_id, then pad_id. (Never BOS.)"""
    padded, _ = pad_batch([list(s) + [eos_id] for s in seqs], device, pad_id)
    return padded
