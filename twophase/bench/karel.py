"""Step costs of a Karel model: CPU seconds of an MLE step, an RL step and a validation pass.

    python -m twophase.bench.karel --steps 3 --rl-beams 16,64 --eval-tasks 100      # the recipe's model
    python -m twophase.bench.karel --steps 3 -- --karel-model paper --hidden-size 64 --embed-dim 64

Everything after `--` is train.py's flags for `--task karel` (its recipe's defaults apply, as in a run); the data
is the recipe's, from the cache (generated on first use). The model keeps its initial random weights, with EOS's
output bias at -30 so that every candidate runs to --max-len (31): the worst case of a trained model's RL step
and validation (whose candidates stop at ~15 tokens), the same for every model compared. Each measurement is
process CPU time (immune to other jobs on the machine, but not to their contention for caches and memory
bandwidth), after one untimed warm-up step, median over --steps; printed as one JSON line per measurement.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

import torch

from .. import rewards, tasks
from ..constraints import Constrained
from ..tasks.data import DataError
from ..train import cli
from ..train.config import OneLineParser
from ..train.evaluation import validate


def _cpu_seconds(fn, steps: int) -> float:
    fn()  # warm-up: allocator, first-call costs
    times = []
    for _ in range(steps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def measure(train_flags: list[str], steps: int, rl_beams: list[int], eval_tasks: int) -> list[dict]:
    """One row per measurement: kind (mle / rl / eval), its sizes, CPU seconds."""
    with tempfile.TemporaryDirectory() as folder:
        parser = cli.build_parser()
        argv = ["--task", "karel", *train_flags, "--save-dir", folder, "--overwrite"]
        parser.set_defaults(**cli.recipe_defaults(parser.parse_args(argv)))
        cfg = cli.config_from_args(parser.parse_args(argv))
        trainer = cli.build(cfg)
        with torch.no_grad():  # no candidate stops early (see the module docstring)
            inner = trainer.model.model if isinstance(trainer.model, Constrained) else trainer.model  # --grammar on
            inner.out.bias[inner.eos_id] = -30.0
        params = sum(p.numel() for p in trainer.model.parameters())
        head = {"model": cfg.karel_model, "parameters": params, "threads": torch.get_num_threads()}
        rows = [{**head, "kind": "mle", "batch": cfg.mle_batch_size,
                 "cpu_s": _cpu_seconds(lambda: trainer.train_step("mle"), steps)}]
        for k in rl_beams:
            trainer.cfg.beam_size = k
            rows.append({**head, "kind": "rl", "batch": cfg.batch_size, "beam": k,
                         "cpu_s": _cpu_seconds(lambda: trainer.train_step("rl"), steps)})
        if eval_tasks:
            run = lambda: validate(trainer.model, trainer.task, trainer.valid, trainer.reward, cfg.eval_beam,  # noqa
                                   cfg.max_len, trainer.device, limit=eval_tasks)
            rows.append({**head, "kind": "eval", "tasks": eval_tasks, "beam": cfg.eval_beam,
                         "cpu_s": _cpu_seconds(run, 1)})
        return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, train_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = OneLineParser(prog="python -m twophase.bench.karel", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps of each kind (default: 3)")
    p.add_argument("--rl-beams", default="16", help="comma-separated K of the RL steps timed (default: 16)")
    p.add_argument("--eval-tasks", type=int, default=0, help="also time validation on this many tasks (0: no)")
    args = p.parse_args(own)
    try:
        beams = [int(k) for k in args.rl_beams.split(",")]
    except ValueError:
        p.error(f"--rl-beams: expected comma-separated integers, got {args.rl_beams!r}")
    try:
        rows = measure(train_flags, args.steps, beams, args.eval_tasks)
    except (cli.UsageError, DataError, rewards.RewardError, tasks.TaskError) as err:
        print(f"python -m twophase.bench.karel: error: {err}", file=sys.stderr)
        return 2
    for row in rows:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
