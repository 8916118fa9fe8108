"""Step costs of a Karel model: CPU seconds of an MLE step, an RL step and a validation pass.

    python -m benchmarks.karel --steps 3 --rl-beams 16,64 --eval-tasks 100          # the recipe's model
    python -m benchmarks.karel --steps 3 -- --karel-model paper --hidden-size 64 --embed-dim 64

Everything after `--` is train.py's flags for `--task karel` (its recipe's defaults apply, as in a run); the data
is the recipe's, from the cache (generated on first use). The model keeps its initial random weights, with EOS's
output bias at -30 so that every candidate runs to --max-len (31): the worst case of a trained model's RL step
and validation (whose candidates stop at ~15 tokens), the same for every model compared. Each measurement is
process CPU time (immune to other jobs on the machine, but not to their contention for caches and memory
bandwidth), after one untimed warm-up step, median over --steps; printed as one JSON line per measurement.
An MLE or RL row also has its step's parts (the trainer's own sections, `benchmarks.steptimes`), each the
median over the steps: `phase_one_s` (the search), `rewards_s` (executing every candidate on the task's
grids), `phase_two_s` (rescore_backward), `update_s` (clipping and the optimizer step) and `other_s` (the rest:
batching, the objective). Random weights give every candidate of a source the same reward (most often none
runs), so the beam objective's coefficients would all be 0 and phase two would skip every row: each reward gets
a random offset in [0, 1e-3) once computed (inside its timed part, at no measurable cost), so phase two rescores
all rows, as in a trained model's step where rewards differ (--keep-ties: as they are). `--grammar on,off`
measures the same sizes with and without the DSL's grammar, one model each (the same seed, so the same initial
weights).

    python -m benchmarks.karel --steps 5 --grammar on,off           # the RL step split, grammar on and off, K 16
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

import torch

from twophase import rewards, tasks
from twophase.constraints import Constrained
from twophase.tasks.data import DataError
from twophase.train import cli
from twophase.config import OneLineParser
from twophase.train.evaluation import validate
from .steptimes import PartTimes


PARTS = ("phase one", "rewards", "phase two", "update")


def _cpu_seconds(fn, steps: int) -> float:
    fn()  # warm-up: allocator, first-call costs
    times = []
    for _ in range(steps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def _step_seconds(run, phase: str, steps: int) -> dict:
    """Median CPU seconds of a training step and of each of its parts (and of the rest), after a warm-up."""
    run.train_step(phase)  # warm-up: allocator, first-call costs
    rows = []
    for _ in range(steps):
        times = PartTimes().attach(run.trainer)
        start = time.process_time()
        run.train_step(phase)
        total = time.process_time() - start
        parts = {f"{name.replace(' ', '_')}_s": times.get(name, 0.0) for name in PARTS}
        rows.append({"cpu_s": total, **parts, "other_s": total - sum(parts.values())})
    PartTimes.detach(run.trainer)
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


class Untied:
    """A reward with a random offset in [0, 1e-3) added to every value it gives: no two candidates tie, so no
    coefficient is 0 and phase two rescores every row (see the module docstring). Its other attributes (the
    several rewards' `last`, `names`) are the reward's."""

    def __init__(self, reward, seed: int = 0):
        self.reward, self.draws = reward, torch.Generator().manual_seed(seed)

    def __call__(self, hypotheses, references, **context) -> list[float]:
        values = self.reward(hypotheses, references, **context)
        offsets = torch.rand(len(values), generator=self.draws, dtype=torch.float64).tolist()
        return [v + 1e-3 * o for v, o in zip(values, offsets)]

    def __getattr__(self, name):
        return getattr(self.reward, name)


def measure(train_flags: list[str], steps: int, rl_beams: list[int], eval_tasks: int,
            grammars: list[str | None] = (None,), untie: bool = True) -> list[dict]:
    """One row per measurement: kind (mle / rl / eval), its sizes, CPU seconds; for each --grammar value
    (None: the recipe's); untie: offset the rewards (see the module docstring)."""
    rows = []
    for grammar in grammars:
        rows += _measure_one(train_flags + ([] if grammar is None else ["--grammar", grammar]), steps, rl_beams,
                             eval_tasks, untie)
    return rows


def _measure_one(train_flags: list[str], steps: int, rl_beams: list[int], eval_tasks: int,
                 untie: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        training = cli.build_from_flags(["--task", "karel", *train_flags, "--save-dir", folder, "--overwrite"])
        cfg = training.trainer.cfg
        with torch.no_grad():  # no candidate stops early (see the module docstring)
            model = training.trainer.model
            inner = model.model if isinstance(model, Constrained) else model  # grammar on
            inner.out.bias[inner.eos_id] = -30.0
        if untie:
            training.trainer.parts.reward = Untied(training.trainer.parts.reward)
        params = sum(p.numel() for p in training.trainer.model.parameters())
        head = {"model": cfg.karel_model, "grammar": cfg.grammar, "ties": "broken" if untie else "kept",
                "parameters": params, "threads": torch.get_num_threads()}
        rows = [{**head, "kind": "mle", "batch": cfg.mle_batch_size, **_step_seconds(training, "mle", steps)}]
        for k in rl_beams:
            training.trainer.rl.search.beam_size = k  # the RL step's own search section
            rows.append({**head, "kind": "rl", "batch": cfg.batch_size, "beam": k,
                         **_step_seconds(training, "rl", steps)})
        if eval_tasks:
            t = training.trainer
            run = lambda: validate(t.model, t.task, t.task.valid, t.reward, cfg.eval_beam, cfg.max_len,  # noqa
                                   t.device, limit=eval_tasks)
            rows.append({**head, "kind": "eval", "tasks": eval_tasks, "beam": cfg.eval_beam,
                         "cpu_s": _cpu_seconds(run, 1)})
        return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, train_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = OneLineParser(prog="python -m benchmarks.karel", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps of each kind (default: 3)")
    p.add_argument("--rl-beams", default="16", help="comma-separated K of the RL steps timed (default: 16)")
    p.add_argument("--eval-tasks", type=int, default=0, help="also time validation on this many tasks (0: no)")
    p.add_argument("--grammar", help="comma-separated --grammar values measured one after the other, e.g. on,off "
                                     "(default: the recipe's, or the one after --)")
    p.add_argument("--keep-ties", action="store_true",
                   help="rewards as they are: candidates tied within their source get coefficient 0, and phase "
                        "two skips them (default: ties broken, every row rescored)")
    args = p.parse_args(own)
    if args.steps < 1:
        p.error(f"--steps: expected at least 1, got {args.steps}")
    grammars = [None] if args.grammar is None else [g.strip() for g in args.grammar.split(",")]
    if args.grammar is not None and any(g not in ("on", "off") for g in grammars):
        p.error(f"--grammar: expected a comma-separated list of on and off, got {args.grammar!r}")
    try:
        beams = [int(k) for k in args.rl_beams.split(",")]
    except ValueError:
        p.error(f"--rl-beams: expected comma-separated integers, got {args.rl_beams!r}")
    try:
        rows = measure(train_flags, args.steps, beams, args.eval_tasks, grammars, untie=not args.keep_ties)
    except (cli.UsageError, DataError, rewards.RewardError, tasks.TaskError) as err:
        print(f"python -m benchmarks.karel: error: {err}", file=sys.stderr)
        return 2
    for row in rows:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
