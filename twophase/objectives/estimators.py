"""Unbiased gradient estimators for a sample without replacement (stochastic beam search, `twophase.phase1.sbs`), as
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

    b_s = p_s r_s + sum_{s' in S, s' != s} p_s' R2(s, s') r_s',
    R2(s, s') = P^{D\\{s,s'}}(S\\{s,s'}) / P^{D\\s}(S\\{s}),
    c_s = -p_s R(S, s) (r_s - b_s) / B                           (unbiased for K >= 2; b = 0 for K = 1).

P(S) and its leave-outs need no enumeration of the K! orders. With the mass outside S, m = 1 - sum_S p, and a_j =
p_j / m (which removing elements of S from D and renormalising leaves unchanged), the exponential-race form gives
P^{D\\A}(S\\A) = int_0^1 prod_{j in S\\A} (1 - u^{a_j}) du = int exp(y - e^y) prod_{j in S\\A} (1 - exp(-a_j e^y)) dy
after u = exp(-e^y). That integrand is smooth and decays doubly exponentially at +inf and exponentially at -inf,
where the trapezoid rule converges geometrically in the step: a fixed grid of step 0.2, narrowed like 1/sqrt(K)
past K = 7 as the integrand's peak narrows (`_grid`), gives every ratio to ~1e-13 relative (tested against exact
enumeration; step 0.3 gives 1e-10, 0.4 1e-7; at K = 64 against a 4x finer grid), in log space. The estimator needs
R(S, s) and, per s, one leave-one-out sum over s' at each grid point, never the K^2 ratios R2: cost O(K M) per
source, M ~ sqrt(K) (measured in docs/sbs.md), memory bounded by processing sources in blocks.

Letters: B sources, N candidate rows, K candidates of a source (padded to the largest), M grid points.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..phase1.sbs import log1mexp
from .sequence import group_sum, scored_values

STEP, LOW = 0.2, -36.0  # the trapezoid grid in y (see `_grid`)
BLOCK_ELEMENTS = 2**20  # float64 elements of one of a block's (n, K, M) log-integrands: 8 MiB


def log_inclusion(scores: Tensor, threshold: Tensor) -> Tensor:
    """(N,) log q_y = log P(G_y > kappa) = log(1 - exp(-exp(phi_y - kappa))); 0 where kappa = -inf (a source
    with at most K sequences: every one is drawn)."""
    phi, kappa = scores.to(torch.float64), threshold.to(torch.float64)
    x = torch.exp(phi - kappa)  # > 0
    return torch.where(torch.isneginf(kappa), torch.zeros_like(phi), log1mexp(-x))


def priority(rewards: Tensor, scores: Tensor, threshold: Tensor, owner: Tensor, num_sources: int,
             normalise: bool = False) -> Tensor:
    """Priority-sampling coefficients c_y = -(p_y / q_y) r_y / B (unbiased); normalise=True: the
    self-normalised weights with their estimate of E[r] as baseline (biased, lower variance). A NaN reward (no
    reward) gives coefficient 0 and leaves the candidate out of the normalised weights, as if not drawn."""
    r, scored = scored_values(rewards)
    log_w = scores.to(torch.float64) - log_inclusion(scores, threshold)  # (N,) log p/q
    if not normalise:
        return torch.where(scored, -torch.exp(log_w) * r / num_sources, torch.zeros_like(r))
    log_w = torch.where(scored, log_w, torch.full_like(log_w, float("-inf")))  # an unscored candidate: weight 0
    peak = torch.full((num_sources,), float("-inf"), dtype=torch.float64, device=r.device)
    peak = peak.scatter_reduce(0, owner, log_w, reduce="amax")  # (B,) for a stable exp
    e = torch.where(scored, torch.exp(log_w - peak[owner]), torch.zeros_like(r))
    w = e / group_sum(e, owner, num_sources)[owner].clamp(min=torch.finfo(e.dtype).tiny)  # (N,) sums to 1 per source
    return -w * (r - group_sum(w * r, owner, num_sources)[owner]) / num_sources


def unordered_set(rewards: Tensor, scores: Tensor, owner: Tensor, num_sources: int) -> Tensor:
    """Coefficients of the unordered set estimator with its built-in baseline (see the module docstring). The
    candidates of a source must be distinct (a sample without replacement), in any order. A NaN reward (no
    reward) leaves the candidate out: coefficient 0, and the others' as for the set without it."""
    r, scored = scored_values(rewards)
    log_p = scores.to(torch.float64)
    index, mask = _by_source(owner, num_sources)  # (B, K) rows of each source, where mask
    mask = mask & scored[index]  # an unscored candidate is padding: out of S
    lp = torch.where(mask, log_p[index], torch.full(mask.shape, float("-inf"), dtype=torch.float64,
                                                    device=log_p.device))  # (B, K)
    rs = torch.where(mask, r[index], torch.zeros_like(lp))  # (B, K)
    K = lp.shape[1]
    per_block = max(1, BLOCK_ELEMENTS // max(1, K * len(_grid(K, lp.device))))
    coef = torch.cat([_unordered_block(lp[b:b + per_block], rs[b:b + per_block])
                      for b in range(0, num_sources, per_block)]) if num_sources else lp  # (B, K)
    out = torch.zeros_like(r)
    out[index[mask]] = coef[mask]
    return out / num_sources


def _unordered_block(lp: Tensor, r: Tensor) -> Tensor:
    """(n, K) -p_s R(S, s) (r_s - b_s) for n sources' padded log-probabilities lp (n, K) (-inf: no row), in
    O(K M): b_s needs only sum_{s' != s} p_s' r_s' R2(s, s'), one leave-one-out sum per grid point
    (`_log_sum_others`), never the (K, K) matrix. The baseline is affine in the rewards
    (p_s + sum_{s' != s} p_s' R2(s, s') = 1), so the rewards are shifted to be >= 0 for the log-space sums."""
    mask = torch.isfinite(lp)  # (n, K)
    l, total = _log_factors(lp)  # (n, K, M), (n, M)
    without = total[:, None, :] - l  # (n, K, M) log integrand of P^{D\s}(S\s)
    log_i1 = torch.logsumexp(without, dim=2)  # (n, K); the step h cancels in every ratio
    log_r1 = log_i1 - torch.logsumexp(total, dim=1)[:, None]  # (n, K) log R(S, s)
    shift = torch.where(mask, r, torch.full_like(r, math.inf)).amin(dim=1, keepdim=True)  # (n, 1)
    up = torch.where(mask, r - shift, torch.zeros_like(r))  # (n, K) >= 0
    # (n, K) log p r', a zero term as the finite -1e30 (exp(-1e30 - anything finite) = 0, and no nan)
    log_w = torch.where(mask & (up > 0), lp + up.log(), torch.full_like(lp, -1e30))
    others = _log_sum_others(log_w[..., None] - l)  # (n, K, M) log sum_{s' != s} p_s' r'_s' / f_s'(y)
    log_rest = torch.logsumexp(without + others, dim=2) - log_i1  # (n, K) log sum_{s' != s} p_s' R2 r'_s'
    p = torch.exp(lp)  # (n, K), 0 at padding
    base = p * up + torch.exp(log_rest) + shift  # (n, K) b_s
    k = mask.sum(dim=1, keepdim=True)  # (n, 1) candidates of each source
    base = torch.where(k > 1, base, torch.zeros_like(base))  # one sample has no other to estimate E[r] from
    return torch.where(mask, -p * torch.exp(log_r1) * (r - base), torch.zeros_like(p))


def _log_sum_others(z: Tensor) -> Tensor:
    """(n, K, M): log sum_{j != s} exp(z_j) over dim 1 (z finite) without cancellation: scaled by the largest z,
    whose term (1) stays in every sum but its own, so removing one term loses at most a factor 2 of relative
    precision; the largest's own sum is taken directly, scaled by the second largest."""
    n, K, M = z.shape
    if K == 1:
        return torch.full_like(z, float("-inf"))
    top = z.topk(2, dim=1)  # (n, 2, M)
    first, second = top.values[:, :1], top.values[:, 1:]  # (n, 1, M) each
    e = torch.exp(z - first)  # (n, K, M) <= 1
    others = torch.log(e.sum(dim=1, keepdim=True) - e) + first  # >= 1 inside the log for every s but the top
    is_top = torch.zeros_like(z, dtype=torch.bool).scatter_(1, top.indices[:, :1], True)  # (n, K, M)
    rest = torch.exp(z - second).masked_fill(is_top, 0.0).sum(dim=1, keepdim=True)  # (n, 1, M) >= 1
    return torch.where(is_top, torch.log(rest) + second, others)


def leave_out_ratios(lp: Tensor) -> tuple[Tensor, Tensor]:
    """log R(S, s) (n, K) and log R2(s, s') (n, K, K) (diagonal 0) of sets with log-probabilities lp (n, K),
    -inf marking padding (whose entries are meaningless): the whole (K, K) matrix, in O(K^2 M), which the
    estimator never forms (`_unordered_block`); for tests and inspection."""
    l, total = _log_factors(lp)  # (n, K, M), (n, M)
    without = total[:, None, :] - l  # (n, K, M) of P^{D\s}(S\s)
    log_i0 = torch.logsumexp(total, dim=1)  # (n,)
    log_i1 = torch.logsumexp(without, dim=2)  # (n, K)
    log_i2 = torch.logsumexp(without[:, :, None, :] - l[:, None, :, :], dim=3)  # (n, K, K) of P^{D\{s,s'}}
    eye = torch.eye(lp.shape[1], dtype=torch.bool, device=lp.device)
    log_r2 = torch.where(eye, torch.zeros_like(log_i2), log_i2 - log_i1[..., None])
    return log_i1 - log_i0[:, None], log_r2


def _log_factors(lp: Tensor) -> tuple[Tensor, Tensor]:
    """The log integrands on `_grid`: l (n, K, M) = log(1 - exp(-a_j e^y)) (0 at padding) and total (n, M) =
    y - e^y + sum_j l_j, that of P(S)."""
    mask = torch.isfinite(lp)  # (n, K)
    lse = torch.logsumexp(lp, dim=1, keepdim=True).clamp(max=0.0)  # (n, 1) log sum_S p, <= 0 despite rounding
    log_m = log1mexp(lse)  # (n, 1) log of the mass outside S; -inf when S holds it all (every ratio is then 1)
    log_a = torch.where(mask, lp - log_m, torch.zeros_like(lp))  # (n, K) log a_j (+inf when m = 0)
    y = _grid(lp.shape[1], lp.device)  # (M,)
    x = log_a[..., None] + y  # (n, K, M) log(a_j e^y)
    # log(1 - exp(-u)), u = a_j e^y: expm1 keeps tiny u exact down to u = e^-700, below which l = log u (before u
    # would underflow to 0); for large u, 1 - exp(-u) rounds to 1 and l to 0, an absolute error < 1e-16
    l = torch.where(x < -700, x, torch.log(-torch.expm1(-torch.exp(x))))
    l = torch.where(mask[..., None], l, torch.zeros_like(l))  # padding: a factor 1
    return l, (y - torch.exp(y)) + l.sum(dim=1)


def _grid(K: int, device) -> Tensor:
    """(M,) the y grid: from -36 (below it lies < e^-35 of any integrand's mass: it falls at least like e^y) to
    log(40 (K+1)), beyond which exp(-e^y) leaves < e^-35 of it even where all K factors still grow like a_j e^y.
    The step is STEP up to K = 7, then STEP sqrt(8 / (K+1)): where every a_j is small the integrand peaks like
    e^{(K+1) y - e^y}, at e^y = K+1 with a width 1/sqrt(K+1) in y (M = 217 for K = 8, 630 for K = 64)."""
    step = STEP * min(1.0, math.sqrt(8 / (K + 1)))
    return torch.arange(LOW, math.log(40 * (K + 1)) + step, step, dtype=torch.float64, device=device)


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
