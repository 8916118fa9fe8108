"""CPU seconds of a training step's parts: phase one, rewards, phase two, the update (for benchmarks).

    times = PartTimes()
    times.attach(run.trainer)        # the trainer's timer hook: each timed part of a step adds into times
    run.train_step("rl")             # times == {"phase one": ..., "rewards": ..., "phase two": ..., "update": ...}
    times.detach(run.trainer)

The trainer's timed parts (its parts' `timer` hook, around the same sections `--profile-memory` names) then add their
process CPU time (`time.process_time`: this process's, which other jobs on the machine do not add to) under the
part's name. Without a timer, the default, the trainer reads no clock.

Parts: "phase one" (the search), "references" (--include-reference's scoring and rewards), "rewards",
"phase two" (rescore_backward, the encoder's forward and backward included), "update" (gradient reduction,
clipping and the optimizer step). What is left of a step (collating the batch, the objective's coefficients) is
the step's time minus their sum.
"""
from __future__ import annotations

import time
from contextlib import contextmanager


class PartTimes(dict):
    """part -> CPU seconds, added to by the trainer it is attached to."""

    @contextmanager
    def timer(self, part: str):
        """The trainer's hook: the CPU seconds of the block it wraps, added to self[part]."""
        start = time.process_time()
        try:
            yield
        finally:
            self[part] = self.get(part, 0.0) + time.process_time() - start

    def attach(self, trainer) -> "PartTimes":
        trainer.parts.timer = self.timer
        return self

    @staticmethod
    def detach(trainer) -> None:
        trainer.parts.timer = None
