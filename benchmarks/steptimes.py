"""CPU seconds of a training step's parts: phase one, rewards, phase two, the update (for benchmarks).

    times = PartTimes()
    times.attach(run.trainer)        # what the step's sections report to: each part adds into times
    run.train_step("rl")             # times == {"phase one": ..., "rewards": ..., "phase two": ..., "update": ...}
    times.detach(run.trainer)

Attached, a `PartTimes` is the parts' profiler (`Parts.profiler`, the slot --profile-memory's `StepProfiler` takes
for a profiled step): the step's sections, which name the part of the step each belongs to, add their process CPU
time (`time.process_time`: this process's, which other jobs on the machine do not add to) under the part's name.
Unattached, the default, the step reads no clock.

Parts: "phase one" (the search), "references" (--include-reference's scoring and rewards), "rewards",
"phase two" (rescore_backward, the encoder's forward and backward included), "update" (gradient reduction,
clipping and the optimizer step). What is left of a step (collating the batch, the objective's coefficients) is
the step's time minus their sum. Phase two's own sections (its encoder passes and chunks) name no part: they lie
within "phase two".
"""
from __future__ import annotations

import contextlib
import time
from contextlib import contextmanager


class PartTimes(dict):
    """part -> CPU seconds, added to by the trainer it is attached to."""

    def section(self, name: str | None, part: str | None = None):
        """A section of the step (the parts' profiler's interface): timed into self[part] where it names a part."""
        return contextlib.nullcontext() if part is None else self.timed(part)

    @contextmanager
    def timed(self, part: str):
        """The CPU seconds of the block it wraps, added to self[part]."""
        start = time.process_time()
        try:
            yield
        finally:
            self[part] = self.get(part, 0.0) + time.process_time() - start

    def attach(self, trainer) -> "PartTimes":
        trainer.parts.profiler = self
        return self

    @staticmethod
    def detach(trainer) -> None:
        trainer.parts.profiler = None
