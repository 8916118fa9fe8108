"""Where a command starts from, and what that fixes.

A new run starts from its task's recipe and --preset. --resume and --resume-from continue a checkpoint's run and
take its whole configuration; --init-from starts a new run from a checkpoint's model and takes the flags that
shape that model; --eval-only evaluates either. Once the checkpoint is read (`read`: a `Start`), what it fixes
for the command is answered here as pure functions of (Config, Start):

    defaults(cfg, start, recipe)  the values beneath the flags given: the checkpoint's, or the recipe's
    check(cfg, start)             the first flag the checkpoint forbids to differ, as a one-line ResumeError
    continued(cfg, start)         the checkpoint the run continues (--resume, --resume-from), or None
    initial(cfg, start)           the checkpoint whose model a new run starts from (--init-from), or None

and what --ref-checkpoint's model must share with the run's (`check_reference`).

The per-field rules a resumed run follows (fixed, may grow, free) are declared with the fields
(`config.rules`); the model-shape flags --init-from fixes are `MODEL_SHAPE`.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from .. import tasks
from ..config import PRESETS, Config
from ..config import rules as configrules
from ..config.rules import same, show
from .resume import ResumeError, load_checkpoint, misfit, resume_path

# Flags that give the model its shape and ids: --init-from takes them from the checkpoint and refuses others.
# LoRA's rank, scale and modules too: a --lora-r checkpoint holds the adapters alone, which only continue on
# adapters of the same shape over the same base (new adapters start from a merged export: LORA_HINT).
LORA_SHAPE = ("lora_r", "lora_alpha", "lora_target_modules")
MODEL_SHAPE = ("task", "hf_model", "embed_dim", "hidden_size", "bidirectional", "char_source", "char_target",
               "lowercase_source") + LORA_SHAPE
LORA_HINT = ("; to train new adapters (or every parameter) from it, export the merged model (train.py --save-dir "
             "RUN --resume --export best --merge-lora) and start from it: --hf-model RUN/hf_final")
INIT_DATA = ("train", "valid", "test", "train_size", "valid_size", "max_src_len", "too_long")
LSTM_SIZE = ("embed_dim", "hidden_size", "bidirectional")  # the built-in LSTM's shape: no other model's


@dataclass(frozen=True)
class Start:
    """The checkpoint a command starts from, as read: the flag naming it, its file, its contents."""

    flag: str  # --resume, --resume-from or --init-from
    path: Path
    state: dict

    @property
    def where(self) -> str:
        return f"{self.flag}: {self.path}" if self.flag != "--init-from" else f"--init-from {self.path}"


def flag_of(cfg) -> str | None:
    """The flag naming the checkpoint this command starts from, or None (a new run from its recipe)."""
    return "--resume-from" if cfg.resume_from else "--resume" if cfg.resume else "--init-from" if cfg.init_from \
        else None


def check_flags(cfg) -> None:
    """Combinations of the start flags that cannot mean anything; ResumeError, one line. (A resumed run's
    --init-from is its checkpoint's record of where it started: the resume rules keep it fixed.)"""
    if cfg.resume and cfg.resume_from:
        raise ResumeError("--resume continues from <save-dir>/checkpoint_last.pt and --resume-from from the file "
                          "given: give one of them")
    if cfg.eval_only and not (cfg.resume or cfg.resume_from or cfg.init_from):
        raise ResumeError("--eval-only evaluates a checkpoint: add --resume (the run in --save-dir), "
                          "--resume-from FILE or --init-from FILE")


def read(cfg) -> Start | None:
    """The checkpoint the command's flags name, read (ResumeError where there is none, or it is not one)."""
    check_flags(cfg)
    if cfg.init_from and (cfg.resume or cfg.resume_from):
        raise ResumeError("--init-from starts a new run from a checkpoint's model; --resume and --resume-from "
                          "continue a run: give one of them")
    flag = flag_of(cfg)
    if flag is None:
        return None
    path = Path(cfg.init_from) if flag == "--init-from" else resume_path(cfg)
    if path is None:  # --resume's: found, or refused in one line by resume_path
        return None
    return Start(flag, path, load_checkpoint(path, flag))


# ------------------------------------------------------------------ the defaults
def task_recipe(args) -> dict:
    """The defaults of the task `args` names (`Task.flag_defaults`: Karel's model size and RL recipe, say); {}
    where it names none or no task (reported in one line when the run builds its task)."""
    try:
        factory = tasks.get(tasks.default_name(args))
    except tasks.TaskError:
        return {}
    return dict(getattr(factory, "flag_defaults", None) or {})


def recipe_defaults(args, recipe: dict | None = None) -> dict:
    """The defaults a new run starts from, beyond the flags' own: its task's (`recipe`: a task object's own, else
    `task_recipe`), then --preset's. Values set anywhere (flags, a file, fit's Config) win over both."""
    defaults = task_recipe(args) if recipe is None else dict(recipe)
    if args.preset in PRESETS:  # an unknown one is refused with the Config's choices
        defaults.update(PRESETS[args.preset])
    return defaults


def defaults(args, start: Start | None, recipe: dict | None = None) -> dict:
    """The values beneath the flags given: --resume / --resume-from take the checkpoint's resolved configuration
    (its own run directory for --resume-from), --eval-only --init-from too (it evaluates the checkpoint as
    --resume --eval-only would: its reward, metric, lengths); --init-from its model-shape and data flags over the
    recipe of the checkpoint's task; a new run the recipe's (`recipe`: a task object's own)."""
    known = {f.name for f in fields(Config)}
    if start is None:
        return recipe_defaults(args, recipe)
    saved = start.state["config"]
    if start.flag != "--init-from" or args.eval_only:
        inherited = configrules.inherited(saved, known)
        if start.flag == "--resume-from":
            inherited["save_dir"] = str(start.path.parent)
        return inherited
    shape = {k: saved[k] for k in MODEL_SHAPE + INIT_DATA if k in saved and k in known}
    # the recipe of the checkpoint's task (a different --task is refused by `check`)
    named = argparse.Namespace(**{**vars(args), "task": shape.get("task", args.task)})
    return {**recipe_defaults(named, recipe), **shape}


# ------------------------------------------------------------------ what the checkpoint fixes
def continued(cfg, start: Start | None) -> dict | None:
    """The checkpoint the run continues (--resume, --resume-from), or None."""
    return start.state if start is not None and start.flag != "--init-from" and flag_of(cfg) == start.flag \
        else None


def initial(cfg, start: Start | None) -> dict | None:
    """The checkpoint whose model weights a new run starts from (--init-from), or None."""
    return start.state if start is not None and start.flag == "--init-from" and flag_of(cfg) == "--init-from" \
        else None


def check(cfg, start: Start | None) -> None:
    """The command's flags against what the checkpoint fixes: a resumed run's by the declared per-field rules, an
    --init-from or --eval-only run's model-shape flags; ResumeError (or the rules' ConfigError), one line."""
    if start is None:
        return
    if start.flag == "--resume-from" and os.path.abspath(cfg.save_dir) != os.path.abspath(start.path.parent):
        raise ResumeError(f"--resume-from {start.path} continues the run in {start.path.parent}, not in --save-dir "
                          f"{cfg.save_dir} (--init-from starts a new run from its model)")
    if start.flag == "--init-from" and cfg.overwrite and \
            os.path.dirname(os.path.abspath(start.path)) == os.path.abspath(cfg.save_dir):
        raise ResumeError(f"--init-from {start.path} is in --save-dir {cfg.save_dir}, whose run --overwrite "
                          "would delete: choose another --save-dir")
    if start.flag == "--init-from" or cfg.eval_only:  # changes nothing but the model must be the checkpoint's
        check_model_flags(cfg, start.state, start.path, start.flag)
    else:
        configrules.check(cfg, start.state["config"], start.state, start.where)


def check_model_flags(cfg, state: dict, path, flag: str = "--init-from") -> None:
    """A model flag other than the checkpoint's would build another model (--init-from, --eval-only,
    --ref-checkpoint); ResumeError, one line."""
    saved = state["config"]
    for name in MODEL_SHAPE:
        if name in saved and not same(name, saved[name], getattr(cfg, name)):
            given = "--" + name.replace("_", "-")
            if name in LSTM_SIZE and not sized_by_flags(state):
                model = (f"a Hugging Face model (--hf-model {saved['hf_model']})" if saved.get("hf_model") else
                         "a model other than the built-in LSTM (its task's own, or one given to twophase.fit)")
                raise ResumeError(f"{given} {show(getattr(cfg, name))}: {flag} {path} holds {model}, which "
                                  f"{given} does not size: leave it out")
            hint = LORA_HINT if name in LORA_SHAPE else ""
            raise ResumeError(f"{given}: {flag} {path}: its model was built with {given} {show(saved[name])}, not "
                              f"{show(getattr(cfg, name))}{hint}")


def check_reference(cfg, model) -> None:
    """--ref-checkpoint (with --kl-beta): its parameters must fit the model this run trains, checked at start-up,
    not at the first RL step; ResumeError, one line, naming the flag that differs where one does."""
    if cfg.ref_checkpoint is None or not cfg.kl_beta:
        return
    state = load_checkpoint(cfg.ref_checkpoint, "--ref-checkpoint")
    first = misfit(model, state["model"])
    if first is not None:
        check_model_flags(cfg, state, cfg.ref_checkpoint, "--ref-checkpoint")  # a model flag that differs: the cause
        raise ResumeError(f"--ref-checkpoint {cfg.ref_checkpoint}: its parameters do not fit the model this run "
                          f"trains (the first: {first})")


def sized_by_flags(state: dict) -> bool:
    """Whether the LSTM size flags describe a checkpoint's model: not a Hugging Face model's, and on the tasks
    of the built-in LSTM (g2p, tsv) not a model given to twophase.fit (another task's model reads them as it
    declares)."""
    if state["config"].get("hf_model"):
        return False
    spec = (state.get("task") or {}).get("spec", "tsv" if state["config"].get("train") else "g2p")
    return spec not in ("g2p", "tsv") or built_in_lstm(state)


def built_in_lstm(state: dict) -> bool:
    """Whether a checkpoint's parameters are the built-in LSTM its configuration describes (names and shapes: a
    model given to twophase.fit may be another size, or another model)."""
    saved, ids = state["config"], (state.get("task") or {}).get("state") or state
    if saved.get("hf_model") or not all(isinstance(ids.get(k), list) for k in ("src_vocab", "tgt_vocab")):
        return False
    from ..models.seq2seq import Seq2Seq
    with torch.device("meta"):  # shapes only, nothing allocated
        lstm = Seq2Seq(len(ids["src_vocab"]), len(ids["tgt_vocab"]), saved.get("embed_dim", 0),
                       saved.get("hidden_size", 0), 0.0, bool(saved.get("bidirectional")))
    shapes = {name: tuple(t.shape) for name, t in lstm.state_dict().items()}
    return shapes == {name: tuple(t.shape) for name, t in state["model"].items()}
