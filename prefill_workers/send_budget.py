"""SendBudget: bounds the packed copies of KV that a prefill worker's sends in
flight hold on each rank (`kv_transfer.staging_mib`, the room its KV cache was
sized to leave free).

    await acquire(transfer_id, nbytes)   waits while the sends in flight hold too much
    release(transfer_id)                 the send ended (done, failed or forgotten); any thread

A send that would pass the budget waits until earlier ones end; one with nothing
else in flight always goes, however large. A decode worker bounds what it
receives the same way, but a prefill worker serving several decode workers
would otherwise hold the sum of their budgets. A send forgotten while on the
wire still holds its copy until the wire is done: it is counted until the
forget, a short overlap the headroom beside the budget covers.
"""

from __future__ import annotations

import asyncio


class SendBudget:
    def __init__(self, budget_bytes: int | None):
        """`budget_bytes`: on each rank; None for no bound. Event-loop side,
        except `release`."""
        self.budget_bytes = budget_bytes
        self._in_flight: dict[str, int] = {}   # transfer id -> bytes packed on the rank that packs most
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def in_flight_bytes(self) -> int:
        return sum(self._in_flight.values())

    async def acquire(self, transfer_id: str, nbytes: int) -> None:
        """Returns once `nbytes` more fit (or nothing else is in flight), counting them."""
        self._loop = asyncio.get_running_loop()
        while self.budget_bytes is not None and self._in_flight and \
                self.in_flight_bytes + nbytes > self.budget_bytes:
            self._changed.clear()
            await self._changed.wait()
        self._in_flight[transfer_id] = nbytes

    def release(self, transfer_id: str) -> None:
        """The send's copy is gone (idempotent; from any thread)."""
        if self._loop is None:
            return   # nothing was ever acquired
        try:
            self._loop.call_soon_threadsafe(self._release, transfer_id)
        except RuntimeError:   # the loop is closed: nobody waits any more
            pass

    def _release(self, transfer_id: str) -> None:
        if self._in_flight.pop(transfer_id, None) is not None:
            self._changed.set()
