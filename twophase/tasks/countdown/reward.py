"""The checker as a reward: `countdown(hypotheses, references, sources)` is 1.0 where a candidate (RPN) uses each
of its problem's numbers exactly once and its value is the target (`rpn.accepts`), else 0.0. It reads the problem
from `sources` (`3 7 25 = 250`), never the references: a problem without a known solution is scored alike.
"""
from __future__ import annotations

from functools import lru_cache

from .problems import parse_source
from .rpn import accepts


@lru_cache(maxsize=1 << 16)
def problem(source: str) -> tuple[tuple[int, ...], int]:
    """(numbers, target) of a source, parsed once: the reward reads the same sources at every step."""
    return parse_source(source)


def solved(hypothesis: str, source: str) -> bool:
    numbers, target = problem(source)
    return accepts(hypothesis, numbers, target)


def countdown(hypotheses: list[str], references: list[list[str]], sources: list[str]) -> list[float]:
    return [1.0 if solved(h, s) else 0.0 for h, s in zip(hypotheses, sources)]
