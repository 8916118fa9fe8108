"""What the Karel splits hold: `split_stats(examples)` per split, and the command that prints them.

    python -m twophase.tasks.karel.stats [--train-size 10000] [--valid-size 500] [--seed 0]

prints, for each split of the dataset `--task karel` trains on (generated, or loaded from its cache), the number
of tasks, the mean program length in tokens (`DEF run m( ... m)` included), the share of straight-line programs
(no REPEAT, WHILE, IF or IFELSE), and the histogram of control-flow depth (0: straight line; 1: control
statements, none nested; ...). docs/karel.md quotes its output.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter

from . import dataset
from .dsl import parse
from .generate import Example, GeneratorParams


def depth(block: tuple) -> int:
    """How deep control statements nest in a block (0: none)."""
    deepest = 0
    for node in block:
        inner = [getattr(node, arm) for arm in ("body", "then", "orelse") if hasattr(node, arm)]
        if inner:
            deepest = max(deepest, 1 + max(depth(b) for b in inner))
    return deepest


def split_stats(examples: list[Example]) -> dict:
    """{"n", "mean_tokens", "straight_line", "depths": {depth: share}} of a split's programs."""
    n = len(examples)
    if n == 0:
        return {"n": 0, "mean_tokens": float("nan"), "straight_line": float("nan"), "depths": {}}
    depths = Counter(depth(parse(ex.program).body) for ex in examples)
    tokens = sum(len(ex.program.split()) for ex in examples)
    return {"n": n, "mean_tokens": tokens / n, "straight_line": depths[0] / n,
            "depths": {d: depths[d] / n for d in sorted(depths)}}


def format_stats(splits: dict[str, list[Example]]) -> str:
    stats = {name: split_stats(examples) for name, examples in splits.items()}
    deepest = max((d for s in stats.values() for d in s["depths"]), default=0)
    head = f"{'split':6}{'tasks':>7}{'mean tokens':>13}{'straight-line':>15}" + "".join(
        f"{f'depth {d}':>9}" for d in range(deepest + 1))
    lines = [head]
    for name, s in stats.items():
        lines.append(f"{name:6}{s['n']:>7}{s['mean_tokens']:>13.2f}{s['straight_line']:>15.1%}" + "".join(
            f"{s['depths'].get(d, 0.0):>9.1%}" for d in range(deepest + 1)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(prog="python -m twophase.tasks.karel.stats", description=__doc__.split("\n")[0])
    parser.add_argument("--train-size", type=int, default=dataset.DEFAULT_TRAIN)
    parser.add_argument("--valid-size", type=int, default=dataset.DEFAULT_VALID)
    parser.add_argument("--seed", type=int, default=dataset.DATA_SEED, help="the data seed (--task karel: 0)")
    args = parser.parse_args(argv)
    try:
        splits = dataset.generated_splits(args.train_size, args.valid_size, args.seed, GeneratorParams())
    except (ValueError, RuntimeError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(format_stats(splits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
