"""What a training run has done (`RunState`), what its checkpoint holds, how it stops cleanly on a signal
(`GracefulStop`, `Interrupted`) and how it picks up again exactly where it stopped.

A checkpoint is the model, the optimizer (and --amp fp16's loss scale), the trainer's data order of both phases
and every random stream (Python, numpy, torch, CUDA, and each process's sampling generator), plus the run's
state: step, end of the MLE phase, best step and scores, statistics, summary, the plateau schedule. So `--resume`
continues bit-identically. Only plain data and tensors are stored, so it loads with
`torch.load(weights_only=True)`. Each part writes and reads its own share (`Trainer.state_dict`,
`RunState.state_dict`, `Plateau.state_dict`); `run.Run.save` composes them in the order of `KEYS`.
"""
from __future__ import annotations

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



