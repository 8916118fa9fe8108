"""A task's (input, output) world pairs with their model input computed once: `PairSet`.

Letters: P pairs, R x C the grid, 32 the channels of a pair (the input world's 16, then the output's).

Building the arrays from `World`s every time a task is drawn would cost several times a batch's own unpacking
(docs/results/); a `PairSet` is a tuple of pairs (what rewards and metrics read,
unchanged) that also keeps its arrays, built the first time they are asked for and shared by every subset taken of
it. Every channel is 0 or 1, so they are kept bit-packed, (P, 4, R, C) uint8: 1.5 KB per 6-pair task on 8x8
worlds (15 MB for 10,000 tasks; unpacked, 12 KB), and a batch unpacks in one call.
"""
from __future__ import annotations

import numpy as np

from .world import World

CHANNELS = 32  # per pair: the input world's 16, then the output's


def pair_array(pair: tuple[World, World]) -> np.ndarray:
    """(32, R, C) uint8: the input world's 16 channels, then the output's."""
    return np.concatenate([pair[0].to_array(), pair[1].to_array()])


class PairSet(tuple):
    """A tuple of (input World, output World) pairs that caches its model input (see the module docstring)."""

    _packed: np.ndarray | None = None

    @property
    def packed(self) -> np.ndarray:
        """(P, 4, R, C) uint8: the 32 channels of each pair, 8 to a byte; computed on first use."""
        if self._packed is None:
            self._packed = np.packbits(np.stack([pair_array(pair) for pair in self]), axis=1)  # (P, 4, R, C)
        return self._packed

    @property
    def grids(self) -> np.ndarray:
        """(P, 32, R, C) uint8, 0 or 1."""
        return np.unpackbits(self.packed, axis=1, count=CHANNELS)

    def subset(self, indices) -> "PairSet":
        """The pairs at `indices`, in that order; their arrays are sliced from this set's, not rebuilt."""
        indices = list(indices)
        out = PairSet(self[i] for i in indices)
        out._packed = self.packed[indices]  # (len(indices), 4, R, C)
        return out


def batch_grids(specs: list) -> np.ndarray:
    """(B, P, 32, R, C) uint8 of B pair sets (plain tuples of pairs are converted on the fly), P the most pairs
    of any. A set of fewer pairs (decode's input lines may differ) repeats its first pair: the model takes the
    maximum over pairs, which a repeated pair leaves as it was."""
    sets = [s.packed if isinstance(s, PairSet) else PairSet(s).packed for s in specs]  # (P_b, 4, R, C) each
    P = max(len(s) for s in sets)
    packed = np.stack([np.concatenate([s] + [s[:1]] * (P - len(s))) for s in sets])  # (B, P, 4, R, C)
    return np.unpackbits(packed, axis=2, count=CHANNELS)
