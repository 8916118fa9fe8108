"""Baselines a learned Karel synthesiser must beat, scored like the model (on the held-out pair).

    python -m twophase.tasks.karel.baselines [--train-size 10000] [--valid-size 500] [--splits valid,test]

- `enumeration`: the first straight-line program of 1..4 actions (5 + 25 + 125 + 625 = 780 programs, shortest
  first, then in `ACTIONS` order) that passes the five specification pairs;
- `retrieval` "first": the first training program (in the training split's order) that passes them;
- `retrieval` "frequent": among the training programs that pass them, one whose behaviour is the most common:
  training programs are distinct strings, so "most frequent" counts *functions*, each program's outputs on
  `PROBES` fixed random worlds (crashes included) standing for its function; the largest group of consistent
  programs wins (ties: the group of the earliest program) and its earliest program is returned. No baseline
  reads the held-out pair; like the model, each returns one program per task (or none), which then
  `generalizes` when it also passes the held-out pair.

Scores per split: `generalization`, `spec_accuracy` (a program was found), `exact_match` (the reference). Cost:
retrieval runs up to every training program on a task's first pair (most fail there): ~1 minute for 1,500 tasks
against 10,000 programs on one core. `cached_report` (the lines a `--task karel` run prints after its table)
keeps its figures next to the dataset's cache file (`cached_figures`, which the command shares).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from . import dataset
from .dsl import ACTIONS, Program, parse
from .execute import run
from .generate import Example, GeneratorParams, sample_world

MAX_ACTIONS = 4
PROBES = 8  # random worlds whose outputs stand for a program's function ("frequent" retrieval)
VERSION = 1  # of the figures cached by cached_report; bump when a baseline changes
NAMES = {"enumeration": f"enumeration (straight-line, <= {MAX_ACTIONS} actions)",
         "retrieval_first": "retrieval (first consistent training program)",
         "retrieval_frequent": "retrieval (most frequent consistent behaviour)"}


def consistent(program: Program, pairs, max_ticks: int = 200) -> bool:
    """True when `program` maps each pair's input world to its output world (no crash, no time-out)."""
    return all(run(program, a, max_ticks) == b for a, b in pairs)


def straight_line_programs(max_actions: int = MAX_ACTIONS) -> list[tuple[str, Program]]:
    """(text, parsed) of every program of 1..max_actions actions, shortest first, then in ACTIONS order."""
    out = []
    for n in range(1, max_actions + 1):
        for body in itertools.product(ACTIONS, repeat=n):
            text = "DEF run m( " + " ".join(body) + " m)"
            out.append((text, parse(text)))
    return out


def enumeration(task: Example, programs: list | None = None) -> str | None:
    """The first straight-line program consistent with the task's specification pairs, or None."""
    for text, program in programs or straight_line_programs():
        if consistent(program, task.spec):
            return text
    return None


class Retrieval:
    """Training programs, parsed once, with their behaviour on PROBES worlds (see the module docstring)."""

    def __init__(self, train: list[Example], params: GeneratorParams | None = None, seed: int = 0):
        p = params or GeneratorParams()
        rng = np.random.default_rng(seed)
        probes = [sample_world(rng, p) for _ in range(PROBES)]
        self.programs = [(ex.program, parse(ex.program)) for ex in train]
        self.behaviour = [tuple(run(prog, w, p.max_ticks) for w in probes) for _, prog in self.programs]

    def matches(self, task: Example) -> list[int]:
        """Indices of the training programs consistent with the task's specification pairs."""
        first, rest = task.spec[0], task.spec[1:]
        return [i for i, (_, prog) in enumerate(self.programs)
                if run(prog, first[0]) == first[1] and consistent(prog, rest)]

    def first(self, found: list[int]) -> str | None:
        return self.programs[found[0]][0] if found else None

    def frequent(self, found: list[int]) -> str | None:
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i in found:
            groups[self.behaviour[i]].append(i)
        best = max(groups.values(), key=lambda g: (len(g), -g[0]), default=None)
        return self.programs[best[0]][0] if best else None


def score(hypotheses: list[str | None], tasks: list[Example]) -> dict:
    """generalization / spec_accuracy / exact_match of one program (or None) per task, and n."""
    n = max(len(tasks), 1)
    gen = sum(h is not None and consistent(parse(h), t.pairs) for h, t in zip(hypotheses, tasks))
    found = sum(h is not None and consistent(parse(h), t.spec) for h, t in zip(hypotheses, tasks))
    exact = sum(h == t.program for h, t in zip(hypotheses, tasks))
    return {"generalization": gen / n, "spec_accuracy": found / n, "exact_match": exact / n, "n": len(tasks)}


def evaluate(train: list[Example], tasks: list[Example], params: GeneratorParams | None = None) -> dict:
    """{baseline name: score(...)} of the three baselines on `tasks`, retrieving from `train`."""
    programs, index = straight_line_programs(), Retrieval(train, params)
    found = [index.matches(t) for t in tasks]
    return {"enumeration": score([enumeration(t, programs) for t in tasks], tasks),
            "retrieval_first": score([index.first(f) for f in found], tasks),
            "retrieval_frequent": score([index.frequent(f) for f in found], tasks)}


def format_report(figures: dict, n_train: int) -> list[str]:
    """Lines of a table: one row per baseline, generalization (and spec / exact on the last split) per split."""
    splits = list(figures)
    head = f"{f'baselines ({n_train} training programs)':50}" + "".join(f"{s + ' gen.':>12}" for s in splits)
    head += f"{splits[-1] + ' spec':>12}{splits[-1] + ' exact':>12}" if splits else ""
    lines = [head]
    for key, label in NAMES.items():
        cells = "".join(f"{figures[s][key]['generalization']:>12.1%}" for s in splits)
        last = figures[splits[-1]][key] if splits else {}
        lines.append(f"  {label:48}{cells}" + (f"{last['spec_accuracy']:>12.1%}{last['exact_match']:>12.1%}"
                                              if splits else ""))
    return lines


def cached_figures(splits: dict, key: str, names=("valid", "test"), cache_dir=None) -> dict:
    """{split: evaluate(train, split)} for `names`, from `<cache>/<key>.baselines-v<VERSION>.json` when there
    (the `--task karel` run and the command share it); computed and written otherwise."""
    path = Path(cache_dir or dataset.default_cache_dir()) / f"{key}.baselines-v{VERSION}.json"
    try:
        figures = json.loads(path.read_text())
    except (OSError, ValueError):
        figures = {}
    missing = [s for s in names if s not in figures]
    if missing:
        figures.update({s: evaluate(splits["train"], splits[s]) for s in missing})
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(figures))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs the next run the same minute
    return {s: figures[s] for s in names}


def cached_report(splits: dict, key: str, cache_dir=None) -> list[str]:
    """format_report of the valid and test splits (cached, see `cached_figures`)."""
    return format_report(cached_figures(splits, key, ("valid", "test"), cache_dir), len(splits["train"]))


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(prog="python -m twophase.tasks.karel.baselines",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--train-size", type=int, default=dataset.DEFAULT_TRAIN)
    parser.add_argument("--valid-size", type=int, default=dataset.DEFAULT_VALID)
    parser.add_argument("--splits", default="valid,test", help="comma-separated, of valid and test")
    args = parser.parse_args(argv)
    names = [s for s in args.splits.split(",") if s]
    if not names or any(s not in ("valid", "test") for s in names):
        print(f"{parser.prog}: error: --splits: expected names among valid,test, got {args.splits!r}",
              file=sys.stderr)
        return 2
    key = dataset.data_key(args.train_size, args.valid_size, dataset.DATA_SEED, GeneratorParams())
    try:
        splits = dataset.generated_splits(args.train_size, args.valid_size, dataset.DATA_SEED, GeneratorParams())
    except (ValueError, RuntimeError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(format_report(cached_figures(splits, key, names), len(splits["train"]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
