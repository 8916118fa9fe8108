"""A run's lineage: which checkpoint a command starts from (--resume, --resume-from, --init-from), the later
checkpoints a resumed run sets aside, config.json beside the checkpoints, --eval-only and --export.

Nothing here deletes a checkpoint: a run resumed from an earlier file moves the files of later steps into
<save-dir>/after_step<N>/ (with a copy of metrics.jsonl), so the branch it abandons stays whole.
"""
from __future__ import annotations

import copy
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import checkpoint, report
from .checkpoint import CheckpointError, SaveError, load
from .params import load_saved
from .resume_rules import same, show

# Flags that give the model its shape and ids: --init-from takes them from the checkpoint and refuses others.
# LoRA's rank, scale and modules too: a --lora-r checkpoint holds the adapters alone, which only continue on
# adapters of the same shape over the same base (new adapters start from a merged export: LORA_HINT).
LORA_SHAPE = ("lora_r", "lora_alpha", "lora_target_modules")
MODEL_SHAPE = ("task", "hf_model", "embed_dim", "hidden_size", "bidirectional", "char_source", "char_target",
               "lowercase_source") + LORA_SHAPE
LORA_HINT = ("; to train new adapters (or every parameter) from it, export the merged model (train.py --save-dir "
             "RUN --resume --export best --merge-lora) and start from it: --hf-model RUN/hf_final")
INIT_DATA = ("train", "valid", "test", "train_size", "valid_size", "max_src_len", "too_long")
LATER = ("checkpoint_last.pt", "checkpoint_best.pt", "checkpoint_crash.pt", "checkpoint_mle_end.pt",
         "checkpoint_mle_continued.pt")
_STEP = re.compile(r"^checkpoint_step(\d+)\.pt$")


def check_flags(cfg) -> None:
    """Combinations of the run flags that cannot mean anything; ValueError, one line. (A resumed run's --init-from
    is its checkpoint's record of where it started: resume_rules keeps it fixed.)"""
    if cfg.resume and cfg.resume_from:
        raise ValueError("--resume continues from <save-dir>/checkpoint_last.pt and --resume-from from the file "
                         "given: give one of them")
    if cfg.eval_only and not (cfg.resume or cfg.resume_from or cfg.init_from):
        raise ValueError("--eval-only evaluates a checkpoint: add --resume (the run in --save-dir), "
                         "--resume-from FILE or --init-from FILE")


def resume_path(cfg) -> Path | None:
    """The file --resume / --resume-from continues from; ValueError saying what to do where there is none."""
    if cfg.resume_from:
        return Path(cfg.resume_from)
    if not cfg.resume:
        return None
    folder = Path(cfg.save_dir)
    path = folder / "checkpoint_last.pt"
    if path.exists():
        return path
    crash = folder / "checkpoint_crash.pt"
    if crash.exists():
        raise ValueError(f"--resume: {path}: no such file; the run stopped with {crash} (its parameters from before "
                         f"the non-finite steps): --resume-from {crash} continues from it")
    steps = sorted(folder.glob("checkpoint_step*.pt")) if folder.is_dir() else []
    hint = f"; --resume-from {steps[-1]} continues from its newest step checkpoint" if steps else ""
    raise ValueError(f"--resume: {path}: no such file{hint}")


def load_checkpoint(path, flag: str) -> dict:
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: a directory; give a checkpoint file, e.g. "
                         f"{Path(path) / 'checkpoint_last.pt'}")
    try:
        state = load(path)
    except CheckpointError as err:
        raise ValueError(f"{flag}: {err}") from None
    if not isinstance(state.get("config"), dict):
        raise ValueError(f"{flag}: {path}: not a twophase checkpoint (no 'config' entry)")
    return state


def init_defaults(state: dict, known) -> dict:
    """--init-from: the checkpoint's model-shape flags (fixed) and data flags (others may be given) as this run's
    defaults."""
    return {k: state["config"][k] for k in MODEL_SHAPE + INIT_DATA if k in state["config"] and k in known}


def check_init(cfg, state: dict, path, flag: str = "--init-from") -> None:
    """--init-from (and --eval-only): a model flag other than the checkpoint's would build another model."""
    saved = state["config"]
    for name in MODEL_SHAPE:
        if name in saved and not same(name, saved[name], getattr(cfg, name)):
            flag = "--" + name.replace("_", "-")
            hint = LORA_HINT if name in LORA_SHAPE else ""
            raise ValueError(f"{flag} {path}: its model was built with {flag} {show(saved[name])}, not "
                             f"{show(getattr(cfg, name))}{hint}")


def load_init(model, state: dict, path) -> None:
    """--init-from: the checkpoint's parameters into the model built for this run (a --lora-r run's checkpoint:
    its adapters, onto the base the run reads from --hf-model); ValueError, one line, where they do not fit."""
    try:
        load_saved(model, state["model"])
    except RuntimeError as err:
        raise ValueError(f"--init-from {path}: its parameters do not fit the model this run builds "
                         f"({str(err).strip().splitlines()[-1].strip()})") from None


def set_aside(save_dir, step: int) -> Path | None:
    """Move the checkpoints of steps after `step` (and a copy of metrics.jsonl) into <save-dir>/after_step<N>/;
    returns that folder, or None where there were none."""
    folder = Path(save_dir)
    later = []
    for p in sorted(folder.iterdir()):
        m = _STEP.match(p.name)
        if m:
            at = int(m.group(1))
        elif p.name in LATER:
            try:
                at = int(torch.load(p, map_location="cpu", weights_only=True, mmap=True).get("step", 0))
            except Exception:
                continue  # unreadable: not ours to judge, left where it is
        else:
            continue
        if at > step:
            later.append(p)
    if not later:
        return None
    if (folder / "hf_final").is_dir():  # a task's export of the final model: the later branch's end
        later.append(folder / "hf_final")
    aside = folder / f"after_step{step}"
    n = 1
    while aside.exists():
        n += 1
        aside = folder / f"after_step{step}.{n}"
    aside.mkdir()
    for p in later:
        os.replace(p, aside / p.name)
    if (folder / "metrics.jsonl").exists():
        (aside / "metrics.jsonl").write_bytes((folder / "metrics.jsonl").read_bytes())
    return aside


def write_config(save_dir, cfg, recipe: dict, source=None) -> Path:
    """<save-dir>/config.json: the resolved flags (the task's recipe and --preset applied), the recipe itself and
    the checkpoint this command started from; written atomically, rewritten by every command that trains."""
    path = Path(save_dir) / "config.json"
    doc = {"config": asdict(cfg), "recipe": recipe, "started_from": str(source) if source else None,
           "written": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")}
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config.json", suffix=".tmp")
    except OSError as err:
        raise SaveError(err.errno, f"cannot write {path}: {err.strerror or err}") from None
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a plain record from the group
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise SaveError(err.errno, f"cannot write {path}: {err.strerror or err}") from None
    return path


def evaluation_table(task, scores: dict) -> str:
    """--eval-only's table: one row per metric (the task's, then the reward), one column per split."""
    rows = [(m.key, m.label, m.fmt) for m in task.metrics] + [("reward", "reward", "{:.4f}")]
    splits = list(scores)
    lines = [f"{'':28}" + "".join(f"{s:>12}" for s in splits)]
    for key, label, fmt in rows + [("n", "examples", "{:.0f}")]:
        if any(key in scores[s] for s in splits):
            lines.append(f"{label:28}" + "".join(f"{_cell(fmt, scores[s].get(key, '')):>12}" for s in splits))
    return "\n".join(lines)


def _cell(fmt: str, value) -> str:
    """A score in its format, compact where it would not fit (`report.compact`); '-' for a reward that scored
    nothing (None), '' for a split without the key."""
    if value == "":
        return ""
    return "-" if value is None or value != value else report.compact(fmt, value, width=11)


def export_model(trainer):
    """--export: the model the task's own export writes: the run's last, or checkpoint_best.pt's parameters
    (where the run has none, the last, with a note). The best is a copy of the model sharing its frozen
    parameters (a LoRA base: the checkpoint holds the adapters alone), its trainable ones in host memory with the
    file's values: no second model on the device."""
    if trainer.cfg.export != "best":
        return trainer.model
    path = trainer.checkpoints.best_path
    if not path.exists():
        print(f"note: --export best: no {path} (no validation improved on the start): exporting the last model",
              file=sys.stderr, flush=True)
        return trainer.model
    try:
        state = load(path, mmap=True)
    except CheckpointError as err:
        raise ValueError(f"--export best: {err}") from None
    memo = {id(p): p if not p.requires_grad else torch.nn.Parameter(p.detach().to(checkpoint.HOST, copy=True))
            for p in trainer.model.parameters()}
    model = copy.deepcopy(trainer.model, memo)
    try:
        load_saved(model, state["model"])
    except RuntimeError as err:
        raise ValueError(f"--export best: {path}: its parameters do not fit this run's model "
                         f"({str(err).strip().splitlines()[-1].strip()})") from None
    return model
