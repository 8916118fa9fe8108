"""An RL step's reward figures for its metrics row, reduced over processes: `reward_mean`, `reward_max` and
`candidates`; `unscored` where some candidate got no reward (NaN: every TRL-style reward returned None), left
out of the mean and max; and with several rewards (`twophase.rewardsum.WeightedSum`) `reward/<name>/mean` and
`reward/<name>/std` of each, over the candidates it scored.
"""
from __future__ import annotations

import math

import torch

from . import distributed
from ..rewardsum import mean_std, statistics


def reward_row(rewards: torch.Tensor, parts: dict | None) -> dict:
    """rewards (N,) float64 of this process's candidates; `parts`: each reward's values (WeightedSum.last)."""
    scored = rewards[~torch.isnan(rewards)]
    parts = parts or {}
    sums = distributed.reduce_sums({"reward": float(scored.sum()), "scored": len(scored), "candidates": len(rewards),
                                    **statistics(parts)})
    top = distributed.reduce_max(float(scored.max()) if len(scored) else -math.inf)
    row = {"reward_mean": sums["reward"] / sums["scored"] if sums["scored"] else None,
           "reward_max": top if math.isfinite(top) else None, "candidates": int(sums["candidates"])}
    if sums["scored"] < sums["candidates"]:
        row["unscored"] = int(sums["candidates"] - sums["scored"])
    return {**row, **mean_std(sums, list(parts))}
