"""Stopping long jobs on SIGTERM/SIGINT (preemption, Ctrl-C) at a safe point."""

from __future__ import annotations

import signal
import threading

from .errors import LogitDistillError


class Interrupted(LogitDistillError):
    """A job stopped on a signal after saving what it could; the same command resumes it."""


class SignalInterrupt(KeyboardInterrupt):
    """SIGINT or SIGTERM outside a job's safe points: the command ends like on Ctrl-C (exit 130)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class StopOnSignal:
    """While active, SIGTERM/SIGINT set ``event`` instead of killing the process.

    The job checks ``event`` between steps, saves its state and raises
    ``Interrupted``. Outside the main thread (where handlers cannot be set)
    it is inert. The previous handlers come back on exit.
    """

    def __init__(self):
        self.event = threading.Event()
        self.signum = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        self.event.set()

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
