"""The parts a `run.Run` shares with --compare-mle's control (`mlephase.MleContinued`), each given what it uses:
`Saver` (the run's checkpoint, composed from its parts and written), `take_step` (one training step and its
bookkeeping: statistics, skipped updates, out-of-memory batches) and `validated` (the validation scores).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from .. import oom
from ..protocol import ModelError
from ..system import distributed
from ..system.profiling import StepProfiler
from . import runstate
from .checkpoint import save_atomic
from .report import peak_memory_mb
from .runstate import Interrupted


class Saver:
    """The run's checkpoint: the trainer's part, the state's, the plateau schedule's and the run's own (the phase,
    the elapsed time of `metrics`, the frozen base), composed in the order of `runstate.KEYS`, and written by the
    main process (`speaks`) into `checkpoints`' folder. `base_model`: the frozen base the saved parameters need
    (--lora-r: resume.record's), set before the first step."""

    def __init__(self, trainer, state, plateau, metrics, checkpoints, speaks: bool):
        self.trainer, self.state, self.plateau, self.metrics = trainer, state, plateau, metrics
        self.checkpoints, self.speaks = checkpoints, speaks
        self.base_model: dict | None = None

    @property
    def save_dir(self) -> Path:
        return self.checkpoints.save_dir

    def state_dict(self) -> dict:
        """A collective (the trainer's part): every process calls it."""
        s = self.state
        phase = "mle" if s.step - 1 < s.mle_end else "rl"  # the phase of the last step taken
        own = {"phase": phase if s.step else "mle", "elapsed_s": self.metrics.elapsed,
               "schedule": self.plateau.state_dict(),
               **({"base_model": self.base_model} if self.base_model else {})}
        return runstate.layout(self.trainer.state_dict(), s.state_dict(), own)

    def save(self, best: bool = False, crash: bool = False, path=None, phase: str | None = None) -> None:
        """checkpoint_last.pt and a step checkpoint (best: checkpoint_best.pt instead; crash: checkpoint_crash.pt;
        path: that file alone, e.g. --compare-mle's branch point; phase: what the state says it is the end of).
        Every process calls this at the same step: rank 0's checkpoint gathers every process's RNG streams, so a
        resumed multi-process run continues exactly too."""
        state = self.state_dict()  # a collective
        if not self.speaks:
            return
        if phase is not None:
            state["phase"] = phase
        if path is not None:
            save_atomic({**state, "best_metric": self.checkpoints.best}, path)
        elif crash:
            save_atomic(state, self.save_dir / "checkpoint_crash.pt")
        elif best:
            self.checkpoints.write_best(state)
        else:
            self.checkpoints.save(state, self.state.step)


def validated(trainer, step: int) -> dict:
    """The validation scores; a model error names the step it follows."""
    try:
        return trainer.validate()
    except ModelError as err:
        raise ModelError(f"validation after step {step}: {err}") from None


def take_step(trainer, state, saver: Saver, phase: str, lr: float, profiled: bool = False) -> dict:
    """One step of the phase (mle, rl or mle-continued, the comparison's) at rate `lr`, counted in
    `state.stats[phase]`; a non-finite loss or gradient skips the update (counted; too many in a row stop the run
    with a crash checkpoint, `saver`'s). `profiled`: --profile-memory's profile of this step."""
    start_step = state.step + 1
    trainer.start_step(start_step, lr)
    held = trainer.parts.profiler  # a caller's (a benchmark's timer), back after a profiled step
    if profiled:
        trainer.parts.profiler = StepProfiler(trainer.device)
    start, cpu_start = time.perf_counter(), time.process_time()
    row = None  # None after an out-of-memory error
    try:
        row = trainer.rl_step() if phase == "rl" else trainer.mle_step()
        count_bad_update(trainer, state, saver)
    except ModelError as err:  # NaN log-probabilities, say: the model and the step, never a dropped source
        raise ModelError(f"step {start_step} [{phase}]: {err}") from None
    except Exception as err:  # noqa: BLE001  (any error but out-of-memory is raised again)
        if not oom.is_out_of_memory(err) or distributed.world() > 1:
            raise  # several processes: one cannot skip alone, the others would wait for it in the all-reduce
    if row is None:  # out of the except block: the failed step's tensors, held by its traceback, are gone
        row = skip_out_of_memory(trainer, state, phase)
    row.update(trainer.step_figures())
    if profiled:  # --profile-memory: every step to memory_profile.jsonl, 1st printed
        if saver.speaks:
            trainer.parts.profiler.write(saver.save_dir / "memory_profile.jsonl", start_step, phase,
                                         echo=state.stats[phase]["steps"] == 0)
        trainer.parts.profiler = held
    stats = state.stats[phase]
    stats["seconds"] += time.perf_counter() - start
    # this process's CPU time: --compare-mle's budget on CPU, which other processes on the machine do not tilt
    stats["cpu_seconds"] = stats.get("cpu_seconds", 0.0) + time.process_time() - cpu_start
    stats["steps"] += 1
    stats["skipped"] += row["skipped"]
    if row.get("reward_mean") is not None:  # None: no candidate of the step was scored
        stats["reward_sum"] += row["reward_mean"]
        stats["reward_steps"] += 1
    return row


def count_bad_update(trainer, state, saver: Saver) -> None:
    """--max-bad-steps: a taken update resets the count, a bad skip adds one; past the limit, the run stops
    with a crash checkpoint holding the parameters from before them."""
    outcome = trainer.parts.outcome
    if outcome == "taken":
        state.bad_in_a_row = 0
    elif outcome is not None:
        state.bad_in_a_row += outcome == "bad"
        if state.bad_in_a_row > trainer.cfg.max_bad_steps:
            saver.save(crash=True)
            raise Interrupted(3, f"{state.bad_in_a_row} non-finite steps in a row at step {state.step + 1}; "
                                 f"saved {saver.save_dir / 'checkpoint_crash.pt'} (parameters from before them)")


def skip_out_of_memory(trainer, state, phase: str) -> dict:
    """Out of memory outside phase two's chunks (those halve themselves and retry): drop this batch with a
    memory summary on stderr, count it, and go on with the next."""
    device = trainer.device
    trainer.optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        summary = torch.cuda.memory_summary(device, abbreviated=True)
        oom.release()
    else:
        summary = f"peak memory {peak_memory_mb(device):.0f} MB"
    stats = state.stats[phase]
    stats["out_of_memory"] += 1
    print(f"step {state.step + 1} [{phase}]: out of memory, batch skipped ({stats['out_of_memory']} so "
          f"far)\n{summary}", file=sys.stderr, flush=True)
    return {"loss": None, "skipped": 1, "out_of_memory": 1}  # None: metrics.jsonl stays strict JSON
