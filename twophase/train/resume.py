"""Checkpoints a command reads and the model it exports: the file --resume and --resume-from continue from
(`resume_path`, the newest complete one), a checkpoint read and checked as one (`load_checkpoint`), its parameters
into the model built for the run (`load_init`, `check_rebuilt`), the frozen base model its parameters need
(`record`, `check`), a reward recorded under a name no other program imports, and --export's model, read back
and compared. What a checkpoint fixes for a command is `startpoint`'s; the run directory's own files are
`rundir`'s.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from . import checkpoint
from .checkpoint import CheckpointError, load
from ..errors import OneLineError
from ..system.fsdp import first_difference, load_saved, saved_state
from ..rewards import weighted
from ..tasks.base import ExportMismatch

class ResumeError(OneLineError, ValueError):
    """A run that cannot start from the checkpoint its flags name (--resume, --resume-from, --init-from,
    --ref-checkpoint, --export best), or from these flags together: one line naming the flag."""


def resume_path(cfg) -> Path | None:
    """The file --resume / --resume-from continues from; ResumeError saying what to do where there is none."""
    if cfg.resume_from:
        return Path(cfg.resume_from)
    if not cfg.resume:
        return None
    folder = Path(cfg.save_dir)
    path = folder / "checkpoint_last.pt"
    if path.exists():
        return newest(path)
    crash = folder / "checkpoint_crash.pt"
    if crash.exists():
        raise ResumeError(f"--resume: {path}: no such file; the run stopped with {crash} (its parameters from before "
                          f"the non-finite steps): --resume-from {crash} continues from it")
    steps = sorted(folder.glob("checkpoint_step*.pt")) if folder.is_dir() else []
    hint = f"; --resume-from {steps[-1]} continues from its newest step checkpoint" if steps else ""
    raise ResumeError(f"--resume: {path}: no such file{hint}")


def newest(last: Path) -> Path:
    """checkpoint_last.pt, or a complete step checkpoint of a later step beside it: a run writes each save's step
    checkpoint first and checkpoint_last.pt second, so a run killed between the two (or during the second write)
    leaves the newer step file and the older checkpoint_last.pt. A step file that cannot be read (a copy cut
    short) is passed over. (Later step files of a branch set aside by --resume-from were moved to after_step<N>/.)"""
    step = _step_of(last)
    if step is None:
        return last
    later = sorted(((int(m.group(1)), p) for p in last.parent.iterdir()
                    if (m := checkpoint.STEP_RE.match(p.name)) and int(m.group(1)) > step), reverse=True)
    for number, candidate in later:
        if _step_of(candidate) == number:
            return candidate
    return last


def _step_of(path: Path) -> int | None:
    """The step a checkpoint holds (its tensors left in the file), or None where it cannot be read."""
    try:
        return int(load(path, mmap=True).get("step", -1))
    except (CheckpointError, TypeError, ValueError):
        return None


def load_checkpoint(path, flag: str) -> dict:
    if Path(path).is_dir():
        raise ResumeError(f"{flag} {path}: a directory; give a checkpoint file, e.g. "
                          f"{Path(path) / 'checkpoint_last.pt'}")
    try:
        state = load(path)
    except CheckpointError as err:
        raise ResumeError(f"{flag}: {err}") from None
    if not isinstance(state.get("config"), dict):
        raise ResumeError(f"{flag}: {path}: not a twophase checkpoint (no 'config' entry)")
    plugin_folder(state)
    if "export" in state and flag in ("--resume", "--resume-from"):
        raise ResumeError(f"{flag}: {path}: a run's exported model (its parameters alone, --export), not a "
                          "checkpoint a run continues from: --init-from starts a new run from it")
    return state


def plugin_folder(state: dict) -> None:
    """A checkpoint of a task plug-in (--task module:callable) whose module does not import from here: the folder
    training imported it from (the checkpoint records it) goes on sys.path, as twophase-decode does, so that
    --init-from and --resume find it from any directory."""
    task = state.get("task") if isinstance(state.get("task"), dict) else {}
    spec, origin = str(task.get("spec") or ""), task.get("origin")
    if ":" not in spec or not origin or not Path(origin).is_dir() or origin in sys.path:
        return
    module = spec.partition(":")[0]
    top = module.partition(".")[0]
    if (Path.cwd() / f"{top}.py").is_file() or (Path.cwd() / top).is_dir():
        return  # the working directory's (the plug-in loader looks there first)
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        sys.path.append(origin)


def load_init(model, state: dict, path) -> None:
    """--init-from: the checkpoint's parameters into the model built for this run (a --lora-r run's checkpoint:
    its adapters, onto the base the run reads from --hf-model); ResumeError, one line, where they do not fit."""
    try:
        load_saved(model, state["model"])
    except RuntimeError as err:
        raise ResumeError(f"--init-from {path}: its parameters do not fit the model this run builds "
                          f"({str(err).strip().splitlines()[-1].strip()})") from None


FIT_RESUME = "twophase.fit(..., model=a_fresh_copy, resume=True)"


def check_rebuilt(model, state: dict, where: str) -> None:
    """--resume / --resume-from (and their --eval-only) rebuild the task's own model: the checkpoint's parameters
    must fit it by name and shape (a run trained with a model of its own, `twophase.fit(config, model=...)`,
    continues only where its model is given again); ResumeError, one line, saying how to continue it."""
    first = misfit(model, state["model"])
    if first is None:
        return
    raise ResumeError(f"{where}: its parameters do not fit the model task '{state['config'].get('task')}' builds "
                      f"(the first: {first}): a run trained on a model of its own (twophase.fit(config, "
                      f"model=...)) continues in Python, with {FIT_RESUME}")


def misfit(model, saved: dict) -> str | None:
    """The first parameter of a checkpoint's `saved` tensors that does not fit `model` (another name or shape, or
    a trainable parameter of the model it lacks), or None."""
    built = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    wrong = [name for name, t in saved.items() if built.get(name) != tuple(getattr(t, "shape", ()))]
    lost = sorted(trainable - set(saved))
    return wrong[0] if wrong else (lost[0] if lost else None)


def unimportable(spec: str | None) -> list[str]:
    """The names in a reward spec (Config.reward) that no other program can import: a function of `__main__` (a
    script or notebook given to twophase.fit), a lambda, a function defined inside another."""
    names = weighted.names(spec or "")
    return [s for s in names if s.partition(":")[0] == "__main__" or "<locals>" in s or "<lambda>" in s]


def check_reward_names(cfg, given_reward: bool) -> None:
    """A reward recorded by a name that cannot be imported again: refused at start-up where the run saves
    checkpoints (a lambda or a nested function, given to twophase.fit: no later run could find it by name),
    and named as such on --resume from the command line (a function of a script or notebook); ResumeError, one
    line."""
    names = unimportable(cfg.reward)
    if not names:
        return
    if given_reward:  # twophase.fit(reward=fn)
        nested = [s for s in names if "<locals>" in s or "<lambda>" in s]
        if nested and not cfg.eval_only:
            raise ResumeError(f"reward {nested[0]}: a lambda or a function defined inside another has no name a "
                              "checkpoint can record, so this run could not be resumed: define it with def at the "
                              "top level of a module (or of the script)")
        return
    path = resume_path(cfg)
    if path is None:  # --reward __main__:fn typed: the plug-in loader says it does not import
        return
    flag = "--resume-from" if cfg.resume_from else "--resume"
    fn = names[0].partition(":")[2]
    raise ResumeError(f"{flag}: {path}: its reward {names[0]} was given to twophase.fit from a script or notebook "
                      f"(__main__), which does not import here: continue it in Python with twophase.fit(..., "
                      f"reward={fn.rpartition('.')[2]}, resume=True), or move it into a module (module:{fn} imports "
                      "from anywhere)")


def export_model(model, export: str, path):
    """--export (`export`): the model the task's own export writes: the run's last, `model`, or the parameters
    of its checkpoint_best.pt, `path` (where the run has none, the last, with a note). The best is a copy of the
    model sharing its frozen parameters (a LoRA base: the checkpoint holds the adapters alone), its trainable ones
    in host memory with the file's values: no second model on the device."""
    if export != "best":
        return model
    if not path.exists():
        print(f"note: --export best: no {path} (no validation improved on the start): exporting the last model",
              file=sys.stderr, flush=True)
        return model
    try:
        state = load(path, mmap=True)
    except CheckpointError as err:
        raise ResumeError(f"--export best: {err}") from None
    memo = {id(p): p if not p.requires_grad else torch.nn.Parameter(p.detach().to(checkpoint.HOST, copy=True))
            for p in model.parameters()}
    best = copy.deepcopy(model, memo)
    try:
        load_saved(best, state["model"])
    except RuntimeError as err:
        raise ResumeError(f"--export best: {path}: its parameters do not fit this run's model "
                          f"({str(err).strip().splitlines()[-1].strip()})") from None
    return best


EXPORT = "model_final.pt"  # --export's file for a model without an export of its task's own


def save_export(model, cfg, task, save_dir, step: int, base_model: dict | None, own_model: bool = False):
    """--export last|best where the task writes no export of its own (the built-in LSTM, Karel's model, a task
    plug-in's): <save-dir>/model_final.pt, the model's parameters with what `twophase-decode` needs to rebuild and
    decode it without the run's folder (the configuration, the task's spec and ids, a --lora-r base's record);
    `step`: the exported parameters' step. Returns its path, or None where --export was not given (the
    checkpoints are the model). The file is read back and compared with `model` parameter by parameter
    (`check_export`): an export that would decode as another model raises ExportMismatch and is removed."""
    if cfg.export is None:
        return None
    state = {"export": cfg.export, "step": step, "config": asdict(cfg),
             "task": {"spec": task.spec, "state": task.state_dict(), "origin": getattr(task, "origin", None)},
             "model": checkpoint.host_copy(saved_state(model)),
             **({"base_model": base_model} if base_model else {})}
    path = Path(save_dir) / EXPORT
    checkpoint.save_atomic(state, path)
    try:
        check_export(model, path, None if own_model else task.build_model)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def check_export(model, path: Path, build) -> None:
    """ExportMismatch (one line) where --export's file, read back as twophase-decode reads it (its parameters
    loaded into the model the task builds, `build()`, on the host), is not `model`, entry by entry of their state
    dicts (the names checkpoints use: a grammar's or compile's wrapper names the model's). A model of the run's
    own (`build` None: twophase.fit(model=...)) is rebuilt by its user's code from the file's tensors: those are
    compared."""
    state = load(path, mmap=True)
    if build is None:
        trained, reloaded = saved_state(model), state["model"]
    else:
        rebuilt = build()
        try:
            load_saved(rebuilt, state["model"])
        except RuntimeError as err:
            raise ExportMismatch(f"{path}: its parameters do not fit the model its task builds "
                                 f"({str(err).strip().splitlines()[-1].strip()}): not exported") from None
        trained, reloaded = model.state_dict(), rebuilt.state_dict()
    wrong = first_difference(trained, reloaded, "tensor")
    if wrong is not None:
        raise ExportMismatch(f"{path}: read back as twophase-decode reads it, {wrong}: not exported")


# ------------------------------------------------------------------ the frozen base model
# What a checkpoint records of the frozen base its parameters need, and the check that a model built now has it.
#
# A --lora-r run's checkpoint holds the adapters alone: the base is whatever the --hf-model folder holds when the
# run is resumed, started from (--init-from) or decoded. So the checkpoint records the base (`record`): the folder
# it was read from and a fingerprint, a SHA-256 of
#
#     the configuration   the folder's config.json as written (its entries that describe the model: not the
#                         folder's name, the transformers version or the dtype it was saved in; the file, not
#                         transformers' reading of it, so that another transformers version sees the same)
#     the frozen weights  every frozen parameter's name, shape and a strided sample of its values (at most
#                         SAMPLE per tensor, exact values, read from the device in one copy): any retraining or
#                         merge of adapters changes every element of the matrices it touches
#
# which is cheap for any model size and equals on any device (no reduction). `check` refuses a model whose base
# differs, in one line naming both folders. A model without frozen parameters records nothing (its checkpoint
# holds every parameter), nor does one whose frozen parameters are those its own loader rebuilds from the config
# (`rebuilt_on_load`: Marian's position tables); a checkpoint written before the record existed is not checked.
SAMPLE = 64  # values read per frozen tensor
VOLATILE = ("transformers_version", "torch_dtype", "dtype", "architectures", "name_or_path")


def folder_config(folder: str | None) -> dict | None:
    """The entries of <folder>/config.json (None: no folder, no readable file)."""
    if not folder:
        return None
    try:
        with open(Path(folder) / "config.json", encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def fingerprint(model: torch.nn.Module, config: dict | None = None) -> dict | None:
    """{"config": hex, "weights": hex} of the frozen part of `model` (None: every parameter trains); `config`:
    the folder's configuration (`folder_config`), or None."""
    rebuilt = getattr(model, "rebuilt_on_load", frozenset())  # frozen, but rebuilt from the config on loading
    frozen = [(name, p) for name, p in model.named_parameters() if not p.requires_grad and name not in rebuilt]
    if not frozen:
        return None
    weights = hashlib.sha256()
    samples = []
    with torch.no_grad():
        for name, p in frozen:
            weights.update(f"{name}:{tuple(p.shape)};".encode())
            flat = p.detach().reshape(-1)  # (n,)
            n = flat.numel()
            k = min(n, SAMPLE)
            # evenly spaced, in integers (a float32 linspace rounds past the end beyond 2^24 elements)
            index = torch.arange(k, device=flat.device) * max(n - 1, 0) // max(k - 1, 1)  # (k,)
            samples.append(flat.index_select(0, index).to(torch.float64))
        values = torch.cat(samples).cpu()  # one read from the device, at start-up
    weights.update(values.numpy().tobytes())
    return {"config": _config_hash(config), "weights": weights.hexdigest()}


def _config_hash(config: dict | None) -> str | None:
    if config is None:
        return None
    entries = {k: v for k, v in config.items() if not k.startswith("_") and k not in VOLATILE}
    return hashlib.sha256(json.dumps(entries, sort_keys=True, default=str).encode()).hexdigest()


def record(model: torch.nn.Module, path: str | None) -> dict | None:
    """What a checkpoint keeps of the base read from the folder `path`: {"path", "config", "weights"}, or None
    (nothing frozen)."""
    found = fingerprint(model, folder_config(path))
    return None if found is None else {"path": path, **found}


def check(saved: dict | None, now: dict | None, where: str, path: str | None) -> None:
    """ResumeError (one line) where the checkpoint at `where` recorded a base (`saved`) other than the model's now
    (`now`, read from `path`)."""
    if not saved or not now:
        return
    differs = [part for part in ("weights", "config") if saved.get(part) and now.get(part) != saved.get(part)]
    if not differs:
        return
    what = " and ".join(differs) + (" differ" if differs != ["config"] else " differs")
    recorded = "" if path == saved.get("path") else f"; trained on {saved.get('path')}"
    raise ResumeError(f"{where}: its parameters were trained on another base model than --hf-model {path} holds "
                      f"now (its {what}{recorded}): give the folder they were trained on (a merged export is no "
                      "base: its weights hold the adapters already)")

