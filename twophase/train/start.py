"""How a command of `train.py` starts: the defaults it takes (a task's recipe and --preset, or a checkpoint's
configuration on --resume, or a checkpoint's model flags on --init-from), the checkpoint it continues or starts
from, checked against its flags, the checks that need the task (and its model) built (the data and model flags it
does not read, the phases a task without references cannot run, a reward comparing with references on rows
without one, the model against the protocol on one batch), and the run directory made ready (later checkpoints
set aside, logs cut back, config.json). Bad input raises StartupError (a OneLineError) with one line; the command
prints it and exits 2.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import fields

import torch

from ..system import distributed
from . import rundir, resume
from .. import tasks
from ..config import PRESETS, SHAPING_FLAGS, Config
from ..config import rules as configrules
from ..config.rules import _flag
from .evaluation import validate
from ..errors import OneLineError
from ..modelcheck import check_model
from ..rewards import needs_references
from ..samples import Samples
from ..vocab import pad_targets


class StartupError(OneLineError, ValueError):
    """A flag or a task that cannot make this run; one line."""


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


def check_references(cfg: Config, task, given: frozenset[str]) -> bool:
    """A task whose training examples have no references (a verifier's reward reads the source) trains RL
    only: MLE steps, --mle-weight and an explicit --compare-mle are refused. Whether the MLE control runs: the
    default comparison is off there (the Config is left as it is; the run records the control it ran)."""
    if any(ex.references for ex in task.train):
        return cfg.compare_mle
    where = f"task '{task.spec}' has no references to train MLE on"
    if cfg.mle_steps > 0:
        default = "" if "mle_steps" in given else " (the default)"
        raise StartupError(f"--mle-steps {cfg.mle_steps}{default}: {where}; train RL only with --mle-steps 0")
    if cfg.mle_weight > 0:
        raise StartupError(f"--mle-weight {cfg.mle_weight:g}: {where}; leave it at 0")
    if cfg.compare_mle and cfg.rl_steps > 0:
        if "compare_mle" in given:
            raise StartupError(f"--compare-mle: {where}, so there is no MLE to continue; drop the flag")
        if distributed.rank() == 0:  # the default control needs references: off, as --no-compare-mle
            print("note: --compare-mle cannot run: the training data has no references to continue MLE on; "
                  "skipped", flush=True)
        return False
    return cfg.compare_mle


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


def task_recipe(args) -> dict:
    """The defaults of the task `args` names (`Task.flag_defaults`: Karel's model size and RL recipe, say); {}
    where it names none or no task (reported in one line when the run builds its task)."""
    try:
        factory = tasks.get(tasks.default_name(args))
    except tasks.TaskError:
        return {}
    return dict(getattr(factory, "flag_defaults", None) or {})


def recipe_defaults(args, recipe: dict | None = None) -> dict:
    """The defaults a run starts from, beyond the flags' own: its task's (`recipe`: a task object's own, else
    `task_recipe`), then --preset's. Values set anywhere (flags, a file, fit's Config) win over both."""
    defaults = task_recipe(args) if recipe is None else dict(recipe)
    if args.preset in PRESETS:  # an unknown one is refused with the Config's choices
        defaults.update(PRESETS[args.preset])
    return defaults


def start_defaults(args, recipe: dict | None = None) -> tuple[dict, dict | None]:
    """The defaults of this command and the checkpoint it starts from: --resume / --resume-from take the
    checkpoint's resolved configuration (config.rules), --init-from its model-shape flags over the recipe's,
    a new run the recipe's (recipe_defaults; `recipe`: a task object's own)."""
    resume.check_flags(args)
    if args.init_from and (args.resume or args.resume_from):
        raise StartupError("--init-from starts a new run from a checkpoint's model; --resume and --resume-from "
                           "continue a run: give one of them")
    known = {f.name for f in fields(Config)}
    path = resume.resume_path(args)
    if path is not None:
        state = resume.load_checkpoint(path, "--resume-from" if args.resume_from else "--resume")
        defaults = configrules.inherited(state["config"], known)
        if args.resume_from:
            defaults["save_dir"] = str(path.parent)  # its own run directory
        return defaults, state
    if args.init_from:
        state = resume.load_checkpoint(args.init_from, "--init-from")
        if args.eval_only:  # evaluates the checkpoint as --resume --eval-only would: its reward, metric, lengths
            return configrules.inherited(state["config"], known), state
        shape = resume.init_defaults(state, known)
        # the recipe of the checkpoint's task (a different --task is refused in build)
        named = argparse.Namespace(**{**vars(args), "task": shape.get("task", args.task)})
        return {**recipe_defaults(named, recipe), **shape}, state
    return recipe_defaults(args, recipe), None


def resume_state(cfg: Config, state: dict | None = None) -> dict | None:
    """The checkpoint --resume / --resume-from continues from (`state`: already read), checked against the flags
    of this run by the declared rules (configrules: fixed, may grow, free)."""
    path = resume.resume_path(cfg)
    if path is None:
        return None
    flag = "--resume-from" if cfg.resume_from else "--resume"
    if cfg.resume_from and os.path.abspath(cfg.save_dir) != os.path.abspath(path.parent):
        raise StartupError(f"--resume-from {path} continues the run in {path.parent}, not in --save-dir "
                           f"{cfg.save_dir} (--init-from starts a new run from its model)")
    state = state if state is not None else resume.load_checkpoint(path, flag)
    if cfg.eval_only:  # changes nothing: only the model must be the checkpoint's
        resume.check_init(cfg, state, path, flag)
    else:
        configrules.check(cfg, state["config"], state, f"{flag}: {path}")
    return state


def init_state(cfg: Config, state: dict | None = None) -> dict | None:
    """--init-from: the checkpoint whose model weights this new run starts from, its model flags checked."""
    if not cfg.init_from or cfg.resume or cfg.resume_from:
        return None
    if cfg.overwrite and os.path.dirname(os.path.abspath(cfg.init_from)) == os.path.abspath(cfg.save_dir):
        raise StartupError(f"--init-from {cfg.init_from} is in --save-dir {cfg.save_dir}, whose run --overwrite "
                           "would delete: choose another --save-dir")
    state = state if state is not None else resume.load_checkpoint(cfg.init_from, "--init-from")
    resume.check_init(cfg, state, cfg.init_from)
    return state


def batch_warnings(cfg, sources: int, pairs: int, given: frozenset) -> list[str]:
    """A batch size given on the command line that the training data cannot fill: each step then takes all of
    it, fewer than asked (one line each; the recipe's and the defaults' sizes are capped without a word)."""
    out = []
    for name, phase, steps, n, what in (("batch_size", "RL", cfg.rl_steps, sources, "sources"),
                                         ("mle_batch_size", "MLE", cfg.mle_steps, pairs, "(source, reference) pairs")):
        size = getattr(cfg, name)
        if name in given and steps > 0 and 0 < n < size:
            out.append(f"--{name.replace('_', '-')} {size}: the training data has {n} {what}, so each {phase} "
                       f"step takes all {n}")
    return out


def refuse_against_checkpoint(cfg, start: dict | None) -> None:
    """For flags that do not combine: the ValueError of a flag that differs from the checkpoint --resume
    continues or --init-from starts from, which is what went wrong (--resume --hf-model on an LSTM run inherits
    the run's --embed-dim, which --hf-model refuses; the flag at fault is --hf-model); nothing where none does."""
    if start is not None:
        resume_state(cfg, start)
        init_state(cfg, start)


def start_run_dir(training, state: dict | None, recipe: dict) -> None:
    """A resumed run sets aside the checkpoints of later steps (never deleted) and cuts its logs back to the
    checkpoint (one run, one log: rows of steps after it were lost with it); every run writes config.json."""
    cfg = training.trainer.cfg
    path = resume.resume_path(cfg)
    if cfg.resume and path is not None and path.name != "checkpoint_last.pt":
        print(f"note: {path.name} (step {training.state.step}) is newer than checkpoint_last.pt, whose write was cut "
              f"short: continuing from it", flush=True)
    if state is not None:
        aside = rundir.set_aside(training.save_dir, training.state.step)
        if aside is not None:
            print(f"note: continuing from step {training.state.step}: the checkpoints of later steps were moved to "
                  f"{aside} "
                  "(with a copy of metrics.jsonl); nothing was deleted", flush=True)
        for log in rundir.LOGS:
            rundir.cut_back(training.save_dir / log, training.state.step, training.state.compared)
    rundir.write_config(training.save_dir, cfg, recipe, path or cfg.init_from)


def evaluate(training) -> dict:
    """--eval-only: the checkpoint's model on the validation data (--valid-size's share) and the test data."""
    t = training.trainer
    scores = {"valid": training.validate()}
    if t.task.test:
        scores["test"] = validate(t.model, t.task, t.task.test, t.reward, t.cfg.eval_beam, t.cfg.max_len, t.device)
    return scores
