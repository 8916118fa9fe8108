"""Adaptive entropy control (Skywork-OR1; TRL 1.16's `use_adaptive_entropy`): the entropy bonus's coefficient
follows the policy's entropy from one optimizer step to the next.

TRL's order, kept exactly: step k's loss applies the coefficient and the gate left by step k - 1 (the bonus is on
only where step k - 1's mean entropy was at or below the target; before any measurement it is off), step k
measures the mean entropy of its own tokens at the parameters it differentiates at, and then moves the
coefficient for step k + 1: up by delta where that entropy is at or below the target, down by delta otherwise,
clamped to [minimum, maximum].
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class AdaptiveEntropy:
    """The controller's state (coef, last_entropy) and TRL's settings (entropy_coef_min / _max / _delta,
    entropy_target). coef starts at TRL's entropy_coef; last_entropy at infinity (no measurement yet)."""

    coef: float
    minimum: float = 0.0
    maximum: float = 1.0
    delta: float = 0.005
    target: float = 0.2
    last_entropy: float = math.inf

    def applied(self) -> float:
        """The coefficient this step's loss uses: the current one where the last measured entropy was at or
        below the target, else 0."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> float:
        """Take this step's mean entropy (nats per token, over the loss's token set) and return the next
        coefficient."""
        entropy = float(entropy)
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.maximum)
        else:
            self.coef = max(self.coef - self.delta, self.minimum)
        self.last_entropy = entropy
        return self.coef

    def state_dict(self) -> dict:
        """Plain floats (a checkpoint loads with weights_only): what the next step depends on."""
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
