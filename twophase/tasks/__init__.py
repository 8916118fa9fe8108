"""Tasks: data, how a batch becomes a model's source, the model, the default reward and the metrics.

`get(name)` resolves `--task NAME` like rewards: `package.module:callable` (the working directory is searched
too), then the entry-point group `twophase.tasks`, then the built-ins. The callable takes the task's settings (the
training Config's data, model, karel, countdown and lora sections and max_len: `twophase.config.TaskConfig`) and
returns a `Task` (see `twophase.tasks.base`); adding a task changes nothing in the trainer.
"""
from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from ..config import SHAPING_FLAGS
from ..config.documented import _flag
from ..plugins import PluginError, brief, load_spec
from .base import Example, Metric, Task, TaskError

GROUP = "twophase.tasks"
BUILTINS = {"g2p": "twophase.tasks.text:G2P", "tsv": "twophase.tasks.text:TSV",
            "karel": "twophase.tasks.karel.task:Karel", "countdown": "twophase.tasks.countdown.task:Countdown"}
REQUIRED = ("load_data", "state_dict", "load_state_dict", "build_model", "collate", "target_ids", "detokenize",
            "metric_sums", "scores", "parse_source", "format_output")

__all__ = ["Example", "Metric", "Task", "TaskError", "get", "factory_of", "build", "available", "default_name"]


def available() -> list[str]:
    return sorted({ep.name for ep in metadata.entry_points(group=GROUP)} | set(BUILTINS))


def default_name(cfg) -> str:
    """--task when not given: the TSV files of --train, else the built-in Countdown (where RL beats equal-time MLE;
    docs/countdown.md)."""
    return cfg.task or ("tsv" if cfg.train is not None else "countdown")


def get(name: str) -> Callable[[Any], Task]:
    """The task factory `name` names (a `module:callable` spec, an entry point or a built-in)."""
    try:
        if ":" in name:
            return load_spec(name, "task")
        for ep in metadata.entry_points(group=GROUP):
            if ep.name == name:
                try:
                    return ep.load()
                except Exception as exc:
                    raise TaskError(f"task '{name}': cannot load entry point '{ep.value}' ({brief(exc)})") from exc
        if name in BUILTINS:
            return load_spec(BUILTINS[name], "task")
    except PluginError as err:
        raise TaskError(str(err)) from None
    raise TaskError(f"unknown task '{name}'; available: {', '.join(available())}, or package.module:callable")


def factory_of(cfg, name: str | None = None) -> Callable[[Any], Task]:
    """What `build` calls to make the task of this configuration (`name`: else the task `cfg` names); TaskError
    where no task has that name."""
    factory = get(name or default_name(cfg))
    if getattr(cfg, "hf_model", None) is not None:  # --hf-model: the Hugging Face model's TSV task, imported
        from .text import TSV                     # only then (the rest runs without transformers)
        if factory is TSV:
            from .hf import HFTSV
            factory = HFTSV
    return factory


def build(cfg, name: str | None = None) -> Task:
    """The task of this configuration, constructed (cheap) but with no data loaded yet."""
    name = name or default_name(cfg)
    factory = factory_of(cfg, name)
    if not callable(factory):
        raise TaskError(f"task '{name}': {type(factory).__name__} object is not callable")
    try:  # a task reads its own settings (the training Config's data and model sections: `Config.for_task`)
        task = factory(cfg.for_task() if callable(getattr(cfg, "for_task", None)) else cfg)
    except TaskError:
        raise
    except Exception as exc:
        raise TaskError(f"task '{name}' raised {brief(exc)}") from exc
    missing = [m for m in REQUIRED if not callable(getattr(task, m, None))]
    if missing:
        raise TaskError(f"task '{name}' returned a {type(task).__name__} without {', '.join(missing)} "
                        "(subclass twophase.tasks.Task)")
    task.spec = name  # how to find it again: checkpoints store it, decoding and --resume rebuild it
    task.origin = origin(name)
    return task


def adopt(task, spec: str) -> Task:
    """A `Task` instance a user gives (`twophase.fit(task=...)`) as the run's task, found again by `spec` (its
    Config.task); TaskError where it lacks a method a task must have."""
    missing = [m for m in REQUIRED if not callable(getattr(task, m, None))]
    if missing:
        raise TaskError(f"task {type(task).__name__} (given to fit) has no {', '.join(missing)} "
                        "(subclass twophase.tasks.Task)")
    task.spec = spec
    task.origin = origin(spec)
    return task


def check_flags(task, given: frozenset[str]) -> None:
    """Refuse a shaping flag the task does not read (`Task.flags`; those in its `flag_defaults` count as read):
    TaskError, one line."""
    reads = set(getattr(task, "flags", ())) | set(getattr(task, "flag_defaults", None) or {})
    ignored = sorted((given & SHAPING_FLAGS) - reads)
    if ignored:
        names = ", ".join(_flag(n) for n in ignored)
        read = ", ".join(_flag(n) for n in sorted(reads & SHAPING_FLAGS)) or "none of them"
        raise TaskError(f"{names}: task '{task.spec}' does not read {'this flag' if len(ignored) == 1 else 'these'} "
                        f"(it reads {read}; a task declares the data and model flags it reads in Task.flags)")


def origin(name: str) -> str | None:
    """The folder a `module:callable` task's module was imported from (what sys.path needs to import it again,
    from any directory); None for built-ins and entry points."""
    module = sys.modules.get(name.partition(":")[0]) if ":" in name else None
    path = getattr(module, "__file__", None)
    if path is None:
        return None
    root = Path(path).resolve().parent
    for _ in name.partition(":")[0].split(".")[1:]:  # a package's module: its top package's parent
        root = root.parent
    return str(root)
