"""The trainer: the parts of a run's steps (`steps.Parts`, plain data), its two steps (the MLE step, and the RL step
of the --objective's family, `steps.STEPS`) and its own part of a checkpoint.

Each step family reads its step top to bottom (`steps.mle`, `steps.sequence`, `steps.policy`, `steps.distill`),
given the parts and the sections of the configuration it reads (`steps.build`); none is given the trainer or the
whole configuration. The task (twophase.tasks) supplies the data, the
model's sources, target ids and detokenisation; the trainer knows nothing else about it, nor about the run (its
step count, checkpoints, logs: `run.Run`).
"""
from __future__ import annotations

from dataclasses import asdict

import torch

from ..config import Config
from ..system import distributed, fsdp
from ..tasks.base import Task
from .checkpoint import (host_copy, python_rng_state, rng_state, set_generator_state, set_python_rng_state,
                         set_rng_state)
from .evaluation import validate
from .steps import STEPS, MleStep, Parts, build


class Trainer:
    """The steps for one model, task and reward: `parts` (the model, optimizer, fp16's scaler, both phases' batch
    samplers, the sampling generator...), `mle` (the MLE step) and `rl` (the --objective's RL step; `teacher`:
    --objective distill's frozen teacher, train.teacher.load)."""

    def __init__(self, cfg: Config, task: Task, model, reward, device: torch.device, teacher=None):
        self.cfg = cfg
        self.parts = Parts.build(cfg, task, model, reward, device, teacher)
        self.mle = build(MleStep, cfg, self.parts)
        self.rl = build(STEPS[cfg.objective], cfg, self.parts)

    # What the run reads of the parts.
    task = property(lambda self: self.parts.task)
    model = property(lambda self: self.parts.model)
    device = property(lambda self: self.parts.device)
    reward = property(lambda self: self.parts.reward)
    optimizer = property(lambda self: self.parts.optimizer)

    def start_step(self, number: int, lr: float) -> None:
        """Before step `number`: its learning rate, fresh counts."""
        self.parts.start(number, lr)

    def step_figures(self) -> dict:
        """What the step's metrics row adds about the trainer: the auto chunk size, the rate, phase two's counts."""
        p = self.parts
        row = {"chunk": p.last_chunk} if self.cfg.rescore_chunk == "auto" else {}
        row["lr"] = p.lr
        if p.counts.get("positions"):  # phase two decoded this many prefixes for this many positions
            row["prefix_nodes"], row["prefix_positions"] = p.counts["nodes"], p.counts["positions"]
        return row

    def mle_step(self) -> dict:
        return self.mle.step()

    def rl_step(self) -> dict:
        return self.rl.step()

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """The trainer's part of a checkpoint: the parameters (LoRA: the adapters alone), the optimizer, the
        configuration and task it trains, the data order of both phases, every random stream (several processes:
        each one's, in "rank_rngs"), --objective policy's generation and fp16's loss scale. A collective: every
        process calls it (--fsdp gathers whole tensors, the policy and the streams are gathered too)."""
        p = self.parts
        rank_rngs = distributed.gather_objects({"rng": rng_state(), "sampling_rng": p.sampling.get_state()})
        if fsdp.is_sharded(p.model):  # a single process's layout, gathered by every process
            model, optimizer = fsdp.full_model_state(p.model), fsdp.full_optimizer_state(p.optimizer)
        else:
            model, optimizer = fsdp.saved_state(p.model), p.optimizer.state_dict()
        policy = self.rl.state_dict()  # the RL step's own (--objective policy's generation), None: nothing
        task = p.task
        return {"model": model, "optimizer": optimizer, "config": asdict(self.cfg),
                "task": {"spec": task.spec, "state": task.state_dict(),
                         "origin": getattr(task, "origin", None)},  # where a plug-in was imported from
                "rng": rng_state(), "sampling_rng": p.sampling.get_state(),
                "mle_batches": p.mle_batches.state_dict() if p.mle_batches else None,
                "rl_batches": p.rl_batches.state_dict(), "presenting": python_rng_state(p.presenting),
                **({"policy": policy} if policy is not None else {}),
                **({"scaler": p.scaler.state_dict()} if p.scaler is not None else {}),  # floats and ints
                **({"world_size": len(rank_rngs), "rank_rngs": rank_rngs} if len(rank_rngs) > 1 else {})}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's parameters, optimizer, data order, --objective policy's generation and every random
        stream (rank r's where the checkpoint has as many processes' as run now)."""
        p = self.parts
        self.load_weights(state)
        if p.mle_batches is not None and state["mle_batches"] is not None:
            p.mle_batches.load_state_dict(state["mle_batches"])
        p.rl_batches.load_state_dict(state["rl_batches"])
        if "policy" in state:  # the RL step's own: --objective policy mid-generation, its candidates
            self.rl.load_state_dict(state["policy"])
        if "presenting" in state:  # the same on every process (Task.present's stream)
            set_python_rng_state(state["presenting"], p.presenting)
        saved = state.get("rank_rngs") or [{"rng": state["rng"], "sampling_rng": state["sampling_rng"]}]
        if len(saved) != distributed.world() and distributed.rank() > 0:
            return  # resumed on another number of processes: continues, though not bit-identically
        mine = saved[distributed.rank()] if len(saved) == distributed.world() else saved[0]
        set_rng_state(mine["rng"])
        set_generator_state(p.sampling, mine["sampling_rng"])

    def load_weights(self, state: dict) -> None:
        """Parameters (LoRA: the adapters alone; --fsdp: into each process's shards), optimizer and fp16's scale."""
        p = self.parts
        fsdp.load_model(p.model, state["model"])
        fsdp.load_optimizer(p.model, p.optimizer, state["optimizer"])
        if p.scaler is not None and "scaler" in state:  # a run saved without --amp fp16 starts a fresh scale
            p.scaler.load_state_dict(state["scaler"])

    def snapshot(self) -> dict:
        """What the next step depends on, copied into CPU memory (this process's random streams only): held for
        a whole phase (--compare-mle's branch point), a copy on the device would cost it a second model and
        optimizer. Of the model, what a checkpoint holds (with LoRA the adapters alone: the base does not
        change)."""
        p = self.parts
        state = {"model": fsdp.saved_state(p.model), "optimizer": p.optimizer.state_dict(),
                 "mle_batches": p.mle_batches.state_dict(), "rl_batches": p.rl_batches.state_dict(),
                 "rng": rng_state(), "sampling_rng": p.sampling.get_state(),
                 **({"scaler": p.scaler.state_dict()} if p.scaler is not None else {})}
        return host_copy(state)

    def restore(self, snap: dict) -> None:
        """Back to a snapshot (or a checkpoint's fields of the same names, this process's streams)."""
        p = self.parts
        self.load_weights(snap)
        p.mle_batches.load_state_dict(snap["mle_batches"])
        p.rl_batches.load_state_dict(snap["rl_batches"])
        set_rng_state(snap["rng"])
        set_generator_state(p.sampling, snap["sampling_rng"])

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict:
        cfg = self.cfg
        with fsdp.gathered(self.model):
            return validate(self.model, self.task, self.task.valid, self.reward, cfg.eval_beam, cfg.max_len,
                            self.device, limit=cfg.valid_size)

