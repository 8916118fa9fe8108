"""`PolicyLoss`: a token-level objective's loss and d loss / d log p at each position, TRL 1.16's operations
(`twophase.objectives.policy` builds it and writes out the formulas). Per position it reads its row's advantage, old and
reference log-probabilities and normaliser; at the sequence level, for VESPO, the off-policy and the high-entropy
masks also its row's sums from phase two's statistics pass (`row_statistic_terms`, `with_row_statistics`).

Letters: N rows, T positions, P scored positions (row, col) of some rows, V vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo", "sequence")
VESPO_DEFAULTS = {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}  # TRL's vespo_* defaults
LOG_MIN = math.log(1e-8)  # VESPO's lower clamp of log-weights (TRL's)
LEVELS = ("token", "sequence")


@dataclass
class PolicyLoss:
    """A token-level objective over N rows: what `rescore_backward` accepts in place of coefficients."""

    advantages: Tensor  # (N,) float64
    old: Tensor  # (N, T) phase one's per-token log-probabilities
    ref: Tensor | None  # (N, T) the reference's, or None when beta = 0
    scale: Tensor  # (N,) float64: the row's normaliser (see the module docstring)
    lengths: Tensor  # (N,) positions each row scores
    epsilon_low: float
    epsilon_high: float  # cispo: the ratio's cap itself (TRL's epsilon_high there)
    beta: float
    kl_importance_weighted: bool
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    delta: float | None = None  # the clipped types' cap on the unclipped ratio (two-sided clipping)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    correction: Tensor | None = None  # (N, T) the engine-mismatch factor of the policy term (`mismatch`)
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2's sequence mask (TRL's name)
    off_policy_base: Tensor | None = None  # (N,) sum_t (sampling - old): the mask's KL is this - sum_t (l - old)
    row_stats: Tensor | None = None  # (N, 5) the statistics pass's sums (sequence level; `row_statistic_terms`)
    vespo: dict = field(default_factory=lambda: dict(VESPO_DEFAULTS))  # k and lambda of each advantage sign
    vespo_log_is: Tensor | None = None  # (N,) sum_t clamp(log correction): an engine's ratio, inside VESPO's phi
    entropy_weight: Tensor | None = None  # (N,) -entropy_coef / tokens per position of the row (0: masked rows)
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0  # < 1: the policy term (and bonus) on the positions of highest entropy only
    entropy_mask: Tensor | None = None  # (N, T) 1 / 0 from the statistics pass's entropies (TRL's entropy_mask)
    entropy_rows: Tensor | None = None  # (N,) 1 where phase two measures the row's entropies (adaptive control)

    def __len__(self) -> int:
        return len(self.advantages)

    def __getitem__(self, rows) -> "PolicyLoss":
        """The objective of some rows (a slice or an index tensor): every normaliser stays the whole batch's."""
        return replace(self, **{f.name: getattr(self, f.name)[rows] for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})

    def live(self) -> Tensor:
        """(N,) bool: rows whose loss can have a gradient (a zero advantage without KL has none)."""
        if self.top_entropy_quantile < 1:  # every row's entropies set the threshold: all of them are decoded
            return self.scale != 0
        live = (self.scale != 0) & ((self.advantages != 0) | (self.beta != 0))
        if self.entropy_rows is not None:  # the measured mean entropy is over every kept row's tokens
            live = live | (self.entropy_rows != 0)
        return live if self.entropy_weight is None else live | (self.entropy_weight != 0)

    # ------------------------------------------------------------------ the row statistics
    def needs_row_statistics(self) -> bool:
        """Whether a position's derivative needs its whole row's sums (the sequence-level ratio): phase two then
        runs a statistics pass without a graph first (`row_statistic_terms`, `with_row_statistics`). So does
        the off-policy mask, whose KL is the row's mean of the current log-probabilities."""
        return (self.importance_sampling_level == "sequence" or self.off_policy_mask_threshold is not None
                or self.needs_entropies() or self.loss_type == "vespo")

    def needs_entropies(self) -> bool:
        """Whether the statistics pass also computes every position's entropy (top_entropy_quantile < 1)."""
        return self.top_entropy_quantile < 1

    def with_entropies(self, entropies: Tensor, scored: Tensor) -> "PolicyLoss":
        """This objective (its row statistics set) with TRL's high-entropy mask from every scored position's
        entropy (N, T) (scored (N, T) bool: the loss's positions): the positions at or above the
        (1 - top_entropy_quantile) quantile. The rows' summed factors and the bonus's normaliser follow it."""
        high = entropies >= torch.quantile(entropies[scored].float(), 1 - self.top_entropy_quantile)
        mask = (high & scored).to(torch.float64)  # (N, T)
        factor = mask
        if self.correction is not None:  # (N, T') to the entropies' width
            width = mask.shape[1]
            correction = torch.nn.functional.pad(self.correction, (0, max(0, width - self.correction.shape[1])))
            factor = mask * correction[:, :width].to(torch.float64)
        stats = self.row_stats.clone()
        stats[:, 3] = factor.sum(1)
        weight = self.entropy_weight
        if weight is not None:  # the bonus's mean over the masked positions: -coef / their count
            weight = torch.where(weight != 0, -self.entropy_coef / mask.sum().clamp(min=1), weight)
        return replace(self, entropy_mask=mask, row_stats=stats, entropy_weight=weight)

    def entropy_weights(self, row: Tensor, col: Tensor) -> Tensor | None:
        """(P,) the entropy bonus's weight of positions (row, col) (0 off the high-entropy mask), or None."""
        if self.entropy_weight is None:
            return None
        weight = self.entropy_weight.index_select(0, row)
        return weight if self.entropy_mask is None else weight * self.entropy_mask[row, col].to(weight.dtype)

    def entropy_counts(self, row: Tensor, col: Tensor) -> Tensor | None:
        """(P,) 1 where position (row, col) is in the measured entropy's token set (TRL's effective mask: the
        kept rows, times the high-entropy mask), else 0; None where phase two measures no entropy."""
        if self.entropy_rows is None:
            return None
        count = self.entropy_rows.index_select(0, row)
        return count if self.entropy_mask is None else count * self.entropy_mask[row, col].to(count.dtype)

    def row_statistic_terms(self, logp: Tensor, row: Tensor, col: Tensor) -> Tensor:
        """(P, 5) each position's share of its row's statistics at current log-probabilities logp (P,): the
        log-ratio l - old, the KL's k3 (where the KL is importance-weighted, else 0), 1 (the count), the
        policy term's correction factor (1 without) and the log-ratio clamped to [-20, 20] (VESPO's)."""
        with torch.no_grad():
            logp, old, ref, _, _ = self._at(row, col, logp)
            kl = _k3(ref, logp)[0] if self.beta != 0 and self.kl_importance_weighted else torch.zeros_like(logp)
            one = torch.ones_like(logp)
            factor = self._correction(row, col, logp)
            return torch.stack([logp - old, kl, one, one if factor is None else factor,
                                torch.clamp(logp - old, -20.0, 20.0)], dim=1)

    def with_row_statistics(self, stats: Tensor) -> "PolicyLoss":
        """This objective with its rows' statistics (N, 5): the sums of `row_statistic_terms` over each row."""
        return replace(self, row_stats=stats)

    def _log_ratio(self, logp: Tensor, old: Tensor, row: Tensor) -> Tensor:
        """(P,) the log importance weight of each position: its own l - old, or its row's mean l - old (from the
        statistics pass: a constant here, its derivative being `_row_share`'s)."""
        if self.importance_sampling_level == "token":
            return logp - old
        if self.row_stats is None:
            raise ValueError("importance_sampling_level 'sequence' needs the rows' statistics: pass the objective "
                             "to rescore_backward, which computes them")
        stats = self.row_stats.to(logp.dtype).index_select(0, row)  # (P, 4)
        return stats[:, 0] / stats[:, 2].clamp(min=1)

    def _correction(self, row: Tensor, col: Tensor, like: Tensor) -> Tensor | None:
        """(P,) the engine-mismatch factor of positions (row, col), or None without a correction."""
        return None if self.correction is None else self.correction[row, col].to(like.dtype)

    def _kept(self, row: Tensor, like: Tensor) -> Tensor | None:
        """(P,) 1 where the off-policy mask keeps the position's row, else 0 (None without the mask): TRL's
        advantage >= 0 or the row's mean KL sum_t (sampling - l) / n_r <= threshold, l a constant."""
        if self.off_policy_mask_threshold is None:
            return None
        if self.row_stats is None:
            raise ValueError("off_policy_mask_threshold needs the rows' statistics: pass the objective to "
                             "rescore_backward, which computes them")
        stats = self.row_stats.to(like.dtype).index_select(0, row)  # (P, 4)
        base = self.off_policy_base.to(like.dtype).index_select(0, row)
        kl = (base - stats[:, 0]) / stats[:, 2].clamp(min=1)
        adv = self.advantages.index_select(0, row)
        return ((adv >= 0) | (kl <= self.off_policy_mask_threshold)).to(like.dtype)

    def _factor(self, row: Tensor, col: Tensor, like: Tensor) -> Tensor | None:
        """(P,) the constant factor of the policy term at positions (row, col): the off-policy mask times the
        engine-mismatch correction (TRL's order), or None without either."""
        factor = None
        for part in (self._kept(row, like), self._correction(row, col, like),
                     None if self.entropy_mask is None else self.entropy_mask[row, col].to(like.dtype)):
            if part is not None:
                factor = part if factor is None else factor * part
        return factor

    def _row_share(self, u: Tensor, d_ratio: Tensor, row: Tensor) -> Tensor:
        """(P,) at the sequence level, what each position of a row adds to every position's derivative through
        the row's ratio: (d surrogate / d log u * sum_t f_rt + beta * u * sum_t k3_rt) / n_r (the surrogate is
        the same at every position of the row, times its correction factor f; d log u / d l_rt = 1 / n_r)."""
        stats = self.row_stats.to(u.dtype).index_select(0, row)  # (P, 4)
        share = d_ratio * stats[:, 3]
        kept = self._kept(row, u)
        if kept is not None:
            share = share * kept
        if self.beta != 0 and self.kl_importance_weighted:
            share = share + self.beta * stats[:, 1] * u
        return share / stats[:, 2].clamp(min=1)

    def _at(self, row: Tensor, col: Tensor, logp: Tensor):
        dtype = torch.promote_types(logp.dtype, self.old.dtype)
        old = self.old[row, col].to(dtype)
        ref = self.ref[row, col].to(dtype) if self.beta != 0 else None
        return logp.to(dtype), old, ref, self.advantages[row].to(dtype), self.scale[row].to(dtype)

    def _temperature(self, adv: Tensor) -> Tensor:
        return torch.full_like(adv, self.sapo_temperature_pos).masked_fill_(adv <= 0, self.sapo_temperature_neg)

    def _gamma_weight(self, row: Tensor, like: Tensor) -> Tensor:
        """(P,) VESPO's phi(w) of each position's row, w its sequence weight exp(sum_t clamp(l - old, +-20)
        (+ an engine's log-ratios)), phi = exp(lambda + k log w - lambda w): a constant (TRL's get_gamma_weights)."""
        if self.row_stats is None:
            raise ValueError("loss_type 'vespo' needs the rows' statistics: pass the objective to rescore_backward, "
                             "which computes them")
        seq = self.row_stats.to(like.dtype)[:, 4]  # (N,)
        if self.vespo_log_is is not None:
            seq = seq + self.vespo_log_is.to(like.dtype)
        log_w = torch.clamp(seq, LOG_MIN, 20.0).index_select(0, row)  # (P,)
        positive = self.advantages.index_select(0, row) >= 0
        k = torch.where(positive, torch.full_like(log_w, self.vespo["k_pos"]),
                        torch.full_like(log_w, self.vespo["k_neg"]))
        lam = torch.where(positive, torch.full_like(log_w, self.vespo["lambda_pos"]),
                          torch.full_like(log_w, self.vespo["lambda_neg"])).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    def _surrogate(self, u: Tensor, adv: Tensor, logp: Tensor, row: Tensor):
        """(value, d value / d logp through logp itself, d value / d log u, clipped low, clipped high) of the
        policy term at ratios u (P,), no graph."""
        zero = torch.zeros_like(u)
        low = high = torch.zeros_like(u, dtype=torch.bool)
        if self.loss_type == "vespo":
            phi = self._gamma_weight(row, u)
            return -phi * adv * logp, -phi * adv, zero, low, high
        if self.loss_type == "cispo":
            capped = torch.clamp(u, max=self.epsilon_high)  # a constant: TRL detaches it
            return -capped * adv * logp, -capped * adv, zero, low, (u > self.epsilon_high) & (adv > 0)
        if self.loss_type == "sapo":
            tau = self._temperature(adv)
            sig = torch.sigmoid(tau * (u - 1))
            return -sig * 4 / tau * adv, zero, -4 * adv * sig * (1 - sig) * u, low, high
        capped = u if self.delta is None else torch.clamp(u, max=self.delta)
        clipped = torch.clamp(u, 1 - self.epsilon_low, 1 + self.epsilon_high)
        a, b = capped * adv, clipped * adv
        # the min's branch, and whether its ratio still moves with u there (not clamped)
        unclamped = torch.ones_like(low) if self.delta is None else u <= self.delta
        moves = torch.where(a <= b, unclamped, (u >= 1 - self.epsilon_low) & (u <= 1 + self.epsilon_high))
        low, high = (capped < 1 - self.epsilon_low) & (adv < 0), (capped > 1 + self.epsilon_high) & (adv > 0)
        return -torch.min(a, b), zero, torch.where(moves, -adv * u, zero), low, high

    # ------------------------------------------------------------------ the loss and its derivative
    def terms(self, logp: Tensor, row: Tensor, col: Tensor) -> Tensor:
        """(P,) each position's share of L at log-probabilities logp (P,) of rows row (P,), positions col (P,):
        TRL's operations, differentiable (autograd's path, and the check of `derivative`). At the sequence level
        the row's ratio is the statistics pass's constant, and each position's derivative through it (which
        every position of its row contributes to, wherever they are scored) is added as `_row_share`."""
        logp, old, ref, adv, scale = self._at(row, col, logp)
        sequence = self.importance_sampling_level == "sequence"
        coef_1 = torch.exp(self._log_ratio(logp.detach() if sequence else logp, old, row))
        if self.loss_type == "cispo":
            loss = -torch.clamp(coef_1, max=self.epsilon_high).detach() * adv * logp
        elif self.loss_type == "vespo":
            loss = -self._gamma_weight(row, logp.detach()) * adv * logp
        elif self.loss_type == "sapo":
            tau = self._temperature(adv)
            loss = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
        else:
            coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
            capped = coef_1 if self.delta is None else torch.clamp(coef_1, max=self.delta)
            loss = -torch.min(capped * adv, coef_2 * adv)
        factor = self._factor(row, col, loss)
        if factor is not None:
            loss = loss * factor
        if self.beta != 0:
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            loss = loss + self.beta * (kl * coef_1 if self.kl_importance_weighted else kl)
        if sequence:
            with torch.no_grad():
                u = coef_1.detach()
                share = self._row_share(u, self._surrogate(u, adv, logp.detach(), row)[2], row)
            loss = loss + share * (logp - logp.detach())  # value unchanged, derivative + share
        return loss * scale

    def derivative(self, logp: Tensor, row: Tensor, col: Tensor) -> tuple[Tensor, Tensor, dict]:
        """(terms (P,), d terms / d logp (P,), sums) in closed form, no graph: the weights of a by-hand path. At
        the sequence level a position's derivative adds its row's share, from the row's statistics. sums (0-dim
        tensors on logp's device, read by no one here): clipped positions ("clip_low", "clip_high": TRL's
        definitions; cispo's capped positions count as "clip_high") and the summed k3 as it enters the loss
        (times the ratio when importance-weighted: "kl")."""
        with torch.no_grad():
            logp, old, ref, adv, scale = self._at(row, col, logp)
            u = torch.exp(self._log_ratio(logp, old, row))  # (P,) the importance ratio
            value, direct, d_ratio, low, high = self._surrogate(u, adv, logp, row)
            factor = self._factor(row, col, u)
            if factor is not None:  # a constant factor of the policy term
                value, direct = value * factor, direct * factor
                if self.importance_sampling_level == "token":
                    d_ratio = d_ratio * factor  # (the sequence level's share sums the row's factors)
            kl_sum = torch.zeros_like(u).sum()
            if self.beta != 0:
                k3, dk3 = _k3(ref, logp)
                weight = u if self.kl_importance_weighted else torch.ones_like(u)
                kl_sum = (k3 * weight).sum()
                value = value + self.beta * k3 * weight
                direct = direct + self.beta * dk3 * weight
                if self.kl_importance_weighted and self.importance_sampling_level == "token":
                    d_ratio = d_ratio + self.beta * k3 * u  # d (k3 u) / d log u
            if self.importance_sampling_level == "token":
                d = direct + d_ratio  # d log u / d logp = 1
            else:
                d = direct + self._row_share(u, d_ratio, row)
            sums = {"clip_low": low.sum(), "clip_high": high.sum(), "kl": kl_sum}
            return value * scale, d * scale, sums


def _k3(ref: Tensor, logp: Tensor) -> tuple[Tensor, Tensor]:
    """(k3, d k3 / d logp): the KL estimator exp(ref - l) - (ref - l) - 1 and its derivative 1 - exp(ref - l)."""
    e = torch.exp(ref - logp)
    return e - (ref - logp) - 1, 1 - e
