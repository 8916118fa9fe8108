"""Countdown problems: a seeded generator, the TSV files that hold them, and the cache the generated ones live in.

A problem is a few numbers and a target; its line in a TSV file is `SOURCE<TAB>SOLUTION`: SOURCE the numbers then
the target, space-separated integers, with an optional `=` before the target (`3 7 25 = 250` or `3 7 25 250`);
SOLUTION an RPN expression (`3 7 + 25 *`, tokens separated by spaces), or empty (the tab may be left out too)
where no solution is known. A solution given must be one the checker accepts.

`generate(counts, params, seed)` draws `n` numbers in 1..max_number (with repetition, sorted), keeps the values
in [target_min, target_max] that some expression of them reaches (`rpn.reachable`) and picks the target uniformly
among those, so every generated problem has a solution; a draw with none in range is drawn again. The pool of
train + valid + test problems is distinct by (sorted numbers, target), so the splits are disjoint, and it is cut
into test, valid and train in that order. Each problem carries its canonical solution (the solver's); a share
`hidden` of the training problems, drawn from the same seeded stream, has it withheld (written empty), so MLE
never sees those and RL trains on them with the checker.

The splits are written once to `<cache dir>/<key>/{train,valid,test}.tsv`, the key hashing the counts, the
parameters, the seed and GENERATOR_VERSION; the cache dir is `$TWOPHASE_CACHE_DIR/countdown`, else
`$XDG_CACHE_HOME/twophase/countdown`, else `~/.cache/twophase/countdown`.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ..data import DataError, read_lines
from .rpn import accepts, reachable

GENERATOR_VERSION = 1
SPLITS = ("train", "valid", "test")
SEPARATOR = "="
DATA_SEED = 0  # every training seed sees the same problems


@dataclass(frozen=True)
class Params:
    """The generator's settings (the countdown section's flags)."""

    numbers: int = 3
    max_number: int = 30
    target_min: int = 1
    target_max: int = 100
    hidden: float = 0.8  # the share of training problems whose solution is withheld

    def check(self) -> str | None:
        """Why these settings cannot generate problems (one line naming the flag), or None."""
        if self.target_min > self.target_max:
            return (f"--countdown-target-min {self.target_min} is above --countdown-target-max "
                    f"{self.target_max}")
        if self.hidden > 1:
            return f"--countdown-hidden {self.hidden}: a share, at most 1"
        if self.numbers > 6:
            return f"--countdown-numbers {self.numbers}: the exhaustive solver handles at most 6 numbers"
        return None


@dataclass(frozen=True)
class Problem:
    numbers: tuple[int, ...]
    target: int
    solution: str = ""  # RPN; empty where unknown (or withheld)

    @property
    def source(self) -> str:
        return " ".join(map(str, self.numbers)) + f" {SEPARATOR} {self.target}"

    @property
    def key(self) -> tuple:
        return tuple(sorted(self.numbers)), self.target


def parse_source(text: str) -> tuple[tuple[int, ...], int]:
    """(numbers, target) of a SOURCE: integers, the target last, an optional `=` before it. ValueError saying
    what is wrong."""
    tokens = text.split()
    if len(tokens) >= 2 and tokens[-2] == SEPARATOR:
        tokens = tokens[:-2] + tokens[-1:]
    if len(tokens) < 2:
        raise ValueError(f"expected numbers then the target, found {text.strip()!r}")
    try:
        values = [int(t) for t in tokens]
    except ValueError:
        bad = next(t for t in tokens if not t.lstrip("-").isdigit())
        raise ValueError(f"{bad!r} is not an integer (a source is integers, an optional '=' before the "
                         "target)") from None
    return tuple(values[:-1]), values[-1]


def read_tsv(path) -> list[Problem]:
    """The problems of a TSV file; a bad line is a DataError naming FILE:LINE."""
    out = []
    for number, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        source, _, solution = line.partition("\t")
        if "\t" in solution:
            raise DataError(f"{path}:{number}: expected 'SOURCE<TAB>SOLUTION', found {line.count(chr(9))} tabs")
        try:
            numbers, target = parse_source(source)
        except ValueError as err:
            raise DataError(f"{path}:{number}: {err}") from None
        solution = " ".join(solution.split())
        if solution and not accepts(solution, numbers, target):
            raise DataError(f"{path}:{number}: the solution {solution!r} is not accepted: it must use each of "
                            f"{' '.join(map(str, numbers))} once (RPN, exact division) and equal {target}")
        out.append(Problem(numbers, target, solution))
    return out


def write_tsv(path, problems: list[Problem]) -> None:
    """The problems as a TSV file, written atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(f"{p.source}\t{p.solution}\n" for p in problems)
    os.replace(tmp, path)


def sample(rng: random.Random, params: Params) -> Problem:
    """One problem with a solution (see the module docstring)."""
    while True:
        numbers = tuple(sorted(rng.randint(1, params.max_number) for _ in range(params.numbers)))
        values = reachable(numbers)
        targets = sorted(v for v in values if params.target_min <= v <= params.target_max)
        if targets:
            target = rng.choice(targets)
            return Problem(numbers, target, values[target])


def generate(counts: dict, params: Params, seed: int = DATA_SEED) -> dict[str, list[Problem]]:
    """{"train", "valid", "test"}: distinct problems (see the module docstring). ValueError where the
    parameters admit fewer distinct problems than asked for."""
    rng = random.Random(f"countdown {seed}")
    total = sum(counts[s] for s in SPLITS)
    pool: dict[tuple, Problem] = {}
    misses = 0
    while len(pool) < total:
        p = sample(rng, params)
        if p.key in pool:
            misses += 1
            if misses > 20 * total + 1000:
                raise ValueError(f"found only {len(pool)} distinct problems of the {total} asked for: more or "
                                 "larger numbers, or a wider target range")
            continue
        pool[p.key] = p
    problems = list(pool.values())
    test = problems[:counts["test"]]
    valid = problems[counts["test"]:counts["test"] + counts["valid"]]
    train = problems[counts["test"] + counts["valid"]:]
    hidden = set(rng.sample(range(len(train)), round(params.hidden * len(train))))
    train = [Problem(p.numbers, p.target, "" if i in hidden else p.solution) for i, p in enumerate(train)]
    return {"train": train, "valid": valid, "test": test}


def default_cache_dir() -> Path:
    if os.environ.get("TWOPHASE_CACHE_DIR"):
        return Path(os.environ["TWOPHASE_CACHE_DIR"]) / "countdown"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "twophase" / "countdown"


def data_key(counts: dict, params: Params, seed: int = DATA_SEED) -> str:
    body = {"version": GENERATOR_VERSION, "seed": seed, "counts": counts, "params": asdict(params)}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def cached_files(counts: dict, params: Params, seed: int = DATA_SEED, cache_dir=None) -> tuple[dict, bool]:
    """({split: path}, whether they were there already): the generated splits' TSV files, written on first use."""
    folder = Path(cache_dir or default_cache_dir()) / data_key(counts, params, seed)
    paths = {s: folder / f"{s}.tsv" for s in SPLITS}
    if all(p.exists() for p in paths.values()):
        return paths, True
    splits = generate(counts, params, seed)
    for s in SPLITS:
        write_tsv(paths[s], splits[s])
    return paths, False
