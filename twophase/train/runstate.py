"""What a training run has done (`RunState`), what its checkpoint holds, how it stops cleanly on a signal
(`GracefulStop`, `Interrupted`) and how it picks up again exactly where it stopped.

A checkpoint is the model, the optimizer (and --amp fp16's loss scale), the trainer's data order of both phases
and every random stream (Python, numpy, torch, CUDA, and each process's sampling generator), plus the run's
state: step, end of the MLE phase, best step and scores, statistics, summary, the plateau schedule. So `--resume`
continues bit-identically. Only plain data and tensors are stored, so it loads with
`torch.load(weights_only=True)`. The functions take the `run.Run` whose parts they read.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from ..system import distributed, fsdp
from .checkpoint import (host_copy, python_rng_state, rng_state, save_atomic, set_generator_state,
                         set_python_rng_state, set_rng_state)
from ..system.fsdp import saved_state

PHASES = ("mle", "rl", "mle-continued")  # the last: --compare-mle's control


def fresh_stats() -> dict:
    return {p: {"steps": 0, "seconds": 0.0, "skipped": 0, "out_of_memory": 0, "reward_sum": 0.0, "reward_steps": 0}
            for p in PHASES}


@dataclass
class RunState:
    """What the run has done so far, saved in every checkpoint beside the model and optimizer."""
    mle_end: int  # the MLE phase's last step: --mle-steps, or earlier once --lr-decay ended it
    step: int = 0
    best_step: int | None = None  # the step of checkpoint_best.pt, and its validation scores
    best_scores: dict | None = None
    stats: dict = field(default_factory=fresh_stats)  # per phase: steps, seconds, skips, reward sums
    summary: dict = field(default_factory=dict)  # per phase: the closing table's figures
    bad_in_a_row: int = 0  # non-finite updates in a row (--max-bad-steps)
    log_step: int = 0  # the last step number in metrics.jsonl (beyond RL's with --compare-mle's)
    compared: bool = False  # --compare-mle's comparison done


def state_dict(run, whole: tuple | None = None, policy: dict | None = None) -> dict:
    """What a checkpoint of `run` holds. whole: --fsdp's (model, optimizer) states with whole tensors
    (`fsdp.full_*`, gathered by every process); policy: --objective policy's state (`PolicyStep.state_dict`,
    gathered by every process)."""
    t, s = run.trainer, run.state
    model, optimizer = whole or (saved_state(t.model), t.optimizer.state_dict())
    return {"model": model, "optimizer": optimizer, "step": s.step,
            "phase": run.phase_at(s.step - 1) if s.step else "mle", "config": asdict(t.cfg),
            "task": {"spec": t.task.spec, "state": t.task.state_dict(),
                     "origin": getattr(t.task, "origin", None)},  # where a plug-in was imported from
            "rng": rng_state(), "sampling_rng": t.sampling.get_state(),
            "mle_batches": t.mle_batches.state_dict() if t.mle_batches else None,
            "rl_batches": t.rl_batches.state_dict(),
            "stats": s.stats, "summary": s.summary, "bad_in_a_row": s.bad_in_a_row, "best_step": s.best_step,
            "elapsed_s": run.metrics.elapsed, "schedule": run.plateau.state_dict(), "mle_end": s.mle_end,
            "compared": s.compared, "log_step": s.log_step, "best_scores": s.best_scores,
            "presenting": python_rng_state(t.presenting),
            **({"policy": policy} if policy is not None else {}),
            # the frozen base the saved parameters need (--lora-r: the --hf-model folder's): resume.record
            **({"base_model": run.base_model} if run.base_model else {}),
            **({"scaler": t.scaler.state_dict()} if t.scaler is not None else {})}  # floats and ints


def save_best(run, scores: dict) -> None:
    """checkpoint_best.pt at every validation that improves the --best-metric score. Every process calls this
    (the scores are reduced, so all take the same decision) and keeps `best` for the next comparison."""
    metric = scores.get(run.best_key)
    if run.checkpoints.improves(metric):
        run.checkpoints.best, run.state.best_step = float(metric), run.state.step
        run.state.best_scores = dict(scores)  # --rl-from-best reports them for the model it restores
        save(run, best=True)


def save(run, best: bool = False, crash: bool = False, path=None, phase: str | None = None) -> None:
    """checkpoint_last.pt and a step checkpoint (best: checkpoint_best.pt instead; crash: checkpoint_crash.pt;
    path: that file alone, e.g. --compare-mle's branch point; phase: what the state says it is the end of).
    Every process calls this at the same step: rank 0's checkpoint gathers every process's RNG streams, so a
    resumed multi-process run continues exactly too."""
    t = run.trainer
    rank_rngs = distributed.gather_objects({"rng": rng_state(), "sampling_rng": t.sampling.get_state()})
    whole = None
    if fsdp.is_sharded(t.model):  # a single process's layout, gathered by every process, saved by rank 0
        whole = fsdp.full_model_state(t.model), fsdp.full_optimizer_state(t.optimizer)
    policy = t.policy.state_dict() if t.policy is not None else None  # a collective
    if not run.is_main:
        return
    state = state_dict(run, whole, policy)
    if len(rank_rngs) > 1:
        state.update(world_size=len(rank_rngs), rank_rngs=rank_rngs)
    if phase is not None:
        state["phase"] = phase
    if path is not None:
        save_atomic({**state, "best_metric": run.checkpoints.best}, path)
    elif crash:
        save_atomic(state, run.save_dir / "checkpoint_crash.pt")
    elif best:
        run.checkpoints.write_best(state)
    else:
        run.checkpoints.save(state, run.state.step)


def load_state(run, saved: dict) -> None:
    """Continue exactly where `saved` was saved: the run's state, and the trainer's parameters, optimizer, data
    order and every random stream."""
    s, cfg = run.state, run.trainer.cfg
    s.step = int(saved["step"])
    s.stats.update({p: dict(v) for p, v in saved["stats"].items()})
    s.summary, s.bad_in_a_row = dict(saved["summary"]), int(saved["bad_in_a_row"])
    run.checkpoints.best, s.best_step = saved.get("best_metric"), saved.get("best_step")
    s.best_scores = saved.get("best_scores")
    run.metrics.resume_at(saved.get("elapsed_s", 0.0))
    if "schedule" in saved:  # saved by a version without --lr-decay: the rate starts afresh
        run.plateau.load_state_dict(saved["schedule"])
    if cfg.lr_decay >= 1:  # a constant rate: this run's --lr, as before the schedule existed
        run.plateau.lr = cfg.lr
    # An MLE phase the schedule ended early stays ended; otherwise --mle-steps (perhaps raised) decides.
    s.mle_end = int(saved["mle_end"]) if run.plateau.stopped else cfg.mle_steps
    s.compared = bool(saved.get("compared", False))
    s.log_step = int(saved.get("log_step", s.step))
    if s.step < run.total:  # more steps asked for: a comparison after the shorter run no longer applies
        s.compared, s.log_step = False, s.step
    load_trainer_state(run.trainer, saved)


# ---------------------------------------------------------------------- the trainer's part
def load_weights(trainer, state: dict) -> None:
    """Parameters (LoRA: the adapters alone; --fsdp: into each process's shards), optimizer and fp16's scale."""
    fsdp.load_model(trainer.model, state["model"])
    fsdp.load_optimizer(trainer.model, trainer.optimizer, state["optimizer"])
    if trainer.scaler is not None and "scaler" in state:  # a run saved without --amp fp16 starts a fresh scale
        trainer.scaler.load_state_dict(state["scaler"])


def load_trainer_state(trainer, state: dict) -> None:
    """A checkpoint's parameters, optimizer, data order, --objective policy's generation and every random
    stream (rank r's where the checkpoint has as many processes' as run now)."""
    load_weights(trainer, state)
    if trainer.mle_batches is not None and state["mle_batches"] is not None:
        trainer.mle_batches.load_state_dict(state["mle_batches"])
    trainer.rl_batches.load_state_dict(state["rl_batches"])
    if trainer.policy is not None and "policy" in state:  # mid-generation: its candidates
        trainer.policy.load_state_dict(state["policy"])
    if "presenting" in state:  # the same on every process (Task.present's stream)
        set_python_rng_state(state["presenting"], trainer.presenting)
    saved = state.get("rank_rngs") or [{"rng": state["rng"], "sampling_rng": state["sampling_rng"]}]
    if len(saved) != distributed.world() and distributed.rank() > 0:
        return  # resumed on another number of processes: continues, though not bit-identically
    mine = saved[distributed.rank()] if len(saved) == distributed.world() else saved[0]
    set_rng_state(mine["rng"])
    set_generator_state(trainer.sampling, mine["sampling_rng"])


def snapshot(trainer) -> dict:
    """What the trainer's next step depends on, copied into CPU memory (this process's random streams only):
    held for a whole phase (--compare-mle's branch point), a copy on the device would cost it a second model
    and optimizer. Of the model, what a checkpoint holds (with LoRA the adapters alone: the base does not change)."""
    state = {"model": saved_state(trainer.model), "optimizer": trainer.optimizer.state_dict(),
             "mle_batches": trainer.mle_batches.state_dict(), "rl_batches": trainer.rl_batches.state_dict(),
             "rng": rng_state(), "sampling_rng": trainer.sampling.get_state(),
             **({"scaler": trainer.scaler.state_dict()} if trainer.scaler is not None else {})}
    return host_copy(state)


def restore(trainer, snap: dict) -> None:
    """Back to a snapshot (or a checkpoint's fields of the same names, this process's streams)."""
    load_weights(trainer, snap)
    trainer.mle_batches.load_state_dict(snap["mle_batches"])
    trainer.rl_batches.load_state_dict(snap["rl_batches"])
    set_rng_state(snap["rng"])
    set_generator_state(trainer.sampling, snap["sampling_rng"])


class GracefulStop:
    """Stopping cleanly on SIGINT / SIGTERM: the first signal asks the run to stop after the current step (it
    then saves and exits 128 + signal: 130 for SIGINT, 143 for SIGTERM); a second one means "now" and exits at
    once, without saving."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, repeats_within: float = 0.0):
        """repeats_within: seconds after the first signal during which the same signal again is a copy, not a
        second request. Under torchrun a Ctrl-C reaches every worker twice (from the terminal, and forwarded by
        the launcher), which must not count as "now"."""
        self.received: int | None = None
        self.repeats_within = repeats_within
        self._first_at = 0.0
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.received == signum and time.monotonic() - self._first_at < self.repeats_within:
            return
        if self.received is not None:
            sys.stderr.write(f"\nsignal {signum} again: exiting now without saving\n")
            os._exit(128 + signum)
        self.received, self._first_at = signum, time.monotonic()
        sys.stderr.write(f"\nsignal {signum}: finishing the current step, then saving (send again to exit now)\n")

    def __enter__(self) -> "GracefulStop":
        # Handlers can only be installed from the main thread (e.g. not inside some test runners' workers).
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


class Interrupted(Exception):
    """The run stopped early on purpose (signal) or by necessity (too many bad steps); carries the exit code."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code



