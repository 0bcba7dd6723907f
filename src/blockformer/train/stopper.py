"""SIGINT and SIGTERM as a request to stop after the current step (a second Ctrl-C stops at once)."""

from __future__ import annotations

import signal
import threading
from typing import Any


class Stopper:
    """Installs its handlers in the main thread for the ``with`` block; elsewhere it never fires."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: int | None = None  # the signal that asked to stop
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.signal = signum

    def __enter__(self) -> "Stopper":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
