"""Token-level policy-gradient objectives (PPO/GRPO-style), TRL 1.16's `GRPOTrainer` definitions and names.

Each row's loss is a function of its own current per-token log-probabilities l_rt = log pi(y_rt | x, y_r<t):

    u = exp(l - old)                                       importance ratio to phase one's policy (1 at first);
                                                           importance_sampling_level "sequence" (GSPO): the
                                                           row's exp(mean_t (l - old)), one per row
    surrogate = -min(u * A_r, clip(u, 1 - eps, 1 + eps_high) * A_r)   grpo, dr_grpo, dapo, bnpo, luspo,
                                                           sequence; with delta the first u is min(u, delta)
              = -sg(min(u, eps_high)) * A_r * l            cispo (sg: a constant, no gradient)
              = -sigmoid(tau (u - 1)) * 4 / tau * A_r      sapo, tau = sapo_temperature_pos where A_r > 0, else
                                                           sapo_temperature_neg
    k3 = exp(ref - l) - (ref - l) - 1                      KL to the reference, per token (times u when
                                                           kl_importance_weighted: TRL's use_bias_correction_kl)
    L = sum_r scale_r * sum_{t < len_r} (surrogate_rt + beta * k3_rt)

with every normaliser a constant of the whole batch (loss_type):

    grpo, sapo  scale_r = 1 / (len_r * N)        each row's token mean, then the mean over rows
    dr_grpo     scale_r = 1 / (N * max_len)      Dr. GRPO: a fixed length
    dapo, cispo scale_r = 1 / num_items          the token mean over the global batch (TRL's num_items_in_batch
                                                 divided by the number of processes)
    bnpo        scale_r = 1 / num_items          the same here (TRL: each process's own tokens)
    luspo       scale_r = 1 / N                  each row's token sum, then the mean over rows
    sequence    scale_r = 1 / (B * K_owner(r))   per-sequence sums averaged per source, then over sources: at
                                                 u = 1 and beta = 0 today's `objectives.reinforce` coefficients

At the token level dL/dl_rt = scale_r * (d surrogate + beta * d k3) depends on l_rt alone: phase two computes it
from the log-probabilities it decodes (`twophase.tokenweights`) and back-propagates sum w * l, chunk by chunk,
exactly. At the sequence level it also depends on the row's sums of l - old and (importance-weighted) k3:
dL/dl_rt = scale_r * (direct_rt + (d surrogate / d log u * len_r + beta * u * sum_t k3_rt) / len_r). Phase two
computes those sums first, without a graph, over the same chunks (`row_statistic_terms`), then the exact weights.

Letters: B sources, N rows, T positions, P scored positions (row, col) of some rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor

from .advantage import advantages, scored_moments, zero_std_groups  # noqa: F401  (their home before)
from .mismatch import importance_correction
from .objectives import group_sum

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
    correction: Tensor | None = None  # (N, T) the engine-mismatch factor of the policy term (`twophase.mismatch`)
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2's sequence mask (TRL's name)
    off_policy_base: Tensor | None = None  # (N,) sum_t (sampling - old): the mask's KL is this - sum_t (l - old)
    row_stats: Tensor | None = None  # (N, 5) the statistics pass's sums (sequence level; `row_statistic_terms`)
    vespo: dict = field(default_factory=lambda: dict(VESPO_DEFAULTS))  # k and lambda of each advantage sign
    vespo_log_is: Tensor | None = None  # (N,) sum_t clamp(log correction): an engine's ratio, inside VESPO's phi
    entropy_weight: Tensor | None = None  # (N,) -entropy_coef / tokens per position of the row (0: masked rows)
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0  # < 1: the policy term (and bonus) on the positions of highest entropy only
    entropy_mask: Tensor | None = None  # (N, T) 1 / 0 from the statistics pass's entropies (TRL's entropy_mask)

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
        k = torch.where(positive, torch.full_like(log_w, self.vespo["k_pos"]), torch.full_like(log_w, self.vespo["k_neg"]))
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


def truncated_rows(tokens: Tensor, lengths: Tensor, eos_id: int) -> Tensor:
    """(N,) bool: rows that end without eos_id (cut at the length limit, or by a stop string): TRL's truncated
    completions, which `mask_truncated_completions` leaves out of the loss."""
    last = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)  # (N,)
    return (lengths == 0) | (last != eos_id)


def policy_loss(advantages: Tensor, old_token_logps: Tensor, *, lengths: Tensor, loss_type: str = "dapo",
                epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                ref_token_logps: Tensor | None = None, kl_importance_weighted: bool = True,
                max_len: int | None = None, num_sources: int | None = None, owner: Tensor | None = None,
                num_items: float | None = None, num_rows: int | None = None,
                scored: Tensor | None = None, importance_sampling_level: str = "token", delta: float | None = None,
                sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                truncated: Tensor | None = None, sampling_token_logps: Tensor | None = None,
                correction_mode: str = "sequence_mask", correction_clip_min: float | None = None,
                correction_clip_max: float | None = 3.0,
                off_policy_mask_threshold: float | None = None, entropy_coef: float = 0.0,
                top_entropy_quantile: float = 1.0, vespo: dict | None = None) -> PolicyLoss:
    """The token-level objective of N rows (see the module docstring) for `rescore_backward`.

    advantages (N,); old_token_logps (N, T) (`Samples.token_scores`); lengths (N,) the positions each row
    scores (`Samples.lengths`); ref_token_logps (N, T) needed when beta != 0; epsilon_high None = epsilon;
    max_len (dr_grpo) defaults to T; num_items (dapo, bnpo, cispo) to the rows' scored tokens and num_rows
    (grpo, dr_grpo, sapo, luspo) to N: several processes pass the global batch's, so that their summed gradients
    are one process's (TRL's bnpo normalises by each process's own tokens); `sequence` needs owner (N,) and
    num_sources B. scored (N,) bool: the rows that have a reward (default all). A row without one has advantage
    0 (`advantages`) and stays in the token-level types' normalisers and KL, as TRL keeps it in its completion
    mask; `sequence` averages over a source's scored rows only, as `objectives.reinforce` does.

    TRL's options: importance_sampling_level "sequence" (GSPO: each row's ratio exp(mean of l - old)); delta
    (the clipped types' cap on the unclipped ratio); sapo_temperature_pos / _neg; truncated (N,) bool, the rows
    TRL's mask_truncated_completions leaves out (`truncated_rows`): no loss, no KL, not in num_items' default,
    still counted in num_rows, as TRL's zeroed completion mask.

    sampling_token_logps (N, T): the generating engine's log-probabilities where another engine made the rows
    (`Samples.sampling_token_scores`; old_token_logps are then the trainer's own, `mismatch.own_token_logps`):
    the policy term is corrected by `mismatch.importance_correction(old, sampling, correction_mode,
    correction_clip_min, correction_clip_max)`, as TRL's vllm_importance_sampling_correction.

    off_policy_mask_threshold (DeepSeek-V3.2's off-policy sequence mask, TRL's name): a row with a negative
    advantage whose mean KL sum_t (sampling - l) / len_r (sampling: sampling_token_logps, else old) exceeds it
    loses its policy term (not its KL); l is the current policy's, a constant, from the statistics pass.

    entropy_coef (TRL's entropy bonus): L - entropy_coef * (sum of the scored positions' entropies of the next-token
    distribution) / num_items, whatever the loss type (masked rows left out). Its gradient goes through the
    model's by-hand output layer, a block of logits at a time (`outputlayer.target_log_probs_and_grads`).

    top_entropy_quantile < 1 (TRL's): only the positions whose entropy is at or above the (1 - q) quantile of
    this call's scored positions keep their policy term (and the entropy bonus, averaged over them); the
    entropies come from the statistics pass (the model's `step`, no graph).

    loss_type "vespo" (TRL's): -phi(w_r) * A_r * l, phi a constant of the row's sequence weight (`_gamma_weight`),
    the token mean over the batch as dapo; vespo: {"k_pos", "lambda_pos", "k_neg", "lambda_neg"} (TRL's
    vespo_* defaults 2, 3, 3, 2); an engine's correction (token modes only) enters phi's weight, as in TRL."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose from {', '.join(LOSS_TYPES)}")
    if not 0 < top_entropy_quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {top_entropy_quantile}")
    if importance_sampling_level not in LEVELS:
        raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}; choose from token, "
                         "sequence")
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
    kept = None if truncated is None else ~truncated.to(torch.bool)  # (N,)
    n = lengths.to(torch.float64)
    rows = N if num_rows is None else num_rows
    tokens = float((n if kept is None else n * kept).sum()) if num_items is None else float(num_items)
    if loss_type in ("grpo", "sapo"):
        scale = 1.0 / (n.clamp(min=1) * rows)
    elif loss_type == "dr_grpo":
        scale = torch.full_like(n, 1.0 / (rows * (max_len or old_token_logps.shape[1])))
    elif loss_type in ("dapo", "bnpo", "cispo", "vespo"):
        scale = torch.full_like(n, 1.0 / max(tokens, 1.0))
    elif loss_type == "luspo":
        scale = torch.full_like(n, 1.0 / rows)
    else:
        if owner is None or num_sources is None:
            raise ValueError("loss_type 'sequence' needs owner and num_sources")
        counted = torch.ones(N, dtype=torch.float64, device=owner.device) if scored is None else scored.double()
        if kept is not None:
            counted = counted * kept
        scale = 1.0 / (num_sources * group_sum(counted, owner, num_sources)[owner].clamp(min=1))
    if kept is not None:
        scale = scale * kept
    high = epsilon if epsilon_high is None else epsilon_high
    correction = None if sampling_token_logps is None else importance_correction(
        old_token_logps, sampling_token_logps, lengths, correction_mode, correction_clip_min, correction_clip_max)
    vespo_log_is = None
    if loss_type == "vespo" and correction is not None:  # the engine's ratio goes inside phi, not onto the loss
        if not correction_mode.startswith("token"):
            raise ValueError(f"loss_type 'vespo' takes correction_mode token_truncate or token_mask, not "
                             f"{correction_mode!r}")
        vespo_log_is = torch.clamp(torch.log(correction), LOG_MIN, 20.0).sum(1)  # (N,)
        correction = None
    base = None
    if off_policy_mask_threshold is not None:
        if sampling_token_logps is None:
            base = torch.zeros(N, dtype=torch.float64, device=old_token_logps.device)
        else:
            scored_at = torch.arange(old_token_logps.shape[1], device=old_token_logps.device)[None, :] \
                < lengths.to(old_token_logps.device)[:, None]  # (N, T)
            gap = torch.nan_to_num(sampling_token_logps.to(torch.float64) - old_token_logps.to(torch.float64))
            base = torch.where(scored_at, gap, torch.zeros_like(gap)).sum(1)  # (N,)
    entropy_weight = None
    if entropy_coef != 0:
        entropy_weight = torch.full_like(n, -float(entropy_coef) / max(tokens, 1.0))
        if kept is not None:
            entropy_weight = entropy_weight * kept
    return PolicyLoss(advantages.to(torch.float64), old_token_logps, ref_token_logps if beta != 0 else None,
                      scale, lengths, float(epsilon), float(high), float(beta), bool(kl_importance_weighted),
                      loss_type, importance_sampling_level, None if delta is None else float(delta),
                      float(sapo_temperature_pos), float(sapo_temperature_neg), correction,
                      None if off_policy_mask_threshold is None else float(off_policy_mask_threshold), base,
                      entropy_weight=entropy_weight, entropy_coef=float(entropy_coef),
                      top_entropy_quantile=float(top_entropy_quantile),
                      vespo={**VESPO_DEFAULTS, **(vespo or {})}, vespo_log_is=vespo_log_is)
