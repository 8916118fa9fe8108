"""One side of `python -m tools.beforeafter`: one job's training step, timed one step per request, with
whatever `twophase` is on the path (the checkout under test, which may predate this file).

The driver runs it as `python -c SOURCE JOB_JSON` in the checkout's folder. Once the job is built it prints
one line {"ready": ...}; then each input line "step" runs one step and answers one JSON line: the step's process
CPU seconds (`cpu_s`), wall seconds (`wall_s`), the CPU seconds of its parts (`parts`) and, for a trainer's step,
its candidates' mean reward (`reward_mean`: the two checkouts' should agree where they do the same work). End of
input stops it.

Jobs (JOB_JSON's "kind"):
    rl   a `train.py` run's RL step (`Run.train_step("rl")`) built from "flags" as the command would
         (the task's recipe under them; "flags_if_known": [flag, value] pairs given only where the checkout's
         command has the flag), optionally with a checkpoint's model weights ("checkpoint"), EOS's
         output bias set ("eos_bias": every candidate runs to --max-len, as benchmarks.karel) and each reward
         offset by a random [0, 1e-3) ("untie": see benchmarks.karel); parts: phase one, rewards and update
         (clipping and the optimizer step) by the trainer's own sections (`Trainer.section`), phase two
         (`Trainer.phase_two`), or, where the steps run on `train.steps.parts`, what the parts' sections report to
         (their profiler, or before that their timer hook), the same sections and phase two; in a checkout
         from before `Run`, the trainer is what cli.build returns
    hf   `benchmarks.hf`'s two-phase step on its model "model" (t5, causal) at its default sizes; parts:
         phase one (`sample`), phase two (the step's `phase2_cpu`)
The parts are timed by wrapping those functions from outside, so that a checkout without the parts' hook
(`benchmarks.steptimes`) is timed the same way as one with it. Only what both
checkouts compared have is used, hence benchmarks.karel's tie-breaking written again here.
"""
import contextlib
import json
import sys
import tempfile
import time

import torch


def timed(fn, parts: dict, part: str):
    """fn, its CPU seconds added to parts[part] at each call."""
    def run(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[part] = parts.get(part, 0.0) + time.process_time() - start
    return run


# The trainer's --profile-memory sections (the same names in both checkouts) that make up each part.
SECTION_PARTS = {"phase 1": "phase one", "rewards": "rewards", "references": "references",
                 "gradient all-reduce": "update", "optimizer step": "update"}


def sectioned(section, parts: dict):
    """Trainer.section, the CPU seconds of each section added to parts[its part] (see SECTION_PARTS)."""
    def run(name, *args):
        inner = section(name, *args)
        part = next((p for prefix, p in SECTION_PARTS.items() if name.startswith(prefix)), None)
        return inner if part is None else _timed_section(inner, parts, part)
    return run


@contextlib.contextmanager
def _timed_section(inner, parts: dict, part: str):
    start = time.process_time()
    try:
        with inner:
            yield
    finally:
        parts[part] = parts.get(part, 0.0) + time.process_time() - start


def untied(rewards_of, seed: int = 0):
    draws = torch.Generator().manual_seed(seed)

    def offset(tokens, owner, examples):
        rewards = rewards_of(tokens, owner, examples)  # (N,)
        return rewards + 1e-3 * torch.rand(len(rewards), generator=draws, dtype=rewards.dtype).to(rewards.device)
    return offset


class UntiedReward:
    """untied's offsets on a reward itself (its values, in the order rewards_of draws them)."""

    def __init__(self, reward, seed: int = 0):
        self.reward, self.draws = reward, torch.Generator().manual_seed(seed)

    def __call__(self, hypotheses, references, **context):
        values = self.reward(hypotheses, references, **context)
        offsets = torch.rand(len(values), generator=self.draws, dtype=torch.float64).tolist()
        return [v + 1e-3 * o for v, o in zip(values, offsets)]

    def __getattr__(self, name):
        return getattr(self.reward, name)


def rl_job(job: dict, parts: dict):
    """The step function of an `rl` job (see the module docstring)."""
    from twophase.train import cli
    parser = cli.build_parser()
    known = {flag for action in parser._actions for flag in action.option_strings}
    optional = [x for flag, value in job.get("flags_if_known", []) if flag in known for x in (flag, value)]
    argv = [*job["flags"], *optional, "--save-dir", tempfile.mkdtemp(prefix="beforeafter-"), "--overwrite"]
    try:  # a checkout with the run's set-up in recipe.py; an older one built it in cli.build
        from twophase.train import recipe, startpoint
        setup, recipe_defaults = recipe.setup, startpoint.recipe_defaults
    except ImportError:
        setup, recipe_defaults = cli.build, cli.recipe_defaults
    parser.set_defaults(**recipe_defaults(parser.parse_args(argv)))
    run = setup(cli.config_from_args(parser.parse_args(argv)))
    trainer = getattr(run, "trainer", run)  # the steps: a run's trainer (a checkout before runs: the trainer)
    inner = getattr(trainer.model, "model", trainer.model)  # under a grammar: the constrained model
    if job.get("checkpoint"):
        inner.load_state_dict(torch.load(job["checkpoint"], map_location="cpu", weights_only=False)["model"])
    if job.get("eos_bias") is not None:
        with torch.no_grad():
            inner.out.bias[inner.eos_id] = job["eos_bias"]
    if not hasattr(trainer, "parts"):  # a checkout whose trainer's methods are its steps' parts
        if job.get("untie"):
            trainer.rewards_of = untied(trainer.rewards_of)
        trainer.section = sectioned(trainer.section, parts)
        trainer.phase_two = timed(trainer.phase_two, parts, "phase two")
        return lambda: run.train_step("rl"), trainer.model
    # The steps' parts (train.steps.parts): what their sections report to (their profiler; a checkout from before
    # that: their timer hook), the same sections and phase two
    if job.get("untie"):
        trainer.parts.reward = UntiedReward(trainer.parts.reward)
    if hasattr(trainer.parts, "timer"):
        trainer.parts.timer = lambda part: _timed_section(contextlib.nullcontext(), parts, part)
    else:
        trainer.parts.profiler = PartTimer(parts)
    return lambda: run.train_step("rl"), trainer.model


class PartTimer:
    """The steps' profiler (`Parts.profiler`): each section that names a part of the step adds its CPU seconds to
    parts[part]."""

    def __init__(self, parts: dict):
        self.parts = parts

    def section(self, name, part=None):
        return contextlib.nullcontext() if part is None else _timed_section(contextlib.nullcontext(), self.parts, part)


def hf_job(job: dict, parts: dict):
    """The step function of an `hf` job: benchmarks.hf's two-phase step (sampling, coefficients, phase two)."""
    try:
        from benchmarks import hf
    except ImportError:  # a checkout from before the benchmarks left the package
        from twophase.bench import hf
    cell = dict(hf.DEFAULTS, model=job["model"], method="two-phase")
    torch.set_num_threads(cell["threads"])
    wrapper, source = hf.build(cell)
    hf.sample = timed(hf.sample, parts, "phase one")  # the search train_step calls

    def step():
        parts["phase two"] = hf.train_step(cell, wrapper, source)["phase2_cpu"]
    return step, wrapper


def main(job: dict) -> None:
    torch.set_num_threads(job.get("threads", 1))
    parts: dict = {}
    step, model = {"rl": rl_job, "hf": hf_job}[job["kind"]](job, parts)
    print(json.dumps({"ready": job, "parameters": sum(p.numel() for p in model.parameters())}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        parts.clear()
        cpu, wall = time.process_time(), time.perf_counter()
        row = step() or {}
        print(json.dumps({"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
                          "parts": dict(parts), "reward_mean": row.get("reward_mean")}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
