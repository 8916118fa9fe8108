"""The token-level policy objective's RL step (--objective policy, GRPO and its kin): phase one once per
generation, then --updates-per-generation optimizer steps on it.

A generation is --grad-accum batches of sources (one by default), each batch's candidates with phase one's
per-token log-probabilities (the old policy, `Samples.token_scores`), their rewards and advantages, and, with
--kl-beta, the frozen reference's per-token log-probabilities (`reference`: no graph, chunked, once). Phase one
of every batch comes first: the normalisers (rows, tokens, the reward std of --advantage-scale batch) are the
whole generation's, so N batches of B give the gradient of one batch of N*B exactly. Each RL step is one update:
a phase two over each batch's candidates in turn, gradients accumulated, with the token-level objective of
`twophase.policy` (importance ratio to phase one, clipped; k3 KL), so the first update's ratio is exactly 1. A
candidate without a reward (NaN: a TRL reward's None) is left out of every reward statistic (`policy.advantages`,
the batch std, the logged figures) and kept, with advantage 0, in the loss's normalisers, as TRL's GRPO. The
generation lives in the checkpoint, so a run resumed between two of its updates continues bit-identically.
Several processes: each holds its share of every batch; the normalisers are global, so the summed gradient is
one process's; the checkpoint holds every process's part of the generation (a resume on another number of
processes draws a new one). Under --fsdp a copied reference is sharded too, and each process holds one gathered
copy at a time: the model's for phase one, then the reference's for its scoring pass, then the model's for the
update's phase two (one gather and one reduction per update, plus the reference's and phase one's once per
generation).

Letters: B sources (global, all batches), K candidates per source, N rows (this process), T positions.
"""
from __future__ import annotations

import math

import torch

from ...config import PhaseTwoConfig, PolicyConfig, RLConfig, SearchConfig, StepConfig
from ...system import distributed, fsdp
from ...objectives.entropycontrol import AdaptiveEntropy
from ...objectives.policy import advantages, policy_loss, scored_moments, truncated_rows, zero_std_groups
from ...samples import Samples
from ..klreference import Reference
from .parts import Parts, phase_two, rewards_of, search, section, sources, update

REF_CHUNK = 64  # rows per chunk of the reference's no-graph scoring when --rescore-chunk is auto
FIELDS = ("tokens", "lengths", "owner", "scores", "token_scores")  # a batch's candidates, as Samples holds them


class PolicyStep:
    """The policy objective's RL step, given the parts (`steps.parts.Parts`) and its sections: phase one's search,
    the RL section (its --baseline), the policy objective's, phase two's and the steps'."""

    reads = ("search", "rl", "policy", "phase_two", "steps")

    def __init__(self, parts: Parts, search: SearchConfig, rl: RLConfig, policy: PolicyConfig,
                 phase_two: PhaseTwoConfig, steps: StepConfig):
        self.parts, self.search, self.rl, self.policy, self.phase_two, self.steps = \
            parts, search, rl, policy, phase_two, steps
        self.generation: dict | None = None  # the current generation (see the module docstring)
        self.reference: Reference | None = None  # the frozen reference, made at the first RL step (or loaded)
        # --use-adaptive-entropy: the entropy bonus's coefficient, moved after every update (its state checkpointed)
        self.entropy_control = AdaptiveEntropy(policy.entropy_coef, policy.entropy_coef_min, policy.entropy_coef_max,
                                               policy.entropy_coef_delta, policy.entropy_target) \
            if policy.use_adaptive_entropy else None

    # ------------------------------------------------------------------ reference
    def ensure_reference(self) -> None:
        if self.policy.kl_beta != 0 and self.reference is None:  # this is the first RL step: the end-of-MLE model
            p = self.parts
            self.reference = Reference.of(p.model, self.policy.ref_checkpoint, p.device, p.task.build_model)

    def reference_log_probs(self, source, cand: Samples) -> torch.Tensor:
        """(N, T) the reference's per-token log-probabilities of the candidates, a chunk of rows at a time."""
        chunk = self.phase_two.rescore_chunk
        chunk = chunk if chunk != "auto" else REF_CHUNK
        return self.reference.log_probs(self.parts.model, source, cand, chunk, self.parts.autocast)

    # ------------------------------------------------------------------ generation
    def rollout(self, batch: list[int]) -> dict:
        """Phase one and rewards of one batch (this process's share of it)."""
        p, idx = self.parts, distributed.shard(batch)
        source, examples = sources(p, idx), [p.task.train[i] for i in idx]
        p.model.eval()
        with fsdp.gathered(p.model), section(p, "phase 1: search"), p.autocast():  # --fsdp: gathered
            cand = search(p, self.search, source)
        with section(p, "rewards"):
            rewards = rewards_of(p, cand.tokens, cand.owner.tolist(), examples)  # (N,), NaN: no reward
            parts = getattr(p.reward, "last", None)  # several rewards: each one's values, for the log
        return {"idx": idx, "source": source, "cand": cand, "rewards": rewards, "parts": parts or {},
                "zero": zero_std_groups(rewards, cand.owner, len(idx))}  # (B_local,)

    def new_generation(self, number: int) -> dict:
        """Phase one and rewards of every batch, then advantages (and dropped groups) and the reference's
        log-probs with the whole generation's statistics: one generation, drawn at step `number` (1-based)."""
        batches = [next(self.parts.rl_batches) for _ in range(self.steps.grad_accum)]
        found = [self.rollout(batch) for batch in batches]
        cands, rewards = [f["cand"] for f in found], torch.cat([f["rewards"] for f in found])  # (N,) all batches
        lengths = torch.cat([c.lengths for c in cands])
        eos = self.parts.model.eos_id
        ended = sum(int((c.tokens == eos).any(dim=1).sum()) for c in cands)  # rows that produced eos
        B = sum(len(batch) for batch in batches)
        scored, total, squares = scored_moments(rewards)  # the rewards' moments, None (NaN) left out as TRL's nanstd
        sums = distributed.reduce_sums({"scored": scored, "reward": total, "reward_sq": squares, "rows": len(rewards),
                                        "zero_std": sum(int(f["zero"].sum()) for f in found),
                                        "length": int(lengths.sum()), "ended": ended})
        n, m = sums["rows"], sums["scored"]
        var = (sums["reward_sq"] - sums["reward"] ** 2 / m) / (m - 1) if m > 1 else 0.0
        parts = {}
        for f in found:  # several rewards: each one's values over the generation's batches
            for name, values in f["parts"].items():
                parts.setdefault(name, []).extend(values)
        metrics = {**self.parts.reward_log.row(rewards, parts, number), "frac_reward_zero_std": sums["zero_std"] / B,
                   "completion_length_mean": sums["length"] / n, "terminated": sums["ended"] / n,
                   "completion_length_min": -distributed.reduce_max(-float(lengths.min())),
                   "completion_length_max": distributed.reduce_max(float(lengths.max()))}
        gen = {"num_sources": B, "used": 0, "metrics": metrics,
               "parts": [self.part(f, math.sqrt(max(var, 0.0))) for f in found]}
        if self.policy.drop_zero_std:
            gen["metrics"]["dropped_groups"] = int(sums["zero_std"])
        return gen

    def part(self, found: dict, batch_std: float) -> dict:
        """One batch of the generation: its candidates, advantages and reference log-probs."""
        cand, idx = found["cand"], found["idx"]
        adv = advantages(found["rewards"], cand.owner, len(idx), self.rl.baseline or "mean",
                         self.policy.advantage_scale, batch_std=batch_std)
        scored = ~torch.isnan(found["rewards"])  # (N,) rows with a reward
        if self.policy.drop_zero_std:  # DAPO's dynamic sampling: groups without signal leave phase two
            keep = (~found["zero"][cand.owner]).nonzero().squeeze(1)
            cand, adv, scored = cand.select(keep), adv[keep], scored[keep]
        ref = self.reference_log_probs(found["source"], cand) if self.reference is not None else None
        return {"idx": idx, **{k: getattr(cand, k) for k in FIELDS}, "advantages": adv, "scored": scored, "ref": ref}

    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient of this update: --entropy-coef, or the adaptive controller's."""
        return self.policy.entropy_coef if self.entropy_control is None else self.entropy_control.applied()

    def objective(self, gen: dict, part: dict, counts: dict):
        """The token-level objective of one batch, normalised by the whole generation's counts."""
        policy = self.policy
        return policy_loss(part["advantages"], part["token_scores"].to(torch.float64), lengths=part["lengths"],
                           loss_type=policy.loss_type, epsilon=policy.clip_epsilon,
                           epsilon_high=policy.clip_epsilon_high, beta=policy.kl_beta, ref_token_logps=part["ref"],
                           kl_importance_weighted=policy.kl_importance_weighted, max_len=self.search.max_len,
                           num_sources=gen["num_sources"], owner=part["owner"], num_items=counts["tokens"],
                           num_rows=int(counts["rows"]), scored=part.get("scored"),
                           importance_sampling_level=policy.importance_sampling_level, delta=policy.delta,
                           sapo_temperature_pos=policy.sapo_temperature_pos,
                           sapo_temperature_neg=policy.sapo_temperature_neg, truncated=self.truncated(part),
                           off_policy_mask_threshold=policy.off_policy_mask_threshold,
                           entropy_coef=self.entropy_coef(), top_entropy_quantile=policy.top_entropy_quantile,
                           measure_entropy=self.entropy_control is not None)

    def counted_tokens(self, part: dict):
        """The batch's tokens in the loss's token count: every candidate's, or the terminated ones' with
        --mask-truncated-completions (TRL's num_items_in_batch of its zeroed completion mask)."""
        cut = self.truncated(part)
        return part["lengths"].sum() if cut is None else part["lengths"][~cut].sum()

    def truncated(self, part: dict):
        """(N,) the batch's candidates that end without EOS, with --mask-truncated-completions (else None)."""
        if not self.policy.mask_truncated_completions:
            return None
        return truncated_rows(part["tokens"], part["lengths"], self.parts.model.eos_id)

    # ------------------------------------------------------------------ the step
    def step(self) -> dict:
        """One update (a phase two per batch of the generation, gradients accumulated); a new generation first
        when the last one has had its --updates-per-generation."""
        self.ensure_reference()
        if self.generation is None or self.generation["used"] >= self.policy.updates_per_generation:
            self.generation = self.new_generation(self.parts.number)
        gen = self.generation
        counts = distributed.reduce_sums({"rows": sum(len(p["lengths"]) for p in gen["parts"]),
                                          "tokens": sum(int(self.counted_tokens(p)) for p in gen["parts"])})
        self.parts.model.eval()
        self.parts.optimizer.zero_grad(set_to_none=True)
        loss, stats = 0.0, {}
        with fsdp.gathered(self.parts.model, reduce=True):  # --fsdp: whole parameters, one reduction after
            for part in gen["parts"]:
                rows = Samples(*(part[k] for k in FIELDS))
                if len(rows):
                    got = {}  # phase_two counts this call's positions: its own dict
                    loss += phase_two(self.parts, self.phase_two, sources(self.parts, part["idx"]), rows,
                                      self.objective(gen, part, counts), stats=got)
                    for key in ("tokens", "clip_low", "clip_high", "kl", "entropy", "entropy_tokens"):
                        stats[key] = stats.get(key, 0) + got.get(key, 0)
        gen["used"] += 1
        total = distributed.reduce_sums({"loss": loss, "tokens": stats.get("tokens", 0),
                                         "clip_low": stats.get("clip_low", 0), "clip_high": stats.get("clip_high", 0),
                                         "kl": stats.get("kl", 0.0), "entropy": stats.get("entropy", 0.0),
                                         "entropy_tokens": stats.get("entropy_tokens", 0.0)})
        tokens = max(total["tokens"], 1)
        row = {"loss": total["loss"], **gen["metrics"], "update_in_generation": gen["used"],
               "clip_ratio_low": total["clip_low"] / tokens, "clip_ratio_high": total["clip_high"] / tokens}
        if self.policy.kl_beta != 0:
            row["kl"] = total["kl"] / tokens
        if self.entropy_control is not None:  # TRL's order: this update applied the last one's coefficient
            entropy = total["entropy"] / max(total["entropy_tokens"], 1.0)  # the window's token-weighted mean
            row.update(entropy=entropy, entropy_coef_applied=self.entropy_control.applied(),
                       entropy_coef=self.entropy_control.update(entropy))
        return {**row, **update(self.parts, self.steps, total["loss"])}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """A collective (every process calls it): which reference the run uses (`Reference.state_dict`: its
        kind, and its copy, whole tensors, or adapters where it has one) and every process's generation. One
        process: "generation"; several: "rank_generations", rank r's at r (its own sources' rows)."""
        gens = distributed.gather_objects(_moved(self.generation, "cpu"))
        reference = self.reference.state_dict() if self.reference is not None else None
        control = {} if self.entropy_control is None else {"entropy_control": self.entropy_control.state_dict()}
        if len(gens) == 1:
            return {"generation": gens[0], "reference": reference, **control}
        return {"generation": None, "rank_generations": gens, "reference": reference, **control}

    def load_state_dict(self, state: dict) -> None:
        """This process's generation where the checkpoint has one for it (the same number of processes; else
        the next step draws a new one), and the reference."""
        gens = state.get("rank_generations") or [state.get("generation")]
        gen = gens[distributed.rank()] if len(gens) == distributed.world() else None
        if gen is not None and "parts" not in gen:  # saved before --grad-accum: one batch, its fields at the top
            gen = {"num_sources": gen["num_sources"], "used": gen["used"], "metrics": gen["metrics"],
                   "parts": [{k: gen[k] for k in ("idx", *FIELDS, "advantages", "ref")}]}
        self.generation = _moved(gen, self.parts.device)
        if self.entropy_control is not None and "entropy_control" in state:  # its coefficient and last entropy
            self.entropy_control.load_state_dict(state["entropy_control"])
        ref = state.get("reference")
        p = self.parts
        self.reference = None if ref is None else Reference.from_state(ref, p.model, p.task.build_model)


def _moved(gen: dict | None, device) -> dict | None:
    """The generation with its batches' tensors on device."""
    if gen is None:
        return None
    parts = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in part.items()} for part in gen["parts"]]
    return {**gen, "parts": parts}
