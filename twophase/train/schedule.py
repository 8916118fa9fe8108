"""Validation-driven MLE: the learning rate decays when validation stops improving, and the warm start ends once
it has decayed below a floor, so RL starts where more MLE no longer helps.

`Plateau` is plain data (floats and ints) so it rides in the checkpoint and a resumed run decays and stops at the
same validations as an uninterrupted one.
"""
from __future__ import annotations

import math


class Plateau:
    """--lr-decay / --patience / --min-lr over the --best-metric score of each MLE validation.

    After `patience` validations in a row that do not beat the best so far, lr *= decay (and the count restarts);
    a decay that would take lr below `min_lr` ends the MLE phase instead. decay 1 never decays nor stops."""

    def __init__(self, lr: float, decay: float, patience: int, min_lr: float, higher_is_better: bool):
        self.lr, self.decay, self.patience, self.min_lr = lr, decay, patience, min_lr
        self.higher_is_better = higher_is_better
        self.best: float | None = None
        self.bad = 0  # validations since the last improvement (or the last decay)
        self.decays = 0
        self.stopped = False

    def _improves(self, score: float) -> bool:
        if self.best is None:
            return True
        return score > self.best if self.higher_is_better else score < self.best

    def update(self, score: float | None) -> str | None:
        """One MLE validation's score; returns "decay" or "stop" when the schedule acts, else None. A NaN score
        (a diverged model) counts as a validation without improvement."""
        if self.stopped or self.decay >= 1:
            return None
        if score is not None and not math.isnan(score) and self._improves(score):
            self.best, self.bad = float(score), 0
            return None
        self.bad += 1
        if self.bad < self.patience:
            return None
        self.bad = 0
        if self.lr * self.decay < self.min_lr * (1 - 1e-9):  # a float's rounding must not cost the last decay
            self.stopped = True
            return "stop"
        self.lr *= self.decay
        self.decays += 1
        return "decay"

    def state_dict(self) -> dict:
        return {"lr": self.lr, "best": self.best, "bad": self.bad, "decays": self.decays, "stopped": self.stopped}

    def load_state_dict(self, state: dict) -> None:
        self.lr, self.best, self.bad = float(state["lr"]), state["best"], int(state["bad"])
        self.decays, self.stopped = int(state["decays"]), bool(state["stopped"])
