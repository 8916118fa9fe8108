"""Sequence-level objectives as per-sequence coefficients.

Each function is pure: it maps phase one's detached rewards r and scores s = log p(y) to coefficients c such that
the training loss is the surrogate  L = sum_i c_i * log p(y_i | x_owner(i)),  whose gradient phase two computes
in chunks. Losses are averaged over the B sources of the batch (never over a chunk), so the gradient does not
depend on how rows are chunked or how many candidates a source kept.

Letters: B sources, N candidate rows, T row length, U distinct candidates; `owner` (N,) maps a row to its source in
range(B).

Devices: a function's result is on the device of the scores (or, for `reinforce` and `mle`, which take none,
of the owners: the samples'); rewards, owners and tokens built elsewhere (rewards on the CPU, from Python
floats) are moved there.
"""
from __future__ import annotations

import torch
from torch import Tensor

BASELINES = ("none", "mean", "loo", "greedy")


def check_owner(owner: Tensor, num_sources: int) -> None:
    """ValueError naming num_sources where it cannot index every row's source (index_add_ would fail with an
    index error, or on CUDA with a device assert)."""
    if isinstance(num_sources, bool) or not isinstance(num_sources, int) or num_sources < 1:
        raise ValueError(f"num_sources must be an integer >= 1, got {num_sources!r}")
    if owner.numel() and int(owner.max()) >= num_sources:
        raise ValueError(f"num_sources={num_sources} is smaller than the owners (a row of source "
                         f"{int(owner.max())}): it must be the number of sources the rows index")


def group_sum(x: Tensor, owner: Tensor, num_sources: int) -> Tensor:
    """(B,) per-source sums of x (N,), on x's device (owner is moved there)."""
    return torch.zeros(num_sources, dtype=x.dtype, device=x.device).index_add_(0, owner.to(x.device), x)


def group_count(owner: Tensor, num_sources: int, dtype=torch.float64) -> Tensor:
    """(N,) how many rows share each row's source."""
    return group_sum(torch.ones(len(owner), dtype=dtype, device=owner.device), owner, num_sources)[owner]


def group_softmax(x: Tensor, owner: Tensor, num_sources: int) -> Tensor:
    """(N,) softmax of x over the rows of each source, on x's device (owner is moved there)."""
    owner = owner.to(x.device)
    peak = torch.full((num_sources,), float("-inf"), dtype=x.dtype, device=x.device)
    peak = peak.scatter_reduce(0, owner, x, reduce="amax")  # (B,) for a stable exp
    e = torch.exp(x - peak[owner])
    return e / group_sum(e, owner, num_sources)[owner]


def mle(owner: Tensor, num_sources: int) -> Tensor:
    """Maximum likelihood of reference rows: -(1/B) * mean over a source's references of log p."""
    check_owner(owner, num_sources)
    return -1.0 / (num_sources * group_count(owner, num_sources))


def distinct(owner: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Identical candidates of a source: (inverse (N,), counts (U,)); row i is candidate inverse[i], which has
    counts[inverse[i]] copies. Whole rows are compared: identical sequences are padded identically."""
    if tokens.dim() != 2 or tokens.shape[0] != owner.shape[0]:
        raise ValueError(f"tokens must be (N, T) with N = len(owner) = {owner.shape[0]}, got {tuple(tokens.shape)}")
    key = torch.cat([owner.to(tokens.device, tokens.dtype)[:, None], tokens], 1)  # (N, 1 + T)
    _, inverse, counts = torch.unique(key, dim=0, return_inverse=True, return_counts=True)
    return inverse.to(owner.device), counts.to(owner.device)


def reinforce(rewards: Tensor, owner: Tensor, num_sources: int, baseline: str = "none",
              greedy_rewards: Tensor | None = None) -> Tensor:
    """REINFORCE (Williams 1992): c_i = -(r_i - b_i) / (B * K_owner), the mean over each source's K samples.

    baseline: "none" (b = 0), "mean" (mean reward of the source's samples), "loo" (mean of the *other* samples
    of the source, unbiased; b = 0 for a source with a single sample), "greedy" (the reward of the greedy decode
    of the source, given as greedy_rewards (B,): self-critical training, Rennie et al. 2017).

    A NaN reward (a TRL-style reward's None: no reward for that sample) gives the sample coefficient 0 and leaves
    it out of its source's baseline and count K, as TRL leaves it out of the group's mean.

    Unlike `mrt` and `beam`, identical samples each keep their own term: the K samples are independent draws
    from p, and the Monte-Carlo estimate (1/K) sum_k r_k grad log p_k of E_p[r grad log p] is unbiased only if
    a sequence drawn twice counts twice.
    """
    check_owner(owner, num_sources)
    r, scored = scored_values(rewards.to(owner.device))
    count = group_sum(scored.to(torch.float64), owner, num_sources)[owner]  # (N,) scored samples of the source
    total = group_sum(r, owner, num_sources)[owner]  # (N,)
    if baseline == "none":
        b = torch.zeros_like(r)
    elif baseline == "mean":
        b = total / count.clamp(min=1)
    elif baseline == "loo":
        b = torch.where(count > 1, (total - r) / (count - 1).clamp(min=1), torch.zeros_like(r))
    elif baseline == "greedy":
        if greedy_rewards is None:
            raise ValueError("baseline 'greedy' needs greedy_rewards")
        b = scored_values(greedy_rewards.to(owner.device))[0][owner]  # an unscored greedy decode: baseline 0
    else:
        raise ValueError(f"unknown baseline {baseline!r}; choose from {', '.join(BASELINES)}")
    return torch.where(scored, -(r - b) / (num_sources * count.clamp(min=1)), torch.zeros_like(r))


def mrt(rewards: Tensor, scores: Tensor, owner: Tensor, num_sources: int, alpha: float = 1.0, *,
        tokens: Tensor) -> Tensor:
    """Minimum risk training (Shen et al. 2016) with risk -r over each source's set of candidates, Q ∝ p^alpha.

    The risk R = sum_y Q_y (-r_y) has gradient -alpha * sum_y Q_y (r_y - E_Q[r]) grad log p_y, so
    c_y = -alpha * Q_y * (r_y - sum_z Q_z r_z) / B.

    Q is defined over the *set* of candidates (as in Nematus, which drops duplicate samples): rows of `tokens`
    (N, T) that repeat a candidate of the same source are one candidate, else a sequence sampled n times would
    weigh n * p^alpha. Its coefficient is split equally among its copies, so the gradient summed over the rows
    is the deduplicated objective's. Copies should have equal scores and rewards; their means are used.

    A NaN reward (a TRL-style reward's None) leaves the candidate out of its source's set: coefficient 0, Q
    renormalised over the scored ones. The scores must be known (`Samples.from_completions` without the
    generator's log-probabilities leaves them NaN): Q is made of them.
    """
    check_owner(owner, num_sources)
    rewards, owner, tokens = rewards.to(scores.device), owner.to(scores.device), tokens.to(scores.device)
    if bool(torch.isnan(scores).any()):
        raise ValueError("mrt and beam weigh candidates by their search scores, which are unknown (NaN: "
                         "Samples.from_completions without token_logps); give the generator's log-probabilities, "
                         "or use reinforce")
    inverse, copies = distinct(owner, tokens)  # (N,), (U,)
    u = len(copies)
    n = copies.to(torch.float64)
    owner_u = torch.zeros(u, dtype=owner.dtype, device=owner.device).scatter_(0, inverse, owner)  # (U,)
    r, scored = scored_values(group_sum(rewards.to(torch.float64), inverse, u) / n)  # (U,) each
    s = group_sum(scores.to(torch.float64), inverse, u) / n  # (U,)
    logit = torch.where(scored, alpha * s, torch.full_like(s, float("-inf")))  # an unscored candidate: Q = 0
    q = group_softmax(logit, owner_u, num_sources)  # (U,)
    q = torch.where(scored, q, torch.zeros_like(q))  # a source with no scored candidate: nan -> 0
    expected = group_sum(q * r, owner_u, num_sources)[owner_u]  # (U,)
    return (-alpha * q * (r - expected) / (num_sources * n))[inverse]  # (N,)


def beam(rewards: Tensor, scores: Tensor, owner: Tensor, num_sources: int, *, tokens: Tensor) -> Tensor:
    """Expected reward under the model's distribution renormalised over each source's set of candidates
    (Bunel et al. 2018): q = softmax(scores) per source, c_y = -q_y (r_y - sum_z q_z r_z) / B, identical
    candidates counted once (see `mrt`). It is MRT with alpha = 1."""
    return mrt(rewards, scores, owner, num_sources, alpha=1.0, tokens=tokens)


def scored_values(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """(rewards in float64 with NaN -> 0, where they are not NaN): a NaN reward means "no reward"."""
    r = rewards.to(torch.float64)
    scored = ~torch.isnan(r)
    return torch.where(scored, r, torch.zeros_like(r)), scored


def mix(rl: Tensor, mle_coefficients: Tensor, mle_weight: float) -> Tensor:
    """lambda * MLE + (1 - lambda) * RL, over the RL rows followed by the reference rows."""
    return torch.cat([(1.0 - mle_weight) * rl, mle_weight * mle_coefficients.to(rl.device)])
