"""The parts of a run a user hands to `twophase.fit` as Python objects instead of naming them by flag: a reward
function, a `Task` instance. Each is checked as the plug-in its flag would load (`rewards.validated`, the task's
required methods) and recorded in the configuration under the name that finds it again (`module:qualname`), so
checkpoints, config.json and the resume rules see the same run as train.py would.
"""
from __future__ import annotations

import math

from .. import rewards, rewardsum, tasks


def spec_of(obj) -> str:
    """`module:qualname` of a function or of an object's class: what --reward / --task would load it by (a
    function defined in a script or notebook is `__main__:name`, found again only from that program)."""
    target = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', None) or '__main__'}:{target.__qualname__}"


def reward_specs(reward) -> list[str]:
    """The names a reward function (or a list of them, summed) is recorded by in Config.reward."""
    return [spec_of(fn) for fn in (reward if isinstance(reward, (list, tuple)) else [reward])]


def reward_of(reward, spec: str, weights: str | None):
    """A callable in either reward signature (`(hypotheses, references, **context)`, or TRL's `(prompts,
    completions, ...)`), or a list of them summed with --reward-weights, validated as a plug-in of that name:
    a RewardError (one line) names it where it fails."""
    fns = list(reward) if isinstance(reward, (list, tuple)) else [reward]
    names = [s.strip() for s in spec.split(",")]
    for fn in fns:
        if not callable(fn):
            raise rewards.RewardError(f"reward {fn!r}: {type(fn).__name__} object is not callable")
    if len(names) != len(fns):
        raise rewards.RewardError(f"reward: {len(fns)} functions recorded as {len(names)} names ({spec})")
    checked = [rewards.validated(fn, name) for fn, name in zip(fns, names)]
    if weights is None and len(checked) == 1:
        return checked[0]
    values = [1.0] * len(checked)
    if weights is not None:
        try:
            values = [float(w) for w in weights.split(",")]
        except ValueError:
            raise rewards.RewardError(f"reward_weights {weights}: expected comma-separated numbers") from None
        if len(values) != len(checked) or not all(math.isfinite(w) for w in values):
            raise rewards.RewardError(f"reward_weights {weights}: expected {len(checked)} finite numbers, one per "
                                      "reward function")
    return rewardsum.WeightedSum(checked, values, rewardsum.display_names(names, checked))


def adopt_task(task, spec: str):
    """A `Task` instance as the run's task, found again by `spec` (its Config.task); TaskError where it lacks a
    method a task must have."""
    missing = [m for m in tasks.REQUIRED if not callable(getattr(task, m, None))]
    if missing:
        raise tasks.TaskError(f"task {type(task).__name__} (given to fit) has no {', '.join(missing)} "
                              "(subclass twophase.tasks.Task)")
    task.spec = spec
    task.origin = tasks.origin(spec)
    return task
