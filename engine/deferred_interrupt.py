"""Ctrl-C held back while the engine's bookkeeping must run whole.

A step's read-back appends each row's token to its sequence, detokenizes it,
makes its output and frees a finished sequence's blocks: a KeyboardInterrupt
landing between two of those left a token appended twice (the sequence then
diverged from its output) or a finished sequence's blocks never freed. Within
`interrupts_deferred()` a SIGINT only sets a flag; KeyboardInterrupt is raised
when the block ends, with the bookkeeping whole. Waits (for a step's samples)
stay outside it, so Ctrl-C still stops them at once.

Only where Python delivers SIGINT (the main thread) and only while its default
handler is installed: a program with its own handler keeps it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Runs the block with SIGINT held back; raises KeyboardInterrupt after it when one came."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt
