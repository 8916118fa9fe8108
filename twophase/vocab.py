"""Token vocabularies.

Every vocabulary starts with the same four specials, so model code can use the ids as constants:
PAD (0) pads batches and never receives probability, BOS (1) starts decoding and never receives probability,
EOS (2) ends a sequence, UNK (3) stands for anything unseen in training.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

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
