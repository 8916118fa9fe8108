"""What a training run saves, and how it picks up again exactly where it stopped.

A checkpoint holds everything the next step depends on: parameters, optimizer state (and --amp fp16's loss
scale), the step, the data order of both phases, every random stream (Python, numpy, torch, CUDA, and each
process's sampling generator) and the run's statistics, so `--resume` continues bit-identically. Only plain
data and tensors are stored, so it loads with `torch.load(weights_only=True)`.
"""
from __future__ import annotations

from dataclasses import asdict

from . import distributed, fsdp
from .checkpoint import (python_rng_state, rng_state, save_atomic, set_generator_state, set_python_rng_state,
                         set_rng_state)
from .params import saved_state


class Resumable:
    """The checkpointing half of `Trainer` (it provides model, optimizer, scaler, step, samplers, stats, paths)."""

    def state(self, whole: tuple | None = None, policy: dict | None = None) -> dict:
        """whole: --fsdp's (model, optimizer) states with whole tensors (`fsdp.full_*`, gathered by every process);
        policy: --objective policy's state (`PolicyStep.state_dict`, gathered by every process)."""
        model, optimizer = whole or (saved_state(self.model), self.optimizer.state_dict())
        return {"model": model, "optimizer": optimizer, "step": self.step,
                "phase": self.phase_at(self.step - 1) if self.step else "mle", "config": asdict(self.cfg),
                "task": {"spec": self.task.spec, "state": self.task.state_dict(),
                         "origin": getattr(self.task, "origin", None)},  # where a plug-in was imported from
                "rng": rng_state(), "sampling_rng": self.sampling.get_state(),
                "mle_batches": self.mle_batches.state_dict() if self.mle_batches else None, "rl_batches": self.rl_batches.state_dict(),
                "stats": self.stats, "summary": self.summary, "bad_in_a_row": self.bad_in_a_row,
                "best_step": self.best_step, "elapsed_s": self.metrics.elapsed,
                "schedule": self.plateau.state_dict(), "mle_end": self.mle_end, "compared": self.compared,
                "log_step": self.log_step, "best_scores": self.best_scores,
                "presenting": python_rng_state(self.presenting),
                **({"policy": policy} if policy is not None else {}),
                # the frozen base the saved parameters need (--lora-r: the --hf-model folder's): basemodel
                **({"base_model": self.base_model} if getattr(self, "base_model", None) else {}),
                **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})}  # floats and ints

    def save_best(self, scores: dict) -> None:
        """checkpoint_best.pt at every validation that improves the --best-metric score. Every process calls this
        (the scores are reduced, so all take the same decision) and keeps `best` for the next comparison."""
        metric = scores.get(self.best_key)
        if self.checkpoints.improves(metric):
            self.checkpoints.best, self.best_step = float(metric), self.step
            self.best_scores = dict(scores)  # --rl-from-best reports them for the model it restores
            self.save(best=True)

    def save(self, best: bool = False, crash: bool = False, path=None, phase: str | None = None) -> None:
        """checkpoint_last.pt and a step checkpoint (best: checkpoint_best.pt instead; crash: checkpoint_crash.pt;
        path: that file alone, e.g. --compare-mle's branch point; phase: what the state says it is the end of).
        Every process calls this at the same step: rank 0's checkpoint gathers every process's RNG streams, so a
        resumed multi-process run continues exactly too."""
        rank_rngs = distributed.gather_objects({"rng": rng_state(), "sampling_rng": self.sampling.get_state()})
        whole = None
        if fsdp.is_sharded(self.model):  # a single process's layout, gathered by every process, saved by rank 0
            whole = fsdp.full_model_state(self.model), fsdp.full_optimizer_state(self.optimizer)
        policy = self.policy.state_dict() if getattr(self, "policy", None) is not None else None  # a collective
        if not self.is_main:
            return
        state = self.state(whole, policy)
        if len(rank_rngs) > 1:
            state.update(world_size=len(rank_rngs), rank_rngs=rank_rngs)
        if phase is not None:
            state["phase"] = phase
        if path is not None:
            save_atomic({**state, "best_metric": self.checkpoints.best}, path)
        elif crash:
            save_atomic(state, self.save_dir / "checkpoint_crash.pt")
        elif best:
            self.checkpoints.write_best(state)
        else:
            self.checkpoints.save(state, self.step)

    def load_state(self, state: dict) -> None:
        """Continue exactly where `state` was saved: parameters, optimizer, data order and every RNG."""
        fsdp.load_model(self.model, state["model"])  # --fsdp: each process keeps its slice of the whole tensors
        fsdp.load_optimizer(self.model, self.optimizer, state["optimizer"])
        if self.scaler is not None and "scaler" in state:  # a run saved without --amp fp16 starts a fresh scale
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        if self.mle_batches is not None and state["mle_batches"] is not None:
            self.mle_batches.load_state_dict(state["mle_batches"])
        self.rl_batches.load_state_dict(state["rl_batches"])
        self.stats.update({p: dict(v) for p, v in state["stats"].items()})
        self.summary = dict(state["summary"])
        self.bad_in_a_row = int(state["bad_in_a_row"])
        self.checkpoints.best, self.best_step = state.get("best_metric"), state.get("best_step")
        self.best_scores = state.get("best_scores")
        self.metrics.resume_at(state.get("elapsed_s", 0.0))
        if "schedule" in state:  # saved by a version without --lr-decay: the rate starts afresh
            self.plateau.load_state_dict(state["schedule"])
        if self.cfg.lr_decay >= 1:  # a constant rate: this run's --lr, as before the schedule existed
            self.plateau.lr = self.cfg.lr
        # An MLE phase the schedule ended early stays ended; otherwise --mle-steps (perhaps raised) decides.
        self.mle_end = int(state["mle_end"]) if self.plateau.stopped else self.cfg.mle_steps
        self.compared = bool(state.get("compared", False))
        if getattr(self, "policy", None) is not None and "policy" in state:  # mid-generation: its candidates
            self.policy.load_state_dict(state["policy"])
        self.log_step = int(state.get("log_step", self.step))
        if self.step < self.total:  # more steps asked for: a comparison after the shorter run no longer applies
            self.compared, self.log_step = False, self.step
        if "presenting" in state:  # the same on every process (Task.present's stream)
            set_python_rng_state(state["presenting"], self.presenting)
        saved = state.get("rank_rngs") or [{"rng": state["rng"], "sampling_rng": state["sampling_rng"]}]
        if len(saved) != distributed.world() and distributed.rank() > 0:
            return  # resumed on another number of processes: continues, though not bit-identically
        mine = saved[distributed.rank()] if len(saved) == distributed.world() else saved[0]
        set_rng_state(mine["rng"])
        set_generator_state(self.sampling, mine["sampling_rng"])
