"""Benchmark: an RL step's phase one eager against `--compile` (the decode step through torch.compile).

    python -m benchmarks.compile -- --init-from runs/g2p/checkpoint_mle_end.pt        # the default G2P recipe
    python -m benchmarks.compile --eos-bias -30 -- --task karel --beam-size 16 --grammar on

Everything after `--` is train.py's flags (their recipe's defaults apply, as in a run); the trainer is built as
the run builds it, with `--compile` (default on: inductor) added. Each round takes the next RL batch, as the run
would, and runs phase one (`train.steps.parts.search`) eagerly (`Compiled.enabled = False`) and compiled, in an order that
alternates round by round, timing process CPU time. The first --cold compiled rounds (compiling) are reported
apart: their wall time and the graphs compiled, and the backend's compile seconds; then the median over the
--rounds warm rounds of phase one and of one decoding step (phase one / its candidates' length), and the graphs
compiled over the whole run (new shapes that recompiled). `--eos-bias` sets the output bias of eos (-30: every
candidate runs to --max-len, as `python -m benchmarks.karel` does). One JSON line per model.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

import torch

from twophase import rewards, tasks
from twophase.compiling import Compiled
from twophase.tasks.data import DataError
from twophase.train import cli
from twophase.train.steps.parts import presented, search
from twophase.config import OneLineParser


def _compiled_part(model) -> Compiled:
    return next(m for m in model.modules() if isinstance(m, Compiled))


def _timed(trainer, source, clock=time.process_time) -> tuple[float, int]:
    start = clock()
    cand = search(trainer.parts, trainer.cfg.section("search"), source)
    return clock() - start, max(1, cand.tokens.shape[1])  # seconds, decoding steps taken


def measure(train_flags: list[str], rounds: int, cold: int, eos_bias: float | None) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        argv = [*train_flags, "--save-dir", folder, "--overwrite"]
        if "--compile" not in argv:
            argv += ["--compile", "on"]
        trainer = cli.build_from_flags(argv).trainer  # its steps: search, batches
        cfg = trainer.cfg
        torch.set_num_threads(1)
        fast = _compiled_part(trainer.model)
        if eos_bias is not None:
            with torch.no_grad():
                fast.out.bias[fast.eos_id] = eos_bias
        trainer.model.eval()
        batch = lambda: trainer.task.collate(presented(trainer.parts, next(trainer.parts.rl_batches)),  # noqa
                                             trainer.device)
        fast.enabled = False
        _timed(trainer, batch())  # warm-up of the eager side: allocator, first-call costs
        fast.enabled = True
        first = []
        for _ in range(cold):
            seconds, _ = _timed(trainer, batch(), time.perf_counter)
            first.append({"wall_s": round(seconds, 2), "graphs": fast.compiles})
        cold_compile_s = fast.compile_seconds
        times = {"eager": [], "compiled": []}
        for r in range(rounds):
            source = batch()
            for side in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
                fast.enabled = side == "compiled"
                times[side].append(_timed(trainer, source))
        out = {"flags": " ".join(train_flags), "backend": fast.backend, "failure": fast.failure, "cold": first,
               "cold_backend_compile_s": round(cold_compile_s, 2), "graphs_total": fast.compiles,
               "batch": cfg.batch_size, "beam": cfg.beam_size, "rounds": rounds}
        for side, runs in times.items():
            out[side] = {"phase_one_s": round(statistics.median(s for s, _ in runs), 4),
                         "step_ms": round(1e3 * statistics.median(s / n for s, n in runs), 3)}
        out["compiled/eager"] = round(out["compiled"]["phase_one_s"] / out["eager"]["phase_one_s"], 3)
        return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, train_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = OneLineParser(prog="python -m benchmarks.compile", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="warm rounds, each side once (default: 10)")
    p.add_argument("--cold", type=int, default=3, help="first compiled rounds reported apart (default: 3)")
    p.add_argument("--eos-bias", type=float, default=None, help="the output bias of eos (default: the model's)")
    args = p.parse_args(own)
    if args.rounds < 1 or args.cold < 1:
        p.error("--rounds and --cold: expected at least 1")
    try:
        out = measure(train_flags, args.rounds, args.cold, args.eos_bias)
    except (cli.UsageError, DataError, rewards.RewardError, tasks.TaskError) as err:
        print(f"python -m benchmarks.compile: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
