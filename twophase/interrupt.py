"""Stopping cleanly on SIGINT / SIGTERM.

The first signal asks the run to stop after the current step (it then saves and exits 128 + signal: 130 for
SIGINT, 143 for SIGTERM); a second signal means "now" and exits at once, without saving.
"""
from __future__ import annotations

import os
import signal
import sys
import threading


class GracefulStop:
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.received is not None:
            sys.stderr.write(f"\nsignal {signum} again: exiting now without saving\n")
            os._exit(128 + signum)
        self.received = signum
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
