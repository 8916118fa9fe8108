"""CPU seconds of a training step's parts: phase one, rewards, phase two, the update (for benchmarks).

A caller that wants them sets `trainer.part_times = {}` before a step; the step's sections (the same ones
`--profile-memory` names) then add their process CPU time (`time.process_time`: this process's, which other jobs
on the machine do not add to) into it under the part's name. Left at None, the default, a section is what it was
without this module: no clock is read.

Parts: "phase one" (the search), "references" (--include-reference's scoring and rewards), "rewards",
"phase two" (rescore_backward, the encoder's forward and backward included), "update" (gradient reduction,
clipping and the optimizer step). What is left of a step (collating the batch, the objective's coefficients) is
the step's time minus their sum.
"""
from __future__ import annotations

import time
from contextlib import contextmanager


def timed(inner, times: dict | None, part: str | None):
    """The context manager `inner`, its CPU seconds also added to times[part] when times is a dict."""
    if times is None or part is None:
        return inner
    return _timed(inner, times, part)


@contextmanager
def _timed(inner, times: dict, part: str):
    start = time.process_time()
    try:
        with inner:
            yield
    finally:
        times[part] = times.get(part, 0.0) + time.process_time() - start
