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
from the log-probabilities it decodes (`twophase.phase2.tokenweights`) and back-propagates sum w * l, chunk by chunk,
exactly. At the sequence level it also depends on the row's sums of l - old and (importance-weighted) k3:
dL/dl_rt = scale_r * (direct_rt + (d surrogate / d log u * len_r + beta * u * sum_t k3_rt) / len_r). Phase two
computes those sums first, without a graph, over the same chunks (`row_statistic_terms`), then the exact weights.

Letters: B sources, N rows, T positions, P scored positions (row, col) of some rows.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .advantage import advantages, scored_moments, zero_std_groups  # noqa: F401  (their home before)
from .mismatch import importance_correction
from .sequence import group_sum
from .policyloss import LEVELS, LOG_MIN, LOSS_TYPES, VESPO_DEFAULTS, PolicyLoss  # noqa: F401  (PolicyLoss: its API)


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
                top_entropy_quantile: float = 1.0, vespo: dict | None = None,
                measure_entropy: bool = False) -> PolicyLoss:
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
    entropy_weight = entropy_rows = None
    if entropy_coef != 0 or measure_entropy:
        entropy_weight = torch.full_like(n, -float(entropy_coef) / max(tokens, 1.0))
        if kept is not None:
            entropy_weight = entropy_weight * kept
        if measure_entropy:
            entropy_rows = torch.ones_like(n) if kept is None else kept.to(n.dtype)
    return PolicyLoss(advantages.to(torch.float64), old_token_logps, ref_token_logps if beta != 0 else None,
                      scale, lengths, float(epsilon), float(high), float(beta), bool(kl_importance_weighted),
                      loss_type, importance_sampling_level, None if delta is None else float(delta),
                      float(sapo_temperature_pos), float(sapo_temperature_neg), correction,
                      None if off_policy_mask_threshold is None else float(off_policy_mask_threshold), base,
                      entropy_weight=entropy_weight, entropy_coef=float(entropy_coef),
                      top_entropy_quantile=float(top_entropy_quantile),
                      vespo={**VESPO_DEFAULTS, **(vespo or {})}, vespo_log_is=vespo_log_is,
                      entropy_rows=entropy_rows)
