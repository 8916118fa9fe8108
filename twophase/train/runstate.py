"""What a training run has done (`RunState`), what its checkpoint holds, how it stops cleanly on a signal
(`GracefulStop`, `Interrupted`) and how it picks up again exactly where it stopped.

A checkpoint is the model, the optimizer (and --amp fp16's loss scale), the trainer's data order of both phases
and every random stream (Python, numpy, torch, CUDA, and each process's sampling generator), plus the run's
state: step, end of the MLE phase, best step and scores, statistics, summary, the plateau schedule. So `--resume`
continues bit-identically. Only plain data and tensors are stored, so it loads with
`torch.load(weights_only=True)`. Each part writes and reads its own share (`Trainer.state_dict`,
`RunState.state_dict`, `Plateau.state_dict`); `runparts.Saver` composes them in the order of `KEYS`.
"""
from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

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

    def state_dict(self) -> dict:
        return {"step": self.step, "stats": self.stats, "summary": self.summary, "bad_in_a_row": self.bad_in_a_row,
                "best_step": self.best_step, "mle_end": self.mle_end, "compared": self.compared,
                "log_step": self.log_step, "best_scores": self.best_scores}

    def load_state_dict(self, saved: dict) -> None:
        """The state a checkpoint saved (one of an earlier version: the fields it lacks as a fresh run's)."""
        self.step = int(saved["step"])
        self.stats.update({p: dict(v) for p, v in saved["stats"].items()})
        self.summary, self.bad_in_a_row = dict(saved["summary"]), int(saved["bad_in_a_row"])
        self.best_step, self.best_scores = saved.get("best_step"), saved.get("best_scores")
        self.mle_end = int(saved.get("mle_end", self.mle_end))
        self.compared = bool(saved.get("compared", False))
        self.log_step = int(saved.get("log_step", self.step))


# A checkpoint's keys in the order every version of the run wrote them: the trainer's (`Trainer.state_dict`), the
# run state's (`RunState.state_dict`) and the run's own (phase, elapsed_s, schedule, base_model) interleaved.
# `layout` puts the composed parts in this order, so a checkpoint stays the same file whoever writes each part.
KEYS = ("model", "optimizer", "step", "phase", "config", "task", "rng", "sampling_rng", "mle_batches", "rl_batches",
        "stats", "summary", "bad_in_a_row", "best_step", "elapsed_s", "schedule", "mle_end", "compared", "log_step",
        "best_scores", "presenting", "policy", "base_model", "scaler", "world_size", "rank_rngs")


def layout(*parts: dict) -> dict:
    """One checkpoint of `parts` (each a part's state_dict), its keys in the order of KEYS."""
    merged = {k: v for part in parts for k, v in part.items()}
    unknown = set(merged) - set(KEYS)
    if unknown:  # a part that writes a new key gives it its place here
        raise KeyError(f"checkpoint keys without a place in runstate.KEYS: {sorted(unknown)}")
    return {k: merged[k] for k in KEYS if k in merged}


class GracefulStop:
    """Stopping cleanly on SIGINT / SIGTERM: the first signal asks the run to stop after the current step (it
    then saves and exits 128 + signal: 130 for SIGINT, 143 for SIGTERM), and says how long that step has run, so
    an orchestrator's grace period can be weighed against it; a second one means "now" and exits at once,
    without saving the step in progress. What was saved stays: every checkpoint is written to a temporary file
    and renamed, so one being written when the second signal strikes is left as it was, and --resume continues
    from the newest complete checkpoint."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, repeats_within: float = 0.0):
        """repeats_within: seconds after the first signal during which the same signal again is a copy, not a
        second request. Under torchrun a Ctrl-C reaches every worker twice (from the terminal, and forwarded by
        the launcher), which must not count as "now"."""
        self.received: int | None = None
        self.repeats_within = repeats_within
        self._first_at = 0.0
        self._previous: dict = {}
        self.step: str | None = None  # the step in progress (`began`), and when it began
        self._step_began = 0.0

    def began(self, step: int, what: str = "step") -> None:
        """Step `step` (1-based; `what`: "step", or the comparison's "MLE-continued step") starts now: a first
        signal during it says how long it has run."""
        self.step, self._step_began = f"{what} {step}", time.monotonic()

    def _handle(self, signum, frame):
        if self.received == signum and time.monotonic() - self._first_at < self.repeats_within:
            return
        if self.received is not None:
            sys.stderr.write(f"\nsignal {signum} again: exiting now without saving\n")
            os._exit(128 + signum)
        self.received, self._first_at = signum, time.monotonic()
        running = "" if self.step is None else \
            f" during {self.step}, which has run {_clock(self._first_at - self._step_began)}"
        sys.stderr.write(f"\nsignal {signum}{running}: the step finishes, then the run saves and exits "
                         f"{128 + signum}; a second signal exits at once without saving the step (the checkpoints "
                         "saved so far stay; --resume continues from the newest)\n")

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


def _clock(seconds: float) -> str:
    """h:mm:ss, with tenths under a minute (a step of 0.4 s is not "0:00:00")."""
    return f"{seconds:.1f} s" if seconds < 60 else str(datetime.timedelta(seconds=round(seconds)))


class Interrupted(Exception):
    """The run stopped early on purpose (signal) or by necessity (too many bad steps); carries the exit code."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code



