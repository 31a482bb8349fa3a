"""A stop request from SIGINT or SIGTERM, for a command that serves until told to stop.

The handler only assigns a flag, which the command polls (and reads a clock,
which takes no lock). It must not take a
lock: Python runs a handler on the main thread between bytecodes, so a signal
that arrives while an earlier handler is inside `threading.Event.set` runs a
second `set` that waits for the lock the first one holds, for ever (Ctrl-C
pressed twice, a terminal's INT followed by a supervisor's TERM); the process
then ignores every later signal too. Printing from a handler has the same
problem (a buffered stream's lock).
"""

from __future__ import annotations

import os
import signal
import time

# a further signal this long after the first ends the process even before force_on_next(): the
# command may be stuck in a call to the cluster that never returns (a hung controller), where
# it would never look at the flag again
FORCE_AFTER_S = 10.0


class StopSignal:
    """`install()` makes SIGINT and SIGTERM set `requested`; nothing else runs in the
    handler, but for os._exit on a further signal once `force_on_next()` was called,
    or FORCE_AFTER_S after the first."""

    def __init__(self, clock=time.monotonic) -> None:
        self.requested = False
        self.signum: int | None = None      # the last signal received
        self._force = False                 # force_on_next() was called
        self._clock = clock
        self._first_at: float | None = None

    def install(self) -> "StopSignal":
        """Main thread only (Python's rule for signal handlers)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def force_on_next(self) -> None:
        """From now on a signal after the first ends the process at once (128 + its
        number), as uvicorn and vLLM do on a second Ctrl-C: for a clean-up that waits
        on the cluster. os._exit takes no lock, so it is safe in a handler."""
        self._force = True

    def _handle(self, signum: int, frame) -> None:
        if self.requested and (self._force or self._clock() - self._first_at >= FORCE_AFTER_S):
            os._exit(128 + signum)
        if self._first_at is None:
            self._first_at = self._clock()
        self.requested = True
        self.signum = signum
