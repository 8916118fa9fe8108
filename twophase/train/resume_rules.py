"""Which flags a resumed run may change: one declared table (docs/runs.md prints it).

`--resume` (and `--resume-from FILE`) takes the checkpoint's resolved configuration as its defaults, so a
forgotten flag is the run's own value. A flag given that would change what the run means (its data, task, model,
objective, sampler, K, reward, metric, seed, the length of a phase already passed) is refused in one line naming
the flag and both values; only flags that extend or observe the run may change. Each field declares its rule
(`arg(resume=...)` in `sections`); one that declares none is FIXED: a flag added later is safe by default, and
becomes free only by being declared so.
"""
from __future__ import annotations

import os
from dataclasses import fields

from .config import Config
from .sections import FIXED, FREE, GROW, PHASE  # noqa: F401 (the rules' names)

# Declared on each field (`arg(resume=...)`); a field that declares nothing is FIXED.
RULES = {f.name: f.metadata["resume"] for f in fields(Config) if f.metadata["resume"] != FIXED}
# this command's own: where and how this process computes (--compile with --fsdp is refused, so a --compile
# inherited from an earlier command would refuse every later --resume --fsdp)
NOT_INHERITED = tuple(f.name for f in fields(Config) if not f.metadata["inherited"])
PATHS = tuple(f.name for f in fields(Config) if f.metadata["path"])  # compared as files, not strings


def rule(name: str) -> str:
    return RULES.get(name, FIXED)


def inherited(saved: dict, known) -> dict:
    """The defaults a resumed run takes from its checkpoint's configuration (fields this version knows)."""
    return {k: v for k, v in saved.items() if k in known and k not in NOT_INHERITED}


def same(name: str, a, b) -> bool:
    if name in PATHS and isinstance(a, str) and isinstance(b, str):
        return a == b or os.path.abspath(a) == os.path.abspath(b)
    return a == b


def show(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "(not set)"
    return f"{value:g}" if isinstance(value, float) else str(value)


def check(cfg, saved: dict, state: dict, path) -> None:
    """Raise ValueError (one line) for the first field of `cfg` that its rule forbids to differ from `saved`.
    `state`: the checkpoint (its step, the end of its MLE phase and whether the schedule ended it)."""
    step, mle_end = int(state.get("step", 0)), int(state.get("mle_end", saved.get("mle_steps", 0)))
    mle_stopped = bool(state.get("schedule", {}).get("stopped", False))
    for f in fields(cfg):
        name = f.name
        if name not in saved:  # a flag newer than the checkpoint: its default, nothing to compare
            continue
        old, new = saved[name], getattr(cfg, name)
        kind = rule(name)
        if kind == FREE or same(name, old, new):
            continue
        flag = "--" + name.replace("_", "-")
        why = None
        if kind == FIXED:
            why = "it would change what the run means; start a new run (another --save-dir, or --init-from)"
        elif kind == GROW and new < old:
            why = f"{flag} may only grow on resume"
        elif kind == PHASE and (step > mle_end or mle_stopped):
            why = (f"the MLE phase ended at step {mle_end}" + (" (--lr-decay's schedule ended it)" if mle_stopped
                   else "") + "; a run never returns to a finished phase")
        elif kind == PHASE and new < step:
            why = f"the checkpoint has taken {step} MLE steps already"
        if why is not None:
            raise ValueError(f"{path} was trained with {flag} {show(old)}, not {show(new)}: {why}")
