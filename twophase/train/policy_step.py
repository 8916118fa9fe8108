"""--objective policy: phase one once per generation, then --updates-per-generation optimizer steps on it.

A generation is one batch of sources, its candidates with phase one's per-token log-probabilities (the old
policy, `Samples.token_scores`), their rewards and advantages, and, with --kl-beta, the frozen reference's
per-token log-probabilities (no graph, chunked, once). Each RL step is one update: a phase two over the same
candidates with the token-level objective of `twophase.policy` (importance ratio to phase one, clipped; k3 KL),
so the first update's ratio is exactly 1. The generation lives in the checkpoint, so a run resumed between two
of its updates continues bit-identically. Several processes: each holds its sources' groups; the normalisers
(rows, tokens, the batch's reward std) are the global batch's, so the summed gradient is one process's; the
checkpoint holds every process's part of the generation (a resume on another number of processes draws a new
one). Under --fsdp the reference is sharded too, and each process holds one gathered copy at a time: the
model's for phase one, then the reference's for its scoring pass, then the model's for the update's phase two
(one gather and one reduction per update, plus the reference's gather and phase one's once per generation).

Letters: B sources (global), K candidates per source, N rows (this process), T positions.
"""
from __future__ import annotations

import math

import torch

from . import distributed, fsdp
from .. import protocol
from ..policy import advantages, policy_loss, zero_std_groups
from ..samples import Samples

REF_CHUNK = 64  # rows per chunk of the reference's no-graph scoring when --rescore-chunk is auto


class PolicyStep:
    """The policy objective's RL step for a `Trainer` (its model, task, batches, phase_two and _update)."""

    def __init__(self, trainer):
        self.t = trainer
        self.generation: dict | None = None  # the current generation (see the module docstring)
        self.reference = None  # the frozen reference model, made at the first RL step (or loaded)

    # ------------------------------------------------------------------ reference
    def ensure_reference(self) -> None:
        cfg = self.t.cfg
        if cfg.kl_beta == 0 or self.reference is not None:
            return
        state = None  # the end-of-MLE model (this is the first RL step), or --ref-checkpoint's
        if cfg.ref_checkpoint is not None:
            state = torch.load(cfg.ref_checkpoint, map_location=self.t.device, weights_only=True)
            state = state["model"] if "model" in state else state
        self.reference = self.frozen_copy(state)

    def frozen_copy(self, state: dict | None = None):
        """The model copied (--fsdp: sharded alike), with `state`'s parameters where given, frozen."""
        reference = fsdp.copy_model(self.t.model, self.t.task.build_model)
        if state is not None:
            fsdp.load_model(reference, state)  # whole tensors, into the shards under --fsdp
        return reference.eval().requires_grad_(False)

    @torch.no_grad()
    def reference_log_probs(self, source, cand: Samples) -> torch.Tensor:
        """(N, T) the reference's per-token log-probabilities of the candidates, a chunk of rows at a time."""
        chunk = self.t.cfg.rescore_chunk if self.t.cfg.rescore_chunk != "auto" else REF_CHUNK
        with fsdp.gathered(self.reference), protocol.scoring_mode(self.reference), self.t.autocast():
            enc = self.reference.encode(source)
            parts = [protocol.token_scores(self.reference, enc, cand.tokens[i:i + chunk], cand.owner[i:i + chunk])
                     for i in range(0, len(cand), chunk)]
        return torch.cat(parts).to(torch.float64) if parts else cand.tokens.new_zeros(0, 0, dtype=torch.float64)

    # ------------------------------------------------------------------ generation
    def new_generation(self) -> dict:
        """Phase one, rewards, advantages (and dropped groups), the reference's log-probs: one generation."""
        t, cfg = self.t, self.t.cfg
        batch = next(t.rl_batches)
        B, idx = len(batch), distributed.shard(batch)
        source, examples = t._sources(idx), [t.train[i] for i in idx]
        t.model.eval()
        with fsdp.gathered(t.model), t.section("phase 1: search"), t.autocast():  # --fsdp: gathered for the search
            cand = t.search(source)
        with t.section("rewards"):
            rewards = t.rewards_of(cand.tokens, cand.owner.tolist(), examples)  # (N,)
        zero = zero_std_groups(rewards, cand.owner, len(idx))  # (B_local,)
        ended = (cand.tokens == t.model.eos_id).any(dim=1)  # (N,) rows that produced eos_id
        sums = distributed.reduce_sums({"reward": float(rewards.sum()), "reward_sq": float((rewards ** 2).sum()),
                                        "rows": len(cand), "zero_std": int(zero.sum()),
                                        "length": int(cand.lengths.sum()), "ended": int(ended.sum())})
        n = sums["rows"]
        var = (sums["reward_sq"] - sums["reward"] ** 2 / n) / max(n - 1, 1)
        adv = advantages(rewards, cand.owner, len(idx), cfg.baseline or "mean", cfg.advantage_scale,
                         batch_std=math.sqrt(max(var, 0.0)))
        gen = {"idx": idx, "num_sources": B, "used": 0, "metrics": {
            "reward_mean": sums["reward"] / n, "reward_max": distributed.reduce_max(float(rewards.max())),
            "candidates": int(n), "frac_reward_zero_std": sums["zero_std"] / B,
            "completion_length_mean": sums["length"] / n, "terminated": sums["ended"] / n,
            "completion_length_min": -distributed.reduce_max(-float(cand.lengths.min())),
            "completion_length_max": distributed.reduce_max(float(cand.lengths.max()))}}
        if cfg.drop_zero_std:  # DAPO's dynamic sampling: groups without signal leave phase two (and its normalisers)
            keep = (~zero[cand.owner]).nonzero().squeeze(1)
            cand, adv = cand.select(keep), adv[keep]
            gen["metrics"]["dropped_groups"] = int(sums["zero_std"])
        gen.update(tokens=cand.tokens, lengths=cand.lengths, owner=cand.owner, scores=cand.scores,
                   token_scores=cand.token_scores, advantages=adv,
                   ref=self.reference_log_probs(source, cand) if self.reference is not None else None)
        return gen

    def objective(self, gen: dict):
        """The update's token-level objective; a collective (the global normalisers): every process calls it."""
        cfg = self.t.cfg
        n = distributed.reduce_sums({"rows": len(gen["lengths"]), "tokens": int(gen["lengths"].sum())})
        return policy_loss(gen["advantages"], gen["token_scores"].to(torch.float64), lengths=gen["lengths"],
                           loss_type=cfg.loss_type, epsilon=cfg.clip_epsilon, epsilon_high=cfg.clip_epsilon_high,
                           beta=cfg.kl_beta, ref_token_logps=gen["ref"],
                           kl_importance_weighted=cfg.kl_importance_weighted, max_len=cfg.max_len,
                           num_sources=gen["num_sources"], owner=gen["owner"], num_items=n["tokens"],
                           num_rows=int(n["rows"]))

    # ------------------------------------------------------------------ the step
    def step(self) -> dict:
        """One update; a new generation first when the last one has had its --updates-per-generation."""
        t, cfg = self.t, self.t.cfg
        self.ensure_reference()
        if self.generation is None or self.generation["used"] >= cfg.updates_per_generation:
            self.generation = self.new_generation()
        gen = self.generation
        rows = Samples(gen["tokens"], gen["lengths"], gen["owner"], gen["scores"], gen["token_scores"])
        source = t._sources(gen["idx"])
        t.model.eval()
        t.optimizer.zero_grad(set_to_none=True)
        stats = {}
        objective = self.objective(gen)  # a collective: also where --drop-zero-std left this process no rows
        with fsdp.gathered(t.model, reduce=True):  # --fsdp: whole parameters for phase two, one reduction after
            loss = t.phase_two(source, rows, objective, stats=stats) if len(rows) else 0.0
        gen["used"] += 1
        total = distributed.reduce_sums({"loss": loss, "tokens": stats.get("tokens", 0),
                                         "clip_low": stats.get("clip_low", 0), "clip_high": stats.get("clip_high", 0),
                                         "kl": stats.get("kl", 0.0)})
        tokens = max(total["tokens"], 1)
        row = {"loss": total["loss"], **gen["metrics"], "update_in_generation": gen["used"],
               "clip_ratio_low": total["clip_low"] / tokens, "clip_ratio_high": total["clip_high"] / tokens}
        if cfg.kl_beta != 0:
            row["kl"] = total["kl"] / tokens
        return {**row, **t._update(total["loss"])}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """A collective (every process calls it): every process's generation, the reference's whole tensors.
        One process: "generation"; several: "rank_generations", rank r's at r (its own sources' rows)."""
        mine = None if self.generation is None else {k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                     for k, v in self.generation.items()}
        gens = distributed.gather_objects(mine)
        reference = None if self.reference is None else {k: fsdp.whole(v)  # all of it: it has no trainable part
                                                          for k, v in self.reference.state_dict().items()}
        if len(gens) == 1:
            return {"generation": gens[0], "reference": reference}
        return {"generation": None, "rank_generations": gens, "reference": reference}

    def load_state_dict(self, state: dict) -> None:
        """This process's generation where the checkpoint has one for it (the same number of processes; else
        the next step draws a new one), and the reference."""
        gens = state.get("rank_generations") or [state.get("generation")]
        gen = gens[distributed.rank()] if len(gens) == distributed.world() else None
        if gen is not None:
            gen = {k: v.to(self.t.device) if isinstance(v, torch.Tensor) else v for k, v in gen.items()}
        self.generation = gen
        if state.get("reference") is not None:
            self.reference = self.frozen_copy(state["reference"])
