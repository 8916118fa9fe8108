"""Token-level policy-gradient objectives (PPO/GRPO-style), TRL 1.16's `GRPOTrainer` definitions and names.

Each row's loss is a function of its own current per-token log-probabilities l_rt = log pi(y_rt | x, y_r<t):

    rho = exp(l - old)                                     importance ratio to phase one's policy (1 at first)
    surrogate = -min(rho * A_r, clip(rho, 1 - eps, 1 + eps_high) * A_r)
    k3 = exp(ref - l) - (ref - l) - 1                      KL to the reference, per token (times rho when
                                                           kl_importance_weighted: TRL's use_bias_correction_kl)
    L = sum_r scale_r * sum_{t < len_r} (surrogate_rt + beta * k3_rt)

with every normaliser a constant of the whole batch (loss_type):

    grpo      scale_r = 1 / (len_r * N)          each row's token mean, then the mean over rows
    dr_grpo   scale_r = 1 / (N * max_len)        Dr. GRPO: a fixed length
    dapo      scale_r = 1 / num_items            the token mean over the global batch (TRL's num_items_in_batch
                                                 divided by the number of processes)
    bnpo      scale_r = 1 / num_items            the same here (TRL: each process's own tokens)
    sequence  scale_r = 1 / (B * K_owner(r))     per-sequence sums averaged per source, then over sources: at
                                                 rho = 1 and beta = 0 today's `objectives.reinforce` coefficients

So dL/dl_rt = scale_r * (d surrogate + beta * d k3) depends on l_rt alone: phase two computes it from the
log-probabilities it decodes (`twophase.tokenweights`) and back-propagates sum w * l, chunk by chunk, exactly.

Letters: B sources, N rows, T positions, P scored positions (row, col) of some rows.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from .objectives import group_sum, scored_values

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "sequence")


@dataclass
class PolicyLoss:
    """A token-level objective over N rows: what `rescore_backward` accepts in place of coefficients."""

    advantages: Tensor  # (N,) float64
    old: Tensor  # (N, T) phase one's per-token log-probabilities
    ref: Tensor | None  # (N, T) the reference's, or None when beta = 0
    scale: Tensor  # (N,) float64: the row's normaliser (see the module docstring)
    lengths: Tensor  # (N,) positions each row scores
    epsilon_low: float
    epsilon_high: float
    beta: float
    kl_importance_weighted: bool

    def __len__(self) -> int:
        return len(self.advantages)

    def __getitem__(self, rows) -> "PolicyLoss":
        """The objective of some rows (a slice or an index tensor): every normaliser stays the whole batch's."""
        return replace(self, **{f.name: getattr(self, f.name)[rows] for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})

    def live(self) -> Tensor:
        """(N,) bool: rows whose loss can have a gradient (a zero advantage without KL has none)."""
        return (self.scale != 0) & ((self.advantages != 0) | (self.beta != 0))

    def _at(self, row: Tensor, col: Tensor, logp: Tensor):
        dtype = torch.promote_types(logp.dtype, self.old.dtype)
        old = self.old[row, col].to(dtype)
        ref = self.ref[row, col].to(dtype) if self.beta != 0 else None
        return logp.to(dtype), old, ref, self.advantages[row].to(dtype), self.scale[row].to(dtype)

    def terms(self, logp: Tensor, row: Tensor, col: Tensor) -> Tensor:
        """(P,) each position's share of L at log-probabilities logp (P,) of rows row (P,), positions col (P,):
        TRL's operations, differentiable (autograd's path, and the check of `derivative`)."""
        logp, old, ref, adv, scale = self._at(row, col, logp)
        coef_1 = torch.exp(logp - old)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        loss = -torch.min(coef_1 * adv, coef_2 * adv)
        if self.beta != 0:
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            loss = loss + self.beta * (kl * coef_1 if self.kl_importance_weighted else kl)
        return loss * scale

    def derivative(self, logp: Tensor, row: Tensor, col: Tensor) -> tuple[Tensor, Tensor, dict]:
        """(terms (P,), d terms / d logp (P,), sums) in closed form, no graph: the weights of a by-hand path.
        sums: clipped positions ("clip_low", "clip_high") and the summed k3 as it enters the loss (times rho when
        importance-weighted: "kl"), TRL's metrics' definitions."""
        with torch.no_grad():
            logp, old, ref, adv, scale = self._at(row, col, logp)
            rho = torch.exp(logp - old)
            low, high = (rho < 1 - self.epsilon_low) & (adv < 0), (rho > 1 + self.epsilon_high) & (adv > 0)
            clipped = low | high  # the clipped branch is the min there: a constant, no gradient
            surrogate = -torch.min(rho * adv, torch.clamp(rho, 1 - self.epsilon_low, 1 + self.epsilon_high) * adv)
            d = torch.where(clipped, torch.zeros_like(rho), -adv * rho)
            sums = {"clip_low": int(low.sum()), "clip_high": int(high.sum()), "kl": 0.0}
            if self.beta != 0:
                e = torch.exp(ref - logp)
                kl, dkl = e - (ref - logp) - 1, 1 - e
                if self.kl_importance_weighted:  # d(k3 * rho) = dk3 * rho + k3 * rho
                    kl, dkl = kl * rho, (dkl + kl) * rho
                sums["kl"] = float(kl.sum())
                surrogate, d = surrogate + self.beta * kl, d + self.beta * dkl
            return surrogate * scale, d * scale, sums


def policy_loss(advantages: Tensor, old_token_logps: Tensor, *, lengths: Tensor, loss_type: str = "dapo",
                epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                ref_token_logps: Tensor | None = None, kl_importance_weighted: bool = True,
                max_len: int | None = None, num_sources: int | None = None, owner: Tensor | None = None,
                num_items: float | None = None, num_rows: int | None = None,
                scored: Tensor | None = None) -> PolicyLoss:
    """The token-level objective of N rows (see the module docstring) for `rescore_backward`.

    advantages (N,); old_token_logps (N, T) (`Samples.token_scores`); lengths (N,) the positions each row
    scores (`Samples.lengths`); ref_token_logps (N, T) needed when beta != 0; epsilon_high None = epsilon;
    max_len (dr_grpo) defaults to T; num_items (dapo, bnpo) to the rows' scored tokens and num_rows (grpo,
    dr_grpo) to N: several processes pass the global batch's, so that their summed gradients are one process's
    (TRL's bnpo normalises by each process's own tokens); `sequence` needs owner (N,) and num_sources B.
    scored (N,) bool: the rows that have a reward (default all). A row without one has advantage 0 (`advantages`)
    and stays in the token-level types' normalisers and KL, as TRL keeps it in its completion mask; `sequence`
    averages over a source's scored rows only, as `objectives.reinforce` does."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose from {', '.join(LOSS_TYPES)}")
    if beta != 0 and ref_token_logps is None:
        raise ValueError("beta != 0 needs ref_token_logps")
    if old_token_logps is None:
        raise ValueError("policy_loss needs old_token_logps (N, T), the generator's per-token log-probabilities: "
                         "Samples.token_scores, which sample, beam_search and stochastic_beam_search fill and "
                         "Samples.from_completions fills only when given token_logps")
    N = len(advantages)
    if old_token_logps.shape[0] != N or len(lengths) != N:
        raise ValueError(f"expected {N} rows of old_token_logps and lengths, got {tuple(old_token_logps.shape)}, "
                         f"{tuple(lengths.shape)}")
    n = lengths.to(torch.float64)
    rows = N if num_rows is None else num_rows
    tokens = float(n.sum()) if num_items is None else float(num_items)
    if loss_type == "grpo":
        scale = 1.0 / (n.clamp(min=1) * rows)
    elif loss_type == "dr_grpo":
        scale = torch.full_like(n, 1.0 / (rows * (max_len or old_token_logps.shape[1])))
    elif loss_type in ("dapo", "bnpo"):
        scale = torch.full_like(n, 1.0 / max(tokens, 1.0))
    else:
        if owner is None or num_sources is None:
            raise ValueError("loss_type 'sequence' needs owner and num_sources")
        counted = torch.ones(N, dtype=torch.float64, device=owner.device) if scored is None else scored.double()
        scale = 1.0 / (num_sources * group_sum(counted, owner, num_sources)[owner].clamp(min=1))
    high = epsilon if epsilon_high is None else epsilon_high
    return PolicyLoss(advantages.to(torch.float64), old_token_logps, ref_token_logps if beta != 0 else None,
                      scale, lengths, float(epsilon), float(high), float(beta), bool(kl_importance_weighted))


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
