"""Advantages of a batch's candidates from their rewards (TRL's GRPO recipe: group baselines and scales), the
batch std's sufficient statistics, and DAPO's groups without signal. A NaN reward (a TRL reward's None) is left
out of every statistic.

Letters: B sources, N rows.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .sequence import group_sum, scored_values


def advantages(rewards: Tensor, owner: Tensor, num_sources: int, baseline: str = "mean",
               scale: str = "group", batch_std: float | None = None) -> Tensor:
    """(N,) advantages r - b divided by the reward std (TRL's `scale_rewards`): baseline "mean" (the source's
    mean reward), "loo" (the mean of the source's other rows, RLOO) or "none"; scale "group" (the source's
    std), "batch" (the whole batch's) or "none". Stds are unbiased (torch.std, as TRL); + 1e-4 as TRL. batch_std:
    the whole batch's std where its rows are spread over processes (`scored_moments` of the whole batch).

    A NaN reward (a TRL-style reward's None: no reward for that row) is left out as TRL's nanmean and nanstd
    leave it out: it counts in no source's mean, count or std, nor in the batch std, and its advantage is 0
    (TRL's nan_to_num). Its tokens stay in the loss's normalisers, as TRL keeps them in its completion mask."""
    r, scored = scored_values(rewards)
    count = group_sum(scored.to(r.dtype), owner, num_sources)[owner]  # (N,) scored rows of the row's source
    total = group_sum(r, owner, num_sources)[owner]  # (N,)
    mean = total / count.clamp(min=1)
    if baseline == "mean":
        a = r - mean
    elif baseline == "loo":
        a = torch.where(count > 1, r - (total - r) / (count - 1).clamp(min=1), torch.zeros_like(r))
    elif baseline == "none":
        a = r
    else:
        raise ValueError(f"unknown baseline {baseline!r}; choose from mean, loo, none")
    if scale == "group":
        dev = torch.where(scored, r - mean, torch.zeros_like(r))
        sq = group_sum(dev ** 2, owner, num_sources)[owner]
        std = torch.sqrt(sq / (count - 1).clamp(min=1))
        a = a / (std + 1e-4)
    elif scale == "batch":
        if batch_std is None:  # this batch's, two-pass over the scored rows (no host read)
            n = scored.to(r.dtype).sum()
            dev = torch.where(scored, r - r.sum() / n.clamp(min=1), torch.zeros_like(r))
            batch_std = torch.where(n > 1, torch.sqrt((dev ** 2).sum() / (n - 1).clamp(min=1)), torch.zeros_like(n))
        a = a / (batch_std + 1e-4)
    elif scale != "none":
        raise ValueError(f"unknown advantage scale {scale!r}; choose from group, batch, none")
    return torch.where(scored, a, torch.zeros_like(a))


def scored_moments(rewards: Tensor) -> tuple[int, float, float]:
    """(count, sum, sum of squares) of the rewards that are not NaN: additive over processes, the batch std's
    sufficient statistics (one host read)."""
    r, scored = scored_values(rewards)
    n, s, q = torch.stack([scored.to(r.dtype).sum(), r.sum(), (r * r).sum()]).tolist()
    return int(n), s, q


def zero_std_groups(rewards: Tensor, owner: Tensor, num_sources: int) -> Tensor:
    """(B,) bool: sources whose scored rows' rewards are all equal, or that have fewer than two scored rows (DAPO's
    dynamic sampling drops them: no signal). NaN rewards (no reward) are left out."""
    r, scored = scored_values(rewards)
    inf = torch.full_like(r, float("inf"))
    hi = torch.full((num_sources,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, owner, torch.where(scored, r, -inf), "amax")
    lo = torch.full((num_sources,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, owner, torch.where(scored, r, inf), "amin")
    return hi <= lo  # no scored row: -inf <= inf
