"""Stopping cleanly on SIGINT / SIGTERM.

The first signal asks the run to stop after the current step (it then saves and exits 128 + signal: 130 for
SIGINT, 143 for SIGTERM); a second signal means "now" and exits at once, without saving.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time


class GracefulStop:
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, repeats_within: float = 0.0):
        """repeats_within: seconds after the first signal during which the same signal again is a copy, not a
        second request. Under torchrun a Ctrl-C reaches every worker twice (from the terminal, and forwarded by
        the launcher), which must not count as "now"."""
        self.received: int | None = None
        self.repeats_within = repeats_within
        self._first_at = 0.0
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.received == signum and time.monotonic() - self._first_at < self.repeats_within:
            return
        if self.received is not None:
            sys.stderr.write(f"\nsignal {signum} again: exiting now without saving\n")
            os._exit(128 + signum)
        self.received, self._first_at = signum, time.monotonic()
        sys.stderr.write(f"\nsignal {signum}: finishing the current step, then saving (send again to exit now)\n")

    def __enter__(self) -> "GracefulStop":
        # Handlers can only be installed from the main thread (e.g. not inside some test runners' workers).
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or 0)


class Interrupted(Exception):
    """The run stopped early on purpose (signal) or by necessity (too many bad steps); carries the exit code."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
