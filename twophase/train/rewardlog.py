"""An RL step's reward figures for its metrics row, reduced over processes: `reward_mean`, `reward_max` and
`candidates`; `unscored` where some candidate got no reward (NaN: every TRL-style reward returned None), left
out of the mean and max; and with several rewards (`twophase.rewardsum.WeightedSum`) `reward/<name>/mean` and
`reward/<name>/std` of each, over the candidates it scored. A step whose reward scored no candidate at all
trains nothing (no candidate has an advantage); `RewardLog` says so on stderr, once a run, rather than let a
reward that never applies (a misspelt column) train silently on zero gradients.
"""
from __future__ import annotations

import math
import sys

import torch

from . import distributed
from ..rewardsum import mean_std, statistics


def reward_row(rewards: torch.Tensor, parts: dict | None) -> dict:
    """rewards (N,) float64 of this process's candidates; `parts`: each reward's values (WeightedSum.last)."""
    scored = ~torch.isnan(rewards)
    values = torch.where(scored, rewards, torch.full_like(rewards, -math.inf))  # (N,)
    count, total, top = torch.stack([scored.to(values.dtype).sum(), torch.where(scored, rewards, 0.0).sum(),
                                     values.max() if len(values) else values.new_tensor(-math.inf)]).tolist()
    parts = parts or {}
    sums = distributed.reduce_sums({"reward": total, "scored": int(count), "candidates": len(rewards),
                                    **statistics(parts)})
    top = distributed.reduce_max(top)
    row = {"reward_mean": sums["reward"] / sums["scored"] if sums["scored"] else None,
           "reward_max": top if math.isfinite(top) else None, "candidates": int(sums["candidates"])}
    if sums["scored"] < sums["candidates"]:
        row["unscored"] = int(sums["candidates"] - sums["scored"])
    return {**row, **mean_std(sums, list(parts))}


class RewardLog:
    """`reward_row` for a run's RL steps, and its warning, given once, at the first step that scored nothing."""

    def __init__(self, reward):
        self.name = getattr(reward, "name", None) or getattr(reward, "__name__", "the reward")
        self.warned = False

    def row(self, rewards: torch.Tensor, parts: dict | None, step: int) -> dict:
        """`reward_row` of step `step` (1-based); a warning on stderr (main process) the first time none of
        the step's candidates, over every process, got a reward."""
        row = reward_row(rewards, parts)
        if row["reward_mean"] is None and row["candidates"] and not self.warned:
            self.warned = True
            if distributed.rank() == 0:
                print(f"warning: reward '{self.name}' scored none of the {row['candidates']} candidates of RL step "
                      f"{step} (None for every one): the step trains nothing, and a reward that never scores trains "
                      "nothing at all; does it read a column the data has (spelt as in the file)? (said once)",
                      file=sys.stderr, flush=True)
        return row
