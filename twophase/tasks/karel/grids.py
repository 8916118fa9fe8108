"""A task's (input, output) world pairs with their model input computed once: `PairSet`.

Letters: P pairs, R x C the grid, 32 the channels of a pair (the input world's 16, then the output's).

Building the arrays from `World`s costs ~21 ms per batch of 128 tasks (5 pairs each), every time a task is
drawn; a `PairSet` is a tuple of pairs (what rewards and metrics read, unchanged) that also holds its
(P, 32, R, C) uint8 array, built the first time it is asked for and shared by every subset taken of it.
"""
from __future__ import annotations

import numpy as np

from .world import World


def pair_array(pair: tuple[World, World]) -> np.ndarray:
    """(32, R, C) uint8: the input world's 16 channels, then the output's."""
    return np.concatenate([pair[0].to_array(), pair[1].to_array()])


class PairSet(tuple):
    """A tuple of (input World, output World) pairs that caches its model input (see the module docstring)."""

    _grids: np.ndarray | None = None

    @property
    def grids(self) -> np.ndarray:
        """(P, 32, R, C) uint8, computed on first use."""
        if self._grids is None:
            self._grids = np.stack([pair_array(pair) for pair in self])  # (P, 32, R, C)
        return self._grids

    def subset(self, indices) -> "PairSet":
        """The pairs at `indices`, in that order; their arrays are sliced from this set's, not rebuilt."""
        indices = list(indices)
        out = PairSet(self[i] for i in indices)
        out._grids = self.grids[indices]  # (len(indices), 32, R, C)
        return out


def batch_grids(specs: list) -> np.ndarray:
    """(B, P, 32, R, C) uint8 of B pair sets of P pairs each (plain tuples of pairs are converted on the fly)."""
    return np.stack([s.grids if isinstance(s, PairSet) else PairSet(s).grids for s in specs])
