"""Checks of a search's per-step values, read once when the search ends.

On an accelerator every read of a tensor's value makes the host wait until the device has caught up; a check
made at every decoder step (are the log-probabilities finite? has every row something to draw?) would cost one
such wait per step. `Checks` keeps each step's verdict on the device and reads them all in one go at the end.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..protocol import ModelError, model_name
from .truncation import NO_MASS


class Checks:
    """Checks of a search's per-step values that never read them during the search: on an accelerator a read
    makes the host wait for the device at every step. Each check keeps its value (a 0-d tensor) on the device;
    `raise_first` reads them all at once when the search ends and raises, in the order the checks were made,
    the error the first failed one would have raised then. The search goes on meanwhile with the failed rows
    (their tokens stay in range: `draw_unchecked` clamps them), and returns nothing when one failed."""

    def __init__(self):
        self.values: list[Tensor] = []
        self.kinds: list[str] = []
        self.model = None

    def finite(self, model, logp: Tensor) -> None:
        """ModelError, when raised, where log-probabilities hold NaN or +inf: -inf (a banned token) is the only
        non-finite value a model may return. Rows with such scores used to be dropped as impossible, and their
        sources vanished from training and validation without a word. One reduction: the maximum is NaN wherever
        any entry is."""
        if logp.numel():
            self.model = model
            self._add(logp.detach().amax(), "finite")

    def positive(self, has_mass: Tensor) -> None:
        """ValueError, when raised, where a row drawn from (`truncation.draw_unchecked`'s has_mass (N,)) had no
        positive probability mass or held NaN."""
        self._add(has_mass.all(), "positive")

    def _add(self, value: Tensor, kind: str) -> None:
        self.values.append(value.to(torch.float64).reshape(()))
        self.kinds.append(kind)

    def raise_first(self) -> None:
        if not self.values:
            return
        values = torch.stack(self.values).tolist()  # the search's one read of its checks
        self.values, kinds, self.kinds = [], self.kinds, []
        for value, kind in zip(values, kinds):
            if kind == "finite" and (math.isnan(value) or value == math.inf):
                raise ModelError(f"{model_name(self.model)} returned {'NaN' if math.isnan(value) else '+inf'} "
                                 "log-probabilities (only -inf, a banned token, may be non-finite)")
            if kind == "positive" and value != 1.0:
                raise ValueError(NO_MASS)
