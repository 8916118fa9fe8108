"""Unbiased gradient estimators for a sample without replacement (stochastic beam search, `twophase.sbs`), as
per-candidate coefficients: the training loss is L = sum_i c_i log p(y_i | x_owner(i)), as in `objectives`, and
its gradient estimates -grad E_p[r] / B (the mean over the B sources of the expected reward's gradient).

Priority sampling (Kool et al., ICML 2019; Duffield et al. 2007). The K candidates S of a source are those whose
perturbed scores exceed the threshold kappa; conditioned on the others' Gumbels, y is in S with probability
q_y = P(G_y > kappa) = 1 - exp(-exp(phi_y - kappa)), phi_y = log p(y). So sum_{y in S} (p_y / q_y) f(y) is an
unbiased estimate of sum_y p_y f(y), and with f = r grad log p

    c_y = -(p_y / q_y) r_y / B.                                                                   (unbiased)

The self-normalised variant, w_y = (p_y/q_y) / sum_S p/q and c_y = -w_y (r_y - sum_S w r) / B (the weights'
estimate of E[r] as a baseline), has lower variance but is biased (consistent only as K grows).

Unordered set estimator (Kool et al., ICLR 2020). With P(S) the probability of drawing the set S (in any order)
and R(S, s) = P^{D\\s}(S\\{s}) / P(S) (the leave-one-out ratio; D\\s: the space without s, renormalised),
sum_{s in S} p_s R(S, s) f(s) is unbiased, and its built-in baseline estimates E[r] from the other K-1 samples:

    b_s = p_s r_s + sum_{s' in S, s' != s} p_s' R2(s, s') r_s',   R2(s, s') = P^{D\\{s,s'}}(S\\{s,s'}) / P^{D\\s}(S\\{s}),
    c_s = -p_s R(S, s) (r_s - b_s) / B                           (unbiased for K >= 2; b = 0 for K = 1).

P(S) and its leave-outs need no enumeration of the K! orders. With the mass outside S, m = 1 - sum_S p, and a_j =
p_j / m (which removing elements of S from D and renormalising leaves unchanged), the exponential-race form gives
P^{D\\A}(S\\A) = int_0^1 prod_{j in S\\A} (1 - u^{a_j}) du = int exp(y - e^y) prod_{j in S\\A} (1 - exp(-a_j e^y)) dy
after u = exp(-e^y). That integrand is smooth and decays doubly exponentially at +inf and exponentially at -inf,
where the trapezoid rule converges geometrically in the step: a fixed grid of M = 441 points (step 0.1) gives
every ratio to ~1e-12 relative (tested against enumeration). All K^2 ratios come from one grid, in log space:
cost O(K^2 M) per source (measured in docs/sbs.md), memory bounded by processing sources in blocks.

Letters: B sources, N candidate rows, K candidates of a source (padded to the largest), M grid points.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .objectives import group_sum
from .sbs import log1mexp

STEP, LOW = 0.1, -36.0  # the trapezoid grid in y (see `_grid`)
BLOCK_ELEMENTS = 2**22  # float64 elements of one block's (n, K, K, M) log-integrands: 32 MiB


def log_inclusion(scores: Tensor, threshold: Tensor) -> Tensor:
    """(N,) log q_y = log P(G_y > kappa) = log(1 - exp(-exp(phi_y - kappa))); 0 where kappa = -inf (a source
    with at most K sequences: every one is drawn)."""
    phi, kappa = scores.to(torch.float64), threshold.to(torch.float64)
    x = torch.exp(phi - kappa)  # > 0
    return torch.where(torch.isneginf(kappa), torch.zeros_like(phi), log1mexp(-x))


def priority(rewards: Tensor, scores: Tensor, threshold: Tensor, owner: Tensor, num_sources: int,
             normalise: bool = False) -> Tensor:
    """Priority-sampling coefficients c_y = -(p_y / q_y) r_y / B (unbiased); normalise=True: the
    self-normalised weights with their estimate of E[r] as baseline (biased, lower variance)."""
    r = rewards.to(torch.float64)
    log_w = scores.to(torch.float64) - log_inclusion(scores, threshold)  # (N,) log p/q
    if not normalise:
        return -torch.exp(log_w) * r / num_sources
    peak = torch.full((num_sources,), float("-inf"), dtype=torch.float64, device=r.device)
    peak = peak.scatter_reduce(0, owner, log_w, reduce="amax")  # (B,) for a stable exp
    e = torch.exp(log_w - peak[owner])
    w = e / group_sum(e, owner, num_sources)[owner]  # (N,) sums to 1 per source
    return -w * (r - group_sum(w * r, owner, num_sources)[owner]) / num_sources


def unordered_set(rewards: Tensor, scores: Tensor, owner: Tensor, num_sources: int) -> Tensor:
    """Coefficients of the unordered set estimator with its built-in baseline (see the module docstring). The
    candidates of a source must be distinct (a sample without replacement), in any order."""
    r, log_p = rewards.to(torch.float64), scores.to(torch.float64)
    index, mask = _by_source(owner, num_sources)  # (B, K) rows of each source, where mask
    lp = torch.where(mask, log_p[index], torch.full(mask.shape, float("-inf"), dtype=torch.float64,
                                                    device=log_p.device))  # (B, K)
    rs = torch.where(mask, r[index], torch.zeros_like(lp))  # (B, K)
    K = lp.shape[1]
    per_block = max(1, BLOCK_ELEMENTS // max(1, K * K * len(_grid(K, lp.device))))
    coef = torch.cat([_unordered_block(lp[b:b + per_block], rs[b:b + per_block])
                      for b in range(0, num_sources, per_block)]) if num_sources else lp  # (B, K)
    out = torch.zeros_like(r)
    out[index[mask]] = coef[mask]
    return out / num_sources


def _unordered_block(lp: Tensor, r: Tensor) -> Tensor:
    """(n, K) -p_s R(S, s) (r_s - b_s) for n sources' padded log-probabilities lp (n, K) (-inf: no row)."""
    log_r1, log_r2 = leave_out_ratios(lp)  # (n, K), (n, K, K)
    p = torch.exp(lp)  # (n, K), 0 at padding
    k = torch.isfinite(lp).sum(dim=1, keepdim=True)  # (n, 1) candidates of each source
    base = (p[:, None, :] * torch.exp(log_r2) * r[:, None, :]).sum(dim=2)  # (n, K): b_s
    base = torch.where(k > 1, base, torch.zeros_like(base))  # one sample has no other to estimate E[r] from
    return -p * torch.exp(log_r1) * (r - base)


def leave_out_ratios(lp: Tensor) -> tuple[Tensor, Tensor]:
    """log R(S, s) (n, K) and log R2(s, s') (n, K, K) (diagonal 0) of sets with log-probabilities lp (n, K),
    -inf marking padding (whose entries are meaningless); by the trapezoid rule on `_grid`, in log space."""
    mask = torch.isfinite(lp)  # (n, K)
    lse = torch.logsumexp(lp, dim=1, keepdim=True).clamp(max=0.0)  # (n, 1) log sum_S p, <= 0 despite rounding
    log_m = log1mexp(lse)  # (n, 1) log of the mass outside S; -inf when S holds it all (every ratio is then 1)
    log_a = torch.where(mask, lp - log_m, torch.zeros_like(lp))  # (n, K) log a_j (+inf when m = 0)
    y = _grid(lp.shape[1], lp.device)  # (M,)
    x = log_a[..., None] + y  # (n, K, M) log(a_j e^y)
    # log(1 - exp(-a e^y)); below e^-20 its series, so that tiny a_j never underflow to log 0
    l = torch.where(x < -20, x - torch.exp(x) / 2, log1mexp(-torch.exp(x.clamp(min=-20))))
    l = torch.where(mask[..., None], l, torch.zeros_like(l))  # padding: a factor 1
    total = (y - torch.exp(y)) + l.sum(dim=1)  # (n, M) log integrand of P(S)
    without = total[:, None, :] - l  # (n, K, M) of P^{D\s}(S\s)
    log_i0 = torch.logsumexp(total, dim=1)  # (n,), the step h cancels in every ratio
    log_i1 = torch.logsumexp(without, dim=2)  # (n, K)
    log_i2 = torch.logsumexp(without[:, :, None, :] - l[:, None, :, :], dim=3)  # (n, K, K) of P^{D\{s,s'}}
    eye = torch.eye(lp.shape[1], dtype=torch.bool, device=lp.device)
    log_r2 = torch.where(eye, torch.zeros_like(log_i2), log_i2 - log_i1[..., None])
    return log_i1 - log_i0[:, None], log_r2


def _grid(K: int, device) -> Tensor:
    """(M,) the y grid, step 0.1: from -36 (below it lies < e^-35 of any integrand's mass: it falls at least like
    e^y) to log(40 (K+1)), beyond which exp(-e^y) leaves < e^-35 of it even where all K factors still grow like
    a_j e^y (M = 441 for K = 64)."""
    return torch.arange(LOW, math.log(40 * (K + 1)) + STEP, STEP, dtype=torch.float64, device=device)


def _by_source(owner: Tensor, num_sources: int) -> tuple[Tensor, Tensor]:
    """index (B, K) long and mask (B, K): the rows of each source in their order, padded to the largest K."""
    counts = torch.bincount(owner, minlength=num_sources)  # (B,)
    K = int(counts.max()) if len(owner) else 0
    order = torch.sort(owner, stable=True).indices  # (N,) rows grouped by source
    start = torch.cumsum(counts, 0) - counts  # (B,) first position of each source in order
    rank = torch.arange(len(owner), device=owner.device) - start[owner[order]]  # (N,) position within its source
    index = torch.zeros(num_sources, K, dtype=torch.long, device=owner.device)
    mask = torch.zeros(num_sources, K, dtype=torch.bool, device=owner.device)
    index[owner[order], rank] = order
    mask[owner[order], rank] = True
    return index, mask
