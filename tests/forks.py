"""Programs run each in a fresh interpreter without paying for torch's import each time: one server process imports
torch and twophase once, then forks a child per program, as `python -c CODE` (or `python SCRIPT ARGS`, `python -m
MODULE ARGS`) would run it: its own working directory, sys.argv and sys.path[0], stdin, its exit status, its stdout
and stderr apart. A child starts from a process that has done nothing but those imports: what one program does (its
imports, seeds, files, global settings) never reaches the next.

    proc = forks.run(code, cwd=tmp_path, timeout=120)   # .returncode, .stdout, .stderr, as subprocess.run's
    proc = forks.run(argv=["train.py", "--help"], cwd=ROOT)  # python SCRIPT ARGS; ["-m", MODULE, ARGS] too
    child = forks.spawn(argv=[...]); os.kill(child.pid, signal.SIGTERM); proc = child.wait(timeout=120)

One server per test process (started on first use, with this checkout on PYTHONPATH, one CPU thread and the Hugging
Face hub offline); it ends with the process that started it (its stdin closes).
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]

# The server: reads a request per line ({"code" or "argv", "cwd", "env", "input", "out", "err"}), forks, answers
# {"pid"} then {"status"}.
SERVER = r'''
import atexit, json, os, runpy, sys, traceback
import torch, twophase  # noqa: F401 (the imports every child starts with)

def child(request):
    os.chdir(request["cwd"])
    for name, value in request["env"].items():  # the program's own environment: set, or unset where None
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    for fd, path in ((1, request["out"]), (2, request["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    stdin = os.open(request["input"] or os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    sys.stdin = os.fdopen(0, "r")
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    argv = request["argv"]
    status = 0
    try:
        if argv is None:  # python -c CODE: the working directory first on the path
            sys.argv, sys.path[0] = ["-c"], ""
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[0] == "-m":  # python -m MODULE ARGS: the working directory first
            sys.argv, sys.path[0] = ["-m", *argv[2:]], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # python SCRIPT ARGS: the script's folder first
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if not isinstance(code, (int, type(None))):
            print(code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)

answers = os.fdopen(os.dup(1), "w", buffering=1)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    answers.write(json.dumps({"pid": pid}) + "\n")
    _, wait_status = os.waitpid(pid, 0)
    answers.write(json.dumps({"status": os.waitstatus_to_exitcode(wait_status)}) + "\n")
'''

_server = None


_unread = b""  # what the server answered beyond the last line read


def _start():
    global _unread
    _unread = b""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1")
    return subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                            text=True, bufsize=1, cwd=tempfile.gettempdir())


def _answer(server, timeout: float) -> dict:
    """The server's next line, read from its pipe unbuffered (select sees what a buffer would hide)."""
    global _unread
    fd = server.stdout.fileno()
    while b"\n" not in _unread:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            raise TimeoutError
        data = os.read(fd, 65536)
        if not data:
            raise RuntimeError(f"tests/forks.py: the server exited with status {server.wait()}")
        _unread += data
    line, _unread = _unread.split(b"\n", 1)
    return json.loads(line)


def run(code: str | None = None, cwd=None, timeout: float = 120, argv: list | None = None,
        input: str | None = None, env: dict | None = None) -> SimpleNamespace:
    """`python -c code`, or `python *argv` (a script and its arguments, or "-m", a module and its), from `cwd`
    (default: this process's working directory) with `input` on stdin and `env`'s variables set (None: unset) over
    the server's environment, in a child of the server: returncode, stdout, stderr."""
    return spawn(code, cwd, argv, input, env).wait(timeout)


class Spawned:
    """A program the server forked and has not reported on yet: its `pid` (to signal it), `wait()` its result."""

    def __init__(self, pid: int, outputs: str, shown: list):
        self.pid, self._outputs, self._shown = pid, outputs, shown

    def wait(self, timeout: float = 120) -> SimpleNamespace:
        try:
            try:
                status = _answer(_server, timeout)["status"]
            except TimeoutError:
                os.kill(self.pid, signal.SIGKILL)
                _answer(_server, 60)
                raise subprocess.TimeoutExpired(["python", *self._shown], timeout) from None
            out, err = (Path(self._outputs) / name for name in ("stdout", "stderr"))
            return SimpleNamespace(returncode=status, stdout=out.read_text(errors="replace"),
                                   stderr=err.read_text(errors="replace"))
        finally:
            shutil.rmtree(self._outputs, ignore_errors=True)


def spawn(code: str | None = None, cwd=None, argv: list | None = None, input: str | None = None,
          env: dict | None = None) -> Spawned:
    """As `run`, without waiting for the program to end: the server runs one program at a time, so wait for this
    one (`Spawned.wait`) before the next `run` or `spawn`."""
    global _server
    if _server is None or _server.poll() is not None:
        _server = _start()
    outputs = tempfile.mkdtemp()
    out, err, given = (Path(outputs) / name for name in ("stdout", "stderr", "stdin"))
    if input is not None:
        given.write_text(input)
    request = {"code": code, "argv": None if argv is None else [str(a) for a in argv],
               "cwd": os.path.abspath(cwd or os.getcwd()), "env": env or {},
               "input": str(given) if input is not None else None, "out": str(out), "err": str(err)}
    _server.stdin.write(json.dumps(request) + "\n")
    pid = _answer(_server, 600)["pid"]  # the first request waits for the server's imports
    return Spawned(pid, outputs, argv or ["-c", code])
