"""Countdown: given numbers and a target, an arithmetic expression that uses each number once and equals the
target; many expressions are right and a checker, not a reference, judges them (docs/countdown.md).

- `rpn`: expressions in reverse Polish notation: `evaluate`, the checker `accepts(expression, numbers,
  target)`, the exhaustive solver `reachable` / `solve`.
- `problems`: `Problem`, the seeded generator (`generate`, `Params`), TSV files (`read_tsv`, `write_tsv`) and
  the cache of generated splits (`cached_files`).
- `grammar`: `RPNGrammar`, well-formed RPN as a stack counter for `--grammar on`.
- `reward`: the checker as the reward `countdown(hypotheses, references, sources)`.
- `task`: `--task countdown` (`Countdown`).
"""
from .problems import Params, Problem, generate, parse_source, read_tsv, write_tsv
from .rpn import OPS, accepts, evaluate, reachable, solve

__all__ = ["OPS", "Params", "Problem", "accepts", "evaluate", "generate", "parse_source", "reachable", "read_tsv",
           "solve", "write_tsv"]
