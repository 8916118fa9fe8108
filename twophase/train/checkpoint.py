"""Crash-safe checkpoints: atomic writes, safe (never-executing) loads, RNG capture and rotation.

A checkpoint is written to a temporary file beside its destination and renamed over it only once it is fully on
disk, so a crash or a full disk mid-write never destroys the previous checkpoint. Loading uses
``torch.load(weights_only=True)``: a file that needs arbitrary pickled objects is refused rather than executed.
"""
from __future__ import annotations

import copy
import errno
import math
import os
import pickle
import random
import re
import resource
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..errors import OneLineError

__all__ = ["CheckpointError", "SaveError", "save_atomic", "load", "rng_state", "set_rng_state", "python_rng_state",
           "set_python_rng_state", "set_generator_state", "host_copy", "CheckpointManager"]

STEP_RE = re.compile(r"^checkpoint_step(\d+)\.pt$")


class CheckpointError(OneLineError, ValueError):
    """One-line message naming the file."""


class SaveError(OneLineError, OSError):
    """A file of the run could not be written (unwritable, a file in the way, disk full): one line naming the path
    and the cause; what was saved before is untouched."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def _cause(err: BaseException, folder: Path, written: int = 0) -> str:
    """Why a write failed, in words: the OS's reason, or for torch's zip writer (whose failed write is a
    RuntimeError 'unexpected pos') the file-size limit the file reached (`written`: its bytes; RLIMIT_FSIZE, with
    SIGXFSZ ignored) or the disk's state."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and written >= limit:
        return f"{os.strerror(errno.EFBIG)} (the process's file-size limit, {limit:,} bytes)"
    try:
        if shutil.disk_usage(folder).free < 2**24:
            return os.strerror(errno.ENOSPC)
    except OSError:
        pass
    return str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__


def _from_zip_writer(err: RuntimeError) -> bool:
    """torch's zip writer reports a failed write (a full disk, say) as a RuntimeError of its own; other
    RuntimeErrors are bugs, not the disk's, and stay as they are."""
    text = str(err)
    return "inline_container" in text or "PytorchStreamWriter" in text or "file write failed" in text


def _fsync_dir(folder: Path) -> None:
    # The rename itself lives in the directory entry; without this a power loss can forget it. Windows cannot
    # open a directory for fsync, so failure there is tolerated.
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_atomic(state: dict, path) -> None:
    """torch.save `state` to `path` atomically: either the new file is complete or the old one is untouched. A
    failed write (SaveError, naming the path and the cause) leaves no temporary file behind."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    # Same folder as the destination so os.replace is a rename within one filesystem (atomic), not a copy.
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + path.name, suffix=".tmp")
    except OSError as err:
        raise SaveError(err.errno, f"cannot write {path}: {_cause(err, folder)}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        # BaseException too: a Ctrl-C mid-write must not leave a stray temp file behind.
        try:
            written = os.path.getsize(tmp)
            os.unlink(tmp)
        except OSError:
            written = 0
        if isinstance(err, OSError) or (isinstance(err, RuntimeError) and _from_zip_writer(err)):
            raise SaveError(getattr(err, "errno", None) or errno.EIO,
                            f"cannot write {path}: {_cause(err, folder, written)}") from None
        raise
    _fsync_dir(folder)


def _is_weights_only_refusal(exc: Exception) -> bool:
    msg = str(exc).lower()
    return "weights only" in msg or "weights_only" in msg


def _written_by_torch_save(path) -> bool:
    """torch.save writes a zip archive; anything else (text, a pickle, numpy, safetensors) is not a checkpoint,
    whatever the unpickler would say about it. Missing and empty files are left to torch.load's own messages."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return True
    return head in (b"", b"PK\x03\x04")


def load(path, mmap: bool = False) -> dict:
    """Load a twophase checkpoint with torch.load(weights_only=True) onto the CPU (the caller copies what it needs
    into a model already on its device: no second copy of the parameters, nor the optimizer's moments, in device
    memory); any failure is a CheckpointError. mmap: the tensors stay in the file until read (a caller that needs
    the parameters alone never reads the optimizer's state)."""
    if not _written_by_torch_save(path):
        raise CheckpointError(f"{path}: not a twophase checkpoint (not a file torch.save wrote)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (pickle.UnpicklingError, RuntimeError) as exc:
        if isinstance(exc, pickle.UnpicklingError) or _is_weights_only_refusal(exc):
            # from None: torch's own message advises weights_only=False, which is exactly what we must not do.
            raise CheckpointError(f"{path}: refused: the checkpoint contains pickled Python objects (only tensors "
                                  "and plain data are loaded, never executed)") from None
        raise CheckpointError(f"{path}: not a readable checkpoint ({exc.__class__.__name__})") from exc
    except Exception as exc:  # truncated/corrupt files surface as EOFError, zip errors, OSError, ...
        raise CheckpointError(f"{path}: not a readable checkpoint ({exc.__class__.__name__})") from exc
    if not isinstance(obj, dict) or "model" not in obj:
        raise CheckpointError(f"{path}: not a twophase checkpoint (no 'model' entry)")
    return obj


def python_rng_state(rng=random) -> dict:
    """A `random.Random`'s state (or the `random` module's) as the weights-only unpickler accepts it."""
    version, internal, gauss = rng.getstate()
    return {"version": int(version), "state": [int(x) for x in internal], "gauss_next": gauss}


def set_python_rng_state(state: dict, rng=random) -> None:
    rng.setstate((state["version"], tuple(state["state"]), state["gauss_next"]))


def rng_state() -> dict:
    """Every RNG state training touches, in a form that survives torch.load(weights_only=True)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state = {
        # Tuples become lists and numpy scalars become Python numbers: the weights-only unpickler accepts those.
        "python": python_rng_state(),
        "numpy": {"kind": str(np_kind), "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Inverse of rng_state(); CUDA states are restored only where CUDA is available."""
    set_python_rng_state(state["python"])
    nps = state["numpy"]
    keys = nps["keys"].cpu().numpy().astype(np.uint32)
    np.random.set_state((nps["kind"], keys, nps["pos"], nps["has_gauss"], nps["cached_gaussian"]))
    # .cpu(): a state held on a device (a snapshot, a file loaded there) cannot be set; the setters need CPU bytes.
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        # A run resumed on fewer GPUs than it was saved on restores the devices that exist.
        for index, s in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), index)


def set_generator_state(generator: torch.Generator, state: torch.Tensor) -> None:
    """generator.set_state from the CPU: a generator of any device takes its state as a CPU ByteTensor."""
    generator.set_state(state.cpu())


HOST = torch.device("cpu")  # where snapshots are held: host memory


def host_copy(obj):
    """A copy of a state (dicts, lists, tensors, plain data) with every tensor copied into CPU memory, so that a
    snapshot held for later costs no device memory; a sharded tensor (a DTensor, --fsdp) stays as it is, a
    copy of this process's shard on its device (its mesh names the device)."""
    if isinstance(obj, torch.Tensor):
        if type(obj).__name__ == "DTensor":
            return obj.detach().clone()
        return obj.detach().to(HOST, copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return copy.deepcopy(obj)


class CheckpointManager:
    """Keeps checkpoint_last.pt, the newest `keep_last` step files and checkpoint_best.pt in `save_dir`.

    The best metric is stored in every saved state under "best_metric"; after a restart, restore it with
    ``manager.best = state.get("best_metric")``.
    """

    def __init__(self, save_dir, keep_last: int = 2, higher_is_better: bool = True):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        self.save_dir = Path(save_dir)
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.higher_is_better = higher_is_better
        self.best: float | None = None

    @property
    def last_path(self) -> Path:
        return self.save_dir / "checkpoint_last.pt"

    @property
    def best_path(self) -> Path:
        return self.save_dir / "checkpoint_best.pt"

    def step_path(self, step: int) -> Path:
        return self.save_dir / f"checkpoint_step{step:08d}.pt"

    def improves(self, metric: float | None) -> bool:
        # NaN (a diverged eval) must never become "best": every later comparison with it would be False.
        if metric is None or math.isnan(metric):
            return False
        if self.best is None:
            return True
        return metric > self.best if self.higher_is_better else metric < self.best

    def save(self, state: dict, step: int, metric: float | None = None) -> list[Path]:
        """Write step/last/(best) checkpoints and rotate old step files; returns the paths written."""
        improved = self.improves(metric)
        if improved:
            self.best = float(metric)
        # Shallow copy so the caller's dict is not mutated by the bookkeeping entry.
        state = {**state, "best_metric": self.best}
        written = []
        targets = ([self.step_path(step)] if self.keep_last > 0 else []) + [self.last_path]
        if improved:
            targets.append(self.best_path)
        for target in targets:
            save_atomic(state, target)
            written.append(target)
        self._rotate(step)
        return written

    def write_best(self, state: dict) -> Path:
        """Write checkpoint_best.pt alone, for a validation between save points that improved `best` (the caller
        set it, having asked `improves`)."""
        save_atomic({**state, "best_metric": self.best}, self.best_path)
        return self.best_path

    def _rotate(self, step: int) -> None:
        # Runs only after the new files are on disk, so a crash here never leaves fewer checkpoints than wanted.
        # Files of later steps (a branch this run was resumed before) are never this rotation's to delete.
        steps = sorted((int(m.group(1)), p) for p in self.save_dir.iterdir()
                       if (m := STEP_RE.match(p.name)) and int(m.group(1)) <= step)
        stale = steps[:-self.keep_last] if self.keep_last > 0 else steps
        for _, p in stale:
            p.unlink(missing_ok=True)
