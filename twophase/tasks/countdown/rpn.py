"""Countdown's arithmetic: expressions in reverse Polish notation (RPN), their checker and an exhaustive solver.

An expression is a space-separated row of tokens, one per number and one per operator (`+ - * /`), operands
before their operator: `3 7 + 25 *` is (3 + 7) * 25. It is well formed when every operator finds two values on
the stack and one value is left at the end; with n numbers it has exactly 2n - 1 tokens.

The rules the checker applies (and the solver follows, so both agree on what a solution is):
- every intermediate value is an integer: `/` is allowed only where it divides exactly (never by zero);
- intermediate values may be zero or negative (`3 7 - 10 +` = 6 is a solution for 3, 7, 10 -> 6);
- each given number is used exactly once (a number given twice may be used twice), and the value is the target.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

OPS = ("+", "-", "*", "/")


def apply(op: str, a: int, b: int) -> int | None:
    """a op b, or None where `/` would not divide exactly (or divide by zero)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0 or a % b:
        return None
    return a // b


def evaluate(tokens: Sequence[str]) -> int | None:
    """The value of an RPN row, or None where it is not a well-formed expression of integers and operators, or
    a division is not exact."""
    stack: list[int] = []
    for tok in tokens:
        if tok in OPS:
            if len(stack) < 2:
                return None
            b, a = stack.pop(), stack.pop()
            value = apply(tok, a, b)
            if value is None:
                return None
            stack.append(value)
        else:
            try:
                stack.append(int(tok))
            except ValueError:
                return None
    return stack[0] if len(stack) == 1 else None


def accepts(expression: str, numbers: Sequence[int], target: int) -> bool:
    """The checker: `expression` (RPN, tokens separated by spaces) uses each of `numbers` exactly once and its
    value is `target`."""
    tokens = expression.split()
    used = [t for t in tokens if t not in OPS]
    if Counter(used) != Counter(str(n) for n in numbers):
        return False
    return evaluate(tokens) == target


def reachable(numbers: Sequence[int]) -> dict[int, str]:
    """Every value an expression using each of `numbers` exactly once can take, with the first expression found
    for it (RPN): the solver. Subsets of the numbers are combined bottom-up, each subset's values kept with one
    expression each, in a fixed order (sub-masks descending, values in insertion order, `+ - * /`), so the
    expression kept for a value (the canonical solution) depends on the numbers alone."""
    n = len(numbers)
    values: dict[int, dict[int, str]] = {1 << i: {int(x): str(int(x))} for i, x in enumerate(numbers)}
    for mask in sorted(range(1, 1 << n), key=lambda m: (bin(m).count("1"), m)):
        if mask in values:
            continue
        out: dict[int, str] = {}
        part = (mask - 1) & mask
        while part:  # every ordered split of the subset into two non-empty parts
            left, right = values[part], values[mask ^ part]
            for a, ea in left.items():
                for b, eb in right.items():
                    for op in OPS:
                        v = apply(op, a, b)
                        if v is not None and v not in out:
                            out[v] = f"{ea} {eb} {op}"
            part = (part - 1) & mask
        values[mask] = out
    return values[(1 << n) - 1]


def solve(numbers: Sequence[int], target: int) -> str | None:
    """A solution (RPN) of the problem, or None where there is none: exhaustive, so None means none exists."""
    return reachable(numbers).get(target)
