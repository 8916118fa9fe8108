"""The run directory: one run per `--save-dir`, the metrics log that run writes there, its config.json, and the
later checkpoints a resumed run sets aside.

A directory holding a run's files is refused unless `--resume` continues that run or `--overwrite` replaces it, so
a second run can neither replace a finished run's checkpoints nor append to its log. On `--resume` the logs are
cut back to the checkpoint's step: rows of steps taken after it (lost with the process that took them) would
otherwise appear twice, and one metrics.jsonl only ever tells one consistent run.

One process writes into a directory at a time (`RunLock`, <save-dir>/run.lock): a second run started there, even
with --resume, is refused until the first ends, so two runs never mix their checkpoints and logs.

Nothing here deletes a checkpoint but --overwrite: a run resumed from an earlier file moves the files of later
steps into <save-dir>/after_step<N>/ (with a copy of metrics.jsonl), so the branch it abandons stays whole.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from .checkpoint import SaveError
from ..errors import OneLineError

LOGS = ("metrics.jsonl", "memory_profile.jsonl")
# the final model's export: a task's own (Task.save_final: --hf-model's save_pretrained), or --export's file
# for the other models (resume.save_export)
FOLDERS = ("hf_final", "model_final.pt")
RECORD = "config.json"  # every command's resolved flags (write_config)
PICTURE = "curves.png"  # the end-of-run picture (--picture)
TENSORBOARD = "tensorboard"  # --tensorboard's folder; only its event files are the run's
# The temporary file of an atomic write, left behind by a process killed mid-write: mkstemp's
# ".<name><random>.tmp" beside the checkpoint, config.json or log it was to replace (hf_final's ".hf_final.tmp").
_RESIDUE = re.compile(r"\.(checkpoint_[^/]*\.pt|config\.json|metrics\.jsonl|memory_profile\.jsonl|hf_final"
                      r"|model_final\.pt)[^/]*\.tmp")
_ASIDE = re.compile(r"after_step\d+(\.\d+)?")  # --resume-from's folders of the checkpoints it set aside
_EVENTS = "events.out.tfevents.*"
LATER = ("checkpoint_last.pt", "checkpoint_best.pt", "checkpoint_crash.pt", "checkpoint_mle_end.pt",
         "checkpoint_mle_continued.pt")  # the files set_aside reads the step of
_STEP = re.compile(r"^checkpoint_step(\d+)\.pt$")


LOCK = "run.lock"  # held while a process writes into the directory (RunLock)


class RunLock:
    """One process at a time writes into a run directory: <save-dir>/run.lock, created exclusively and held with
    the kernel's lock on it (flock) for as long as the run writes, holds the holder's pid, host and start time. A
    second run into the directory is refused in one line naming it (`Busy`); the lock of a process that is gone
    (kill -9: the kernel dropped its hold; where flock is unavailable, a pid no longer running on this host) is
    taken over with a note. `release` (every exit of the command: the end, an error, SIGTERM, which becomes
    SystemExit(143) while no handler of the run's own is installed) deletes the file. Nothing is held before
    `acquire`, so a command that stops before it has nothing to release."""

    def __init__(self):
        self.path: Path | None = None
        self._fd: int | None = None
        self._previous_sigterm = None
        self._made: list[Path] = []

    def acquire(self, save_dir) -> None:
        folder = Path(save_dir)
        # the folders made for it, removed again where the command leaves them empty (one refused at start-up)
        self._made = [p for p in [folder, *folder.parents] if not p.exists()]
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SaveError(err.errno, f"--save-dir {save_dir}: cannot create it: {err.strerror or err}") from None
        path = folder / LOCK
        for _ in range(20):  # a holder releasing meanwhile: try again on the new file
            try:
                fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(path, os.O_RDWR), False
                except FileNotFoundError:
                    continue
            except OSError as err:
                raise SaveError(err.errno, f"cannot create {path}: {err.strerror or err}") from None
            holder = _holder(fd)
            if not _hold(fd, holder):
                os.close(fd)
                raise Busy(f"--save-dir {save_dir} is in use by another run ({_described(holder)}; its lock "
                           f"{path}): wait for it to end, or choose another --save-dir")
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released (and deleted) between our open and our hold: the file is no longer the lock
                os.close(fd)
                continue
            if not created and holder:
                print(f"note: --save-dir {save_dir}: took over the lock of a run that is gone ({_described(holder)})",
                      file=sys.stderr, flush=True)
            mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "started": datetime.now(timezone.utc).isoformat(timespec="seconds")
                               .replace("+00:00", "Z")})
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, (mine + "\n").encode())
            self.path, self._fd = path, fd
            self._on_sigterm()
            return
        raise Busy(f"--save-dir {save_dir}: its lock {path} keeps changing hands: another run is starting there")

    def _on_sigterm(self) -> None:
        """SIGTERM, where nothing else handles it, raises SystemExit(143): the command's clean-up (this lock's
        release among it) runs, where the default action would end the process on the spot."""
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still held: a waiter that opened it sees it gone
        finally:
            os.close(self._fd)
            self._fd = None
            if self._previous_sigterm is not None and signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
            for made in self._made:  # deepest first
                try:
                    made.rmdir()
                except OSError:  # not empty: the run wrote there
                    break


class Busy(OneLineError, ValueError):
    """Another live process holds the run directory's lock (one line)."""


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _holder(fd: int) -> dict:
    """The lock file's record of its holder ({"pid", "host", "started"}), or {} (empty, unreadable)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        found = json.loads(os.read(fd, 4096).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _hold(fd: int, holder: dict) -> bool:
    """Whether this process now holds the lock open on `fd`: the kernel's exclusive flock, which a killed process
    loses; where the file system has none, the recorded holder's pid no longer running on this host."""
    try:
        import fcntl
    except ImportError:  # no flock on this system
        return _gone(holder)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:  # a file system without locks
        return _gone(holder)


def _gone(holder: dict) -> bool:
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return not holder  # an empty record is no holder; another host's pid cannot be checked from here
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def _described(holder: dict) -> str:
    if not holder:
        return "a process that has not written its name yet"
    return f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def run_files(save_dir) -> list[Path]:
    """The files of a run in save_dir: its checkpoints, logs and final-model folder."""
    folder = Path(save_dir)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name in LOGS or p.name in FOLDERS
                  or (p.name.startswith("checkpoint_") and p.name.endswith(".pt")))


def residue(save_dir) -> list[Path]:
    """The temporary files of the run's atomic writes that a killed process left in save_dir (a checkpoint's
    can be as large as the model); only names of that pattern, nothing else."""
    folder = Path(save_dir)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _RESIDUE.fullmatch(p.name))


def artifacts(save_dir) -> list[Path]:
    """Everything a run writes in save_dir, for --overwrite: its files (`run_files`), config.json, its picture,
    the folders --resume-from set aside, --tensorboard's event files and the residue of interrupted writes. What
    else the directory holds is not the run's and is left alone."""
    folder = Path(save_dir)
    if not folder.is_dir():
        return []
    own = [p for p in folder.iterdir() if p.name in (RECORD, PICTURE) or (p.is_dir() and _ASIDE.fullmatch(p.name))]
    events = sorted((folder / TENSORBOARD).glob(_EVENTS)) if (folder / TENSORBOARD).is_dir() else []
    board = [folder / TENSORBOARD] if events else []  # removed last, and only once empty
    return sorted(set(run_files(save_dir) + own + residue(save_dir))) + events + board


def claim(save_dir, resume: bool, overwrite: bool) -> list[Path]:
    """Check that save_dir may take this run; returns what is to be deleted: the old run's `artifacts` for
    --overwrite, the `residue` of interrupted writes otherwise. Refused (ValueError, one line naming the
    directory and both flags): a directory holding another run without --resume or --overwrite, and the two
    flags together. The caller deletes the files with `remove` only once the new run is ready to start, so a
    typo in another flag does not cost the old run."""
    if resume and overwrite:
        raise ValueError("--resume continues the run in --save-dir and --overwrite replaces it: give one of them")
    found = run_files(save_dir)
    if not found or resume:
        return residue(save_dir)
    if not overwrite:
        names = ", ".join(p.name for p in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ValueError(f"--save-dir {save_dir} already holds a run ({names}); pass --resume to continue it or "
                         "--overwrite to replace it (or choose another --save-dir)")
    return artifacts(save_dir)


def check_writable(save_dir) -> None:
    """Check now, before anything slow, that save_dir can take a run (nothing is created): SaveError naming the
    path and the cause (not writable, read-only, a file in the way, disk full). The probe is a nameless temporary
    file in save_dir or its nearest existing parent, gone once closed; nothing already there is touched."""
    folder = Path(save_dir)
    existing = next(p for p in [folder, *folder.parents, Path(".")] if p.exists())
    if not existing.is_dir():
        raise SaveError(errno.ENOTDIR, f"--save-dir {save_dir}: {existing} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing) as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise SaveError(err.errno, f"--save-dir {save_dir}: cannot write in {existing}: {err.strerror or err}") \
            from None


def remove(files: list[Path]) -> None:
    """Delete an old run's files (what else its directory holds stays). The tensorboard folder goes only where
    nothing but the run's event files was in it."""
    for path in files:
        if path.is_dir() and path.name == TENSORBOARD:
            if not any(path.iterdir()):
                path.rmdir()
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


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
    later += [folder / name for name in FOLDERS if (folder / name).exists()]  # the final model's export: the
    #                                                                          later branch's end
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


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` atomically (a crash leaves the old file or the new one, never half of either, nor a
    temporary file), readable as a file written plainly; SaveError (one line) where it cannot be written."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name, suffix=".tmp")
    except OSError as err:
        raise SaveError(err.errno, f"cannot write {path}: {err.strerror or err}") from None
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a plain record from the group
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:  # a Ctrl-C mid-write too: no temporary file left behind
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise SaveError(err.errno, f"cannot write {path}: {err.strerror or err}") from None
        raise


def write_config(save_dir, cfg, recipe: dict, source=None) -> Path:
    """<save-dir>/config.json: the resolved flags (the task's recipe and --preset applied), the recipe itself and
    the checkpoint this command started from; written atomically, rewritten by every command that trains."""
    path = Path(save_dir) / "config.json"
    doc = {"config": asdict(cfg), "recipe": recipe, "started_from": str(source) if source else None,
           "written": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")}
    write_atomically(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def _kept(row: dict, step: int, compared: bool = False) -> bool:
    # Rows of the checkpoint's own step stay (its training row and validation come before the save), except
    # the test evaluations, which follow the final save and are redone when the resumed run ends. The
    # continued-MLE branch's rows are numbered from its branch point (below RL's steps): they stay only with the
    # comparison they belong to, which a resumed run without it redoes.
    if row.get("phase") == "test":
        return False
    if "mle-continued" in (row.get("phase"), row.get("after")):
        return compared
    return row.get("step", 0) <= step


def cut_back(path, step: int, compared: bool = False) -> int:
    """Rewrite the JSONL log at `path` keeping its rows up to `step` (see _kept), atomically: a crash leaves the
    old file or the new one. A torn last line (the process killed mid-write) goes too. `compared`: the
    checkpoint's --compare-mle branch is done (its rows, numbered from the branch point, stay). Returns rows
    dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and _kept(row, step, compared):
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        write_atomically(path, "".join(kept))
    return dropped


def strict(value):
    """`value` with every NaN and infinity (nested too) as None: metrics.jsonl is strict JSON, which bare NaN is
    not (jq, JavaScript and most JSON readers refuse it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


class MetricsLog:
    """metrics.jsonl: one JSON object per line, each stamped with `time` (ISO 8601, UTC) and `elapsed_s` (seconds
    since the run began, continuing across --resume from the checkpoint's count)."""

    def __init__(self, path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self.mirror: Any = None  # --tensorboard's TensorBoardLog (report's, which this module does not import)
        self.elapsed_before = 0.0  # what earlier processes of this run spent, up to the resumed checkpoint
        self._start = time.monotonic()

    @property
    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self._start

    def resume_at(self, elapsed_s: float) -> None:
        self.elapsed_before, self._start = float(elapsed_s), time.monotonic()

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        stamp = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(strict({**row, "time": stamp, "elapsed_s": round(self.elapsed, 3)}),
                                   allow_nan=False) + "\n")
        except OSError as err:
            raise SaveError(err.errno, f"cannot write {self.path}: {err.strerror or err}") from None
        if self.mirror is not None:
            self.mirror.write(row)
