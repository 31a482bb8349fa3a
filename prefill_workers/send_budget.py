"""SendBudget: bounds the packed copies of KV that a prefill worker's sends in
flight hold on each rank (`kv_transfer.staging_mib`, the room its KV cache was
sized to leave free).

    fits(nbytes)                               whether a send of nbytes would go at once
    await acquire(transfer_id, nbytes, timeout_s)  waits while the sends in flight hold too much
    release(transfer_id)                       the send ended (done, failed or forgotten); any thread

A send that would pass the budget waits until earlier ones end; one with nothing
else in flight always goes, however large. Waiting sends go in the order they
came (a large one is not overtaken for ever by small ones), and each waits at
most its `timeout_s`: its receiver gives up on a transfer that sends nothing
for the transport's timeout, so a send that cannot start by then is refused
instead (TimeoutError), and the decode side tries elsewhere. A decode worker
bounds what it receives the same way, but a prefill worker serving several
decode workers would otherwise hold the sum of their budgets. A send forgotten
while on the wire still holds its copy until the wire is done: it is counted
until the forget, a short overlap the headroom beside the budget covers.
"""

from __future__ import annotations

import asyncio
from collections import deque


class SendBudget:
    def __init__(self, budget_bytes: int | None):
        """`budget_bytes`: on each rank; None for no bound. Event-loop side,
        except `release`."""
        self.budget_bytes = budget_bytes
        self._in_flight: dict[str, int] = {}   # transfer id -> bytes packed on the rank that packs most
        self._waiting: deque[tuple[str, int, asyncio.Future]] = deque()   # first come, first served
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def in_flight_bytes(self) -> int:
        return sum(self._in_flight.values())

    def fits(self, nbytes: int) -> bool:
        """Whether a send of `nbytes` would be counted at once (none waits before it)."""
        return not self._waiting and self._room_for(nbytes)

    async def acquire(self, transfer_id: str, nbytes: int, timeout_s: float | None = None) -> None:
        """Returns once `nbytes` more fit (or nothing else is in flight) and every
        send that came before has gone, counting them. Raises TimeoutError after
        `timeout_s` (None: no limit), counting nothing."""
        self._loop = asyncio.get_running_loop()
        if self.fits(nbytes):
            self._in_flight[transfer_id] = nbytes
            return
        granted = self._loop.create_future()
        entry = (transfer_id, nbytes, granted)
        self._waiting.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(granted), timeout_s)
        except BaseException as exc:
            if entry in self._waiting:
                self._waiting.remove(entry)
                self._grant()       # the sends behind it may fit now
            elif granted.done() and not granted.cancelled():   # counted just as it gave up
                self._release(transfer_id)
            if isinstance(exc, asyncio.TimeoutError):
                raise TimeoutError(f"{self.in_flight_bytes} bytes of KV sends are in flight on a budget of "
                                   f"{self.budget_bytes} and {len(self._waiting)} more wait; this send of "
                                   f"{nbytes} bytes could not start within {timeout_s:g} s") from None
            raise

    def release(self, transfer_id: str) -> None:
        """The send's copy is gone (idempotent; from any thread)."""
        if self._loop is None:
            return   # nothing was ever acquired
        try:
            self._loop.call_soon_threadsafe(self._release, transfer_id)
        except RuntimeError:   # the loop is closed: nobody waits any more
            pass

    def _room_for(self, nbytes: int) -> bool:
        return self.budget_bytes is None or not self._in_flight or \
            self.in_flight_bytes + nbytes <= self.budget_bytes

    def _release(self, transfer_id: str) -> None:
        if self._in_flight.pop(transfer_id, None) is not None:
            self._grant()

    def _grant(self) -> None:
        """Counts the waiting sends at the head of the queue that fit now."""
        while self._waiting and self._room_for(self._waiting[0][1]):
            transfer_id, nbytes, granted = self._waiting.popleft()
            self._in_flight[transfer_id] = nbytes
            granted.set_result(None)
