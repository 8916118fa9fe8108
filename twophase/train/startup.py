"""Start-up checks of `train.py` that need the task (and its model) built: the flags the user gave that the task
does not read, the phases a task without references cannot run, a reward comparing with references on rows
without one, and the model against the protocol on one
batch (`twophase.check_model`). Each failure is one line (StartupError or ModelError), before any step is taken.
"""
from __future__ import annotations

import argparse
from dataclasses import fields

import torch

from . import distributed
from .config import SHAPING_FLAGS, Config
from .config_rules import _flag
from ..modelcheck import check_model
from ..rewards import needs_references
from ..samples import Samples
from ..vocab import pad_targets


class StartupError(ValueError):
    """A flag or a task that cannot make this run; one line."""


def flags_given(parser: argparse.ArgumentParser, argv: list[str] | None) -> frozenset[str]:
    """The Config fields set on the command line (not by a default, the task's recipe or a preset). `parser`: a
    fresh one of the same flags, whose defaults this replaces with a marker no flag can produce."""
    unset = object()
    parser.set_defaults(**{f.name: unset for f in fields(Config)})
    return frozenset(k for k, v in vars(parser.parse_args(argv)).items() if v is not unset)


def changed_fields(cfg: Config) -> frozenset[str]:
    """Without a command line (a Config built in Python): the fields that differ from their defaults."""
    return frozenset(f.name for f in fields(cfg) if getattr(cfg, f.name) != f.default)


def check_task_flags(task, given: frozenset[str]) -> None:
    """Refuse a shaping flag the task does not read (`Task.flags`; those in its `flag_defaults` count as read)."""
    reads = set(getattr(task, "flags", ())) | set(getattr(task, "flag_defaults", None) or {})
    ignored = sorted((given & SHAPING_FLAGS) - reads)
    if ignored:
        names = ", ".join(_flag(n) for n in ignored)
        read = ", ".join(_flag(n) for n in sorted(reads & SHAPING_FLAGS)) or "none of them"
        raise StartupError(f"{names}: task '{task.spec}' does not read {'this flag' if len(ignored) == 1 else 'these'} "
                           f"(it reads {read}; a task declares the data and model flags it reads in Task.flags)")


def check_references(cfg: Config, task, given: frozenset[str]) -> None:
    """A task whose training examples have no references (a verifier's reward reads the source) trains RL
    only: MLE steps, --mle-weight and an explicit --compare-mle are refused; the default comparison is off."""
    if any(ex.references for ex in task.train):
        return
    where = f"task '{task.spec}' has no references to train MLE on (its reward reads the sources)"
    if cfg.mle_steps > 0:
        raise StartupError(f"--mle-steps {cfg.mle_steps}: {where}; train RL only with --mle-steps 0")
    if cfg.mle_weight > 0:
        raise StartupError(f"--mle-weight {cfg.mle_weight:g}: {where}; leave it at 0")
    if cfg.compare_mle and cfg.rl_steps > 0:
        if "compare_mle" in given:
            raise StartupError(f"--compare-mle: {where}, so there is no MLE to continue; drop the flag")
        cfg.compare_mle = False  # the default control needs references: off, as --no-compare-mle
        if distributed.rank() == 0:
            print("note: --compare-mle cannot run: the training data has no references to continue MLE on; "
                  "skipped", flush=True)


def check_reward_references(cfg: Config, reward, task, given: frozenset[str]) -> None:
    """Refuse, before any step, a reward that compares with references (`rewards.needs_references`: the
    built-ins) on rows that have none: with no reference anywhere in --train it would score nothing (--reward
    forgotten: the task's default `edit`); a row without one in --train, --valid or --test would never be scored,
    so the first is named (FILE:LINE). Several rewards (--reward a,b): a row needs a reference only where every
    one of them needs references (the others score it; those that need them give it None, as TRL's rewards do for
    rows they do not apply to), but one that needs references on a --train without any would never score."""
    parts = list(zip(getattr(reward, "names", [cfg.reward]), getattr(reward, "rewards", [reward])))
    needing = [name for name, fn in parts if needs_references(fn)]
    if not needing:
        return
    default = "reward" not in given and cfg.reward == getattr(task, "default_reward", None)
    spec = f"--reward {cfg.reward}" + (" (the task's default)" if default else "")
    compares = f"{', '.join(needing)} compare{'s' if len(needing) == 1 else ''} candidates with references"
    if not any(ex.references for ex in task.train):
        if len(needing) < len(parts):
            raise StartupError(f"{spec}: {compares}, and --train {cfg.train} has none: "
                               f"{'it' if len(needing) == 1 else 'they'} would never score; leave "
                               f"{'it' if len(needing) == 1 else 'them'} out")
        raise StartupError(f"{spec}: {compares}, and --train {cfg.train} has none (no completion/target): "
                           f"{'--reward is needed' if default else 'give --reward'}, one that scores without "
                           "references (module:callable, e.g. a function in TRL's signature: docs/trl.md)")
    if len(needing) < len(parts):
        return
    located = getattr(task, "unreferenced", None) or {}
    for flag, examples in (("--train", task.train), ("--valid", task.valid), ("--test", getattr(task, "test", []))):
        count = sum(not ex.references for ex in examples or [])
        if not count:
            continue
        where, _, total = located.get(flag) or (
            f"{flag}: example {next(i for i, ex in enumerate(examples) if not ex.references) + 1}", count,
            len(examples))
        raise StartupError(f"{where}: no reference (completion/target), which {spec} compares candidates with "
                           f"({count} of {total} rows of {flag} have none): give every row one, or add a "
                           "--reward that scores without references")


def check_model_on_a_batch(task, model, device) -> None:
    """`twophase.check_model` on the first two training sources (and their references, where they have some):
    ModelError naming every broken rule."""
    examples = task.train[:2]
    ids = [(b, row) for b, ex in enumerate(examples) for row in task.target_ids(ex)]
    targets = None
    if ids:
        tgt = pad_targets([row for _, row in ids], device, model.pad_id, model.eos_id)  # (R, T)
        owner = torch.tensor([b for b, _ in ids], dtype=torch.long, device=device)
        targets = Samples.of_targets(tgt, owner, model.pad_id, model.eos_id)
    check_model(model, task.collate(examples, device), targets)
