"""Calls that must outlive the Serve request that makes them.

Ray Serve cancels the calls a request made that still wait for a replica
when that request is cancelled (its client left). The clean-up a request
does *because* its client left (release the KV a prefill replica holds,
abort the request on a decode replica) would be cancelled along with it and
never arrive. Made from an empty context, such a call has no parent request
and always goes out.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def detached(make_call: Callable[[], T]) -> T:
    """Runs `make_call` (which issues a Serve handle call and returns its
    response) outside the current request's context."""
    return contextvars.Context().run(make_call)
