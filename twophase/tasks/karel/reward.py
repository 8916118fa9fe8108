"""The execution reward of Bunel et al. (2018) and the checks the Karel task's metrics share with it.

`karel(hypotheses, references, spec)` is 1.0 when a candidate program maps every input world of its task's
specification pairs to the pair's output world, else 0.0; a syntax error, a crash or a time-out gives 0.0. It
declares only `spec`; the held-out pair lives in the examples' `hidden` data, which no reward is offered, so
training never sees it.

`karel.counts` adds up, over every call in this process, the candidates scored (`candidates`) and their outcomes
(`outcome`): `ok` (passed), `wrong`, `syntax_error`, and `runtime_error` (crashed or timed out on some pair);
`rates()` turns them into fractions, `counts.clear()` starts again. Executions are memoised per (program, world)
by `execute`, so a candidate found again by the next step's search is not run again.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from .dsl import try_parse
from .execute import execute
from .world import World

Pair = tuple[World, World]

OK, WRONG, RUNTIME, SYNTAX = "ok", "wrong", "runtime_error", "syntax_error"


def outcome(program: str, pairs: Sequence[Pair], max_ticks: int = 200) -> str:
    """OK if `program` turns each pair's input into its output; else SYNTAX (not a program), RUNTIME (it crashed
    or timed out on a pair before any wrong output) or WRONG (it ran and gave another world)."""
    if try_parse(program) is None:
        return SYNTAX
    for world_in, world_out in pairs:
        got = execute(program, world_in, max_ticks)
        if got is None:
            return RUNTIME
        if got != world_out:
            return WRONG
    return OK


class ExecutionReward:
    """The reward callable (see the module docstring); one instance, `karel`, is the registered plug-in."""

    def __init__(self, max_ticks: int = 200):
        self.max_ticks = max_ticks
        self.counts: Counter = Counter()

    def __call__(self, hypotheses: list[str], references: list[list[str]], spec: list) -> list[float]:
        out = []
        for hyp, pairs in zip(hypotheses, spec):
            result = outcome(hyp, pairs, self.max_ticks)
            self.counts[result] += 1
            out.append(1.0 if result == OK else 0.0)
        self.counts["candidates"] += len(out)
        return out

    def rates(self) -> dict:
        """Fractions of the candidates scored so far: passed, syntax_error, runtime_error."""
        n = max(self.counts["candidates"], 1)
        return {"passed": self.counts[OK] / n, "syntax_error": self.counts[SYNTAX] / n,
                "runtime_error": self.counts[RUNTIME] / n}


karel = ExecutionReward()
