"""Running the GPU check's sections one at a time, each isolated: in a fresh process of its own by default (a
CUDA fault, a leaked allocation or a hang stays there; its peaks are its own), or in this process (`--inline`),
each under a time limit. A section's outcome is a dict: status "ok" (with its result), "skipped" (with the
reason), "error" (with its one-line error) or "timeout"; the seconds it took in every case.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

from .. import checkout_env
from .common import one_line

# letter: (module in this package, what the section checks)
SECTIONS = {
    "a": ("gradients", "chunked = whole-batch gradient, float32, default and deterministic algorithms"),
    "b": ("memory", "the seed's setting, two-phase against one-phase: memory, step time, host syncs"),
    "c": ("oom", "OOM halving in phase two under a small memory budget"),
    "d": ("mixed", "a bf16 and an fp16 step under autocast"),
    "e": ("generate", "phase one against Hugging Face generate"),
    "f": ("multi", "2 processes = 1: torchrun over NCCL, data-parallel and --fsdp"),
    "g": ("largestbeam", "the largest beam K under a 32 GiB card's memory, two-phase against one-phase"),
    "h": ("karelrate", "train.py --task karel --preset karel-paper: steps per second"),
}
LEAST_S = 10.0  # a section is not started with less of the budget left than this
MARK = "GPU-SECTION-RESULT "  # the worker's last line: MARK + JSON


class Skip(Exception):
    """Raised by a section that cannot run here; its message is the reason."""


class SectionTimeout(BaseException):
    """The inline time limit (a BaseException, so a section's own `except Exception` does not swallow it)."""


def section_function(letter: str):
    return importlib.import_module(f"{__package__}.{SECTIONS[letter][0]}").run


def run_here(letter: str, options: dict) -> dict:
    """The section in this process: its outcome (never raises, but for KeyboardInterrupt)."""
    start = time.perf_counter()
    try:
        if options.get("threads"):
            import torch
            torch.set_num_threads(options["threads"])
        result = section_function(letter)(options)
        outcome = {"status": "ok", "result": result}
    except Skip as why:
        outcome = {"status": "skipped", "reason": str(why)}
    except SectionTimeout:
        outcome = {"status": "timeout", "error": f"over the section's limit of {options['limit_s']:.0f} s"}
    except Exception as err:  # noqa: BLE001 (recorded; the next section runs)
        outcome = {"status": "error", "error": one_line(err)}
    outcome["seconds"] = round(time.perf_counter() - start, 3)
    return outcome


@contextlib.contextmanager
def time_limit(seconds: float):
    """SectionTimeout after `seconds` of the block (SIGALRM: the main thread of a POSIX process; elsewhere none)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise SectionTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_inline(letter: str, options: dict) -> dict:
    with time_limit(options["limit_s"]):
        return run_here(letter, options)


def run_isolated(letter: str, options: dict) -> dict:
    """The section in a fresh `python -m benchmarks.gpu --worker` process, killed at its time limit."""
    start = time.perf_counter()
    command = [sys.executable, "-m", __package__, "--worker", json.dumps(dict(options, section=letter))]
    env = checkout_env()  # this checkout's benchmarks and twophase, wherever the command runs from
    # its own process group: at the limit the worker goes with what it started (train.py, torchrun's ranks)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=hasattr(os, "killpg"))
    try:
        stdout, stderr = proc.communicate(timeout=options["limit_s"])
    except subprocess.TimeoutExpired:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.communicate()
        return {"status": "timeout", "error": f"over the section's limit of {options['limit_s']:.0f} s",
                "seconds": round(time.perf_counter() - start, 3)}
    lines = [line for line in stdout.splitlines() if line.startswith(MARK)]
    if lines:
        return json.loads(lines[-1][len(MARK):])
    tail = (stderr.strip().splitlines() or [f"the worker exited with status {proc.returncode}"])[-1]
    return {"status": "error", "error": tail[:300], "seconds": round(time.perf_counter() - start, 3)}


def worker(options: dict) -> int:
    """--worker: one section in this process; its outcome as the last line of stdout."""
    outcome = run_here(options["section"], options)
    print(MARK + json.dumps(outcome, default=str), flush=True)
    return 0


def run_all(letters, options: dict, inline: bool, limits: dict, log=print, budget_s: float | None = None,
            done=lambda outcomes: None) -> dict:
    """Every section in order, each with its limit, cut to what is left of `budget_s` (seconds from this call;
    None: no budget); a section the budget no longer covers is skipped, saying so. `done(outcomes)` after each
    section (the report is rewritten there). Their outcomes by letter."""
    start = time.perf_counter()
    outcomes = {}
    for letter in letters:
        log(f"({letter}) {SECTIONS[letter][1]} ...", flush=True)
        limit = limits[letter]
        left = None if budget_s is None else budget_s - (time.perf_counter() - start)
        if left is not None and left < min(limit, LEAST_S):
            outcomes[letter] = {"status": "skipped", "seconds": 0.0,
                                "reason": f"not started: {max(left, 0):.0f} s of the {budget_s:.0f} s budget left"}
        else:
            cut = left is not None and left < limit
            opts = dict(options, limit_s=min(limit, left) if cut else limit)
            outcomes[letter] = (run_inline if inline else run_isolated)(letter, opts)
            if cut:
                outcomes[letter]["limit_cut_to_budget_s"] = round(opts["limit_s"], 1)
        log(f"    {outcomes[letter]['status']} in {outcomes[letter]['seconds']:.1f} s", flush=True)
        done(outcomes)
    return outcomes
