"""`twophase.fit`: train.py as a Python call.

    import twophase
    result = twophase.fit(twophase.Config(train="train.tsv", valid="valid.tsv", rl_steps=100), reward=my_reward)
    print(result.table, result.summary["rl"]["reward"], result.run_dir)

It runs what `python train.py` runs, through the same code (`cli.resolve`, `cli.run`): the task's recipe and
--preset under the fields set, --resume and --init-from, the run directory's rules, checkpoints, validation, the
closing table (printed, as train.py prints it, and returned). What a flag would refuse raises the same one line
as an exception (a `twophase.errors.OneLineError`, most also ValueErrors: UsageError, ConfigError, TaskError,
RewardError, ...), never exits.
"""
from __future__ import annotations

import os
from dataclasses import fields

from . import cli
from ..system import distributed
from ..config import file as configfile
from .recipe import reward_specs, spec_of
from ..config import Config
from .report import Result


def fit(config: Config | str | os.PathLike | None = None, *, model=None, task=None, reward=None) -> Result:
    """Train as `python train.py` would, and return the run's `Result` (its directory, the closing table's
    numbers as `summary` and its text as `table`, the trained model, the checkpoints written).

    `config`: a `twophase.Config`, whose fields passed to its constructor count as set, whatever their value (as
    flags typed on the command line: the task's recipe and --preset set only the others; a Config made by
    `dataclasses.replace` or from a record sets every field), or the path of a .yaml/.json file, read as
    `train.py --config FILE` reads it (a run's own config.json reproduces that run). `config` is not changed.

    `reward`: a function in either reward signature, `(hypotheses, references)` (with keyword context such as
    `sources` where it declares it) or TRL's `(prompts, completions, ...)`, or a list of them, summed with
    `Config.reward_weights`. It is recorded as `module:qualname` in the run's configuration: `fit(...,
    resume=True)` with the same function continues the run, and `train.py --resume` where that name imports (a
    function of an importable module, not one defined in a notebook or `__main__`).

    `task`: a `twophase.tasks.Task` instance, in place of the one `Config.task` names; its `load_data` is
    called as a built task's. It is recorded as `Config.task`, or where that is None as `module:Class`, which
    `train.py --resume` and `twophase-decode` can rebuild only where that class takes the Config, as a task
    factory does; `fit` with the same instance (or an equal one) resumes always.

    `model`: any `twophase.SequenceModel` for the task's ids (its vocabularies: build it after the task's data,
    as `Task.build_model` does), in place of `task.build_model()`. Checkpoints save its parameters, so `fit(...,
    model=a_fresh_copy, resume=True)` continues the run; `train.py --resume`, `--init-from` and `twophase-decode`
    rebuild the task's own model and can read such a run only where `build_model` builds this architecture.
    Not with `fsdp` (sharding rebuilds the model from the task).
    """
    cfg, start, given = resolved(config, model=model, task=task, reward=reward)
    try:
        return cli.run(cfg, start, given, model=model, task=task, reward=reward)
    finally:
        distributed.finish()


def resolved(config: Config | str | os.PathLike | None = None, *, model=None, task=None, reward=None):
    """What `fit` resolves its arguments into, before anything is built (`cli.resolve`'s): the run's Config, the
    checkpoint it starts from (resume=True, init_from) and the fields given."""
    if config is None:
        config = Config()
    if isinstance(config, (str, os.PathLike)):
        argv, settings, named = ["--config", os.fspath(config)], {}, configfile.read(config)
    elif isinstance(config, Config):
        argv, settings = [], explicit(config)
        named = settings
    else:
        raise TypeError(f"fit(config): expected a twophase.Config or the path of a .yaml/.json file, got "
                        f"{type(config).__name__}")
    if reward is not None:
        spec = ",".join(reward_specs(reward))
        if named.get("reward") not in (None, spec):
            raise cli.UsageError(f"reward={spec} and Config.reward {named['reward']} name two rewards: give one")
        settings["reward"] = spec
    recipe = None
    if task is not None:
        settings["task"] = named.get("task") or spec_of(task)
        own = dict(getattr(task, "flag_defaults", None) or {})  # its recipe, whether tasks.get finds it or not
        unknown = sorted(set(own) - set(configfile.FIELDS))
        if unknown:
            raise cli.UsageError(f"--task {settings['task']}: its flag_defaults name no flag: {', '.join(unknown)}")
        recipe = {name: configfile.check_value(name, value, f"{type(task).__name__}.flag_defaults: {name}")
                  for name, value in own.items()}
    if model is not None and named.get("fsdp"):
        raise cli.UsageError("fit(model=...) with fsdp: sharding rebuilds the model from the task "
                             "(Task.build_model); give the task a build_model instead")
    return cli.resolve(argv, settings, recipe)


def explicit(config: Config) -> dict:
    """The fields passed to `config`'s constructor (`Config.given`), whatever their value: each is the user's
    and wins over the task's recipe and --preset, as a flag typed on the command line does."""
    return {name: getattr(config, name) for name in (f.name for f in fields(config)) if name in config.given()}
