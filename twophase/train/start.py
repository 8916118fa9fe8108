"""How a command of `train.py` starts: the defaults it takes (a task's recipe and --preset, or a checkpoint's
configuration on --resume, or a checkpoint's model flags on --init-from), the checkpoint it continues or starts
from, checked against its flags, and the run directory made ready (later checkpoints set aside, logs cut back,
config.json). Bad input raises ValueError with one line; the command prints it and exits 2.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import fields

from . import resume_rules, rundir, runs
from .. import tasks
from .config import PRESETS, Config
from .evaluation import validate


def recipe_defaults(args) -> dict:
    """The defaults a run starts from, beyond the flags' own: its task's (`Task.flag_defaults`: Karel's model
    size and RL recipe, say), then --preset's. Flags given on the command line win over both."""
    try:
        factory = tasks.get(tasks.default_name(args))
    except tasks.TaskError:
        factory = None  # reported in one line when the run builds its task
    defaults = dict(getattr(factory, "flag_defaults", None) or {})
    if args.preset in PRESETS:  # an unknown one is refused by the full parser
        defaults.update(PRESETS[args.preset])
    return defaults


def start_defaults(args) -> tuple[dict, dict | None]:
    """The defaults of this command and the checkpoint it starts from: --resume / --resume-from take the
    checkpoint's resolved configuration (resume_rules), --init-from its model-shape flags over the recipe's,
    a new run the recipe's (recipe_defaults)."""
    runs.check_flags(args)
    if args.init_from and (args.resume or args.resume_from):
        raise ValueError("--init-from starts a new run from a checkpoint's model; --resume and --resume-from "
                         "continue a run: give one of them")
    known = {f.name for f in fields(Config)}
    path = runs.resume_path(args)
    if path is not None:
        state = runs.load_checkpoint(path, "--resume-from" if args.resume_from else "--resume")
        defaults = resume_rules.inherited(state["config"], known)
        if args.resume_from:
            defaults["save_dir"] = str(path.parent)  # its own run directory
        return defaults, state
    if args.init_from:
        state = runs.load_checkpoint(args.init_from, "--init-from")
        if args.eval_only:  # evaluates the checkpoint as --resume --eval-only would: its reward, metric, lengths
            return resume_rules.inherited(state["config"], known), state
        shape = runs.init_defaults(state, known)
        # the recipe of the checkpoint's task (a different --task is refused in build)
        recipe = recipe_defaults(argparse.Namespace(**{**vars(args), "task": shape.get("task", args.task)}))
        return {**recipe, **shape}, state
    return recipe_defaults(args), None


def resume_state(cfg: Config, state: dict | None = None) -> dict | None:
    """The checkpoint --resume / --resume-from continues from (`state`: already read), checked against the flags
    of this run by the declared rules (resume_rules: fixed, may grow, free)."""
    path = runs.resume_path(cfg)
    if path is None:
        return None
    flag = "--resume-from" if cfg.resume_from else "--resume"
    if cfg.resume_from and os.path.abspath(cfg.save_dir) != os.path.abspath(path.parent):
        raise ValueError(f"--resume-from {path} continues the run in {path.parent}, not in --save-dir "
                         f"{cfg.save_dir} (--init-from starts a new run from its model)")
    state = state if state is not None else runs.load_checkpoint(path, flag)
    if cfg.eval_only:  # changes nothing: only the model must be the checkpoint's
        runs.check_init(cfg, state, path, flag)
    else:
        resume_rules.check(cfg, state["config"], state, f"{flag}: {path}")
    return state


def init_state(cfg: Config, state: dict | None = None) -> dict | None:
    """--init-from: the checkpoint whose model weights this new run starts from, its model flags checked."""
    if not cfg.init_from or cfg.resume or cfg.resume_from:
        return None
    if cfg.overwrite and os.path.dirname(os.path.abspath(cfg.init_from)) == os.path.abspath(cfg.save_dir):
        raise ValueError(f"--init-from {cfg.init_from} is in --save-dir {cfg.save_dir}, whose run --overwrite "
                         "would delete: choose another --save-dir")
    state = state if state is not None else runs.load_checkpoint(cfg.init_from, "--init-from")
    runs.check_init(cfg, state, cfg.init_from)
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


def start_run_dir(trainer, state: dict | None, recipe: dict) -> None:
    """A resumed run sets aside the checkpoints of later steps (never deleted) and cuts its logs back to the
    checkpoint (one run, one log: rows of steps after it were lost with it); every run writes config.json."""
    cfg = trainer.cfg
    if state is not None:
        aside = runs.set_aside(trainer.save_dir, trainer.step)
        if aside is not None:
            print(f"note: continuing from step {trainer.step}: the checkpoints of later steps were moved to {aside} "
                  "(with a copy of metrics.jsonl); nothing was deleted", flush=True)
        for log in rundir.LOGS:
            rundir.cut_back(trainer.save_dir / log, trainer.step, trainer.compared)
    runs.write_config(trainer.save_dir, cfg, recipe, runs.resume_path(cfg) or cfg.init_from)


def evaluate(trainer) -> dict:
    """--eval-only: the checkpoint's model on the validation data (--valid-size's share) and the test data."""
    cfg = trainer.cfg
    scores = {"valid": trainer.validate()}
    if trainer.test is not None:
        scores["test"] = validate(trainer.model, trainer.task, trainer.test, trainer.reward, cfg.eval_beam,
                                  cfg.max_len, trainer.device)
    return scores
