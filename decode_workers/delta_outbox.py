"""One subscriber's (one router's) outputs from a decode worker, batched.

    engine thread:  put(step's outputs of this subscriber's requests) ─▶ pending deltas
    asyncio reader: take() ─▶ everything pending, as one list (one Ray message)

A reader that falls behind gets several steps in one batch (still one delta per
request), so a busy router receives fewer, larger messages instead of one per
token. Only deltas cross the
process boundary: new token ids, new text, new logprobs.

Stream batching (`min_interval_s`, Ray Serve LLM's and vLLM's stream interval):
a batch of mid-stream tokens waits until `min_interval_s` after the previous
one, gathering the steps in between. A request's first delta from this worker
(its first token, or on a decode replica the first after the prefilled one) and
a finished request go at once, so time to first token, the gap after it and
end-to-end latency do not change; what it
saves is a message per engine step when steps are short (each costs the
router and this replica CPU that a small machine's engine would otherwise use).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

from cluster.serving.messages import TokenDelta
from engine.outputs import RequestOutput


class DeltaOutbox:
    def __init__(self, min_interval_s: float = 0.0) -> None:
        """Create on the event loop that will read it."""
        self.min_interval_s = min_interval_s   # the reader's; 0: a batch per engine step
        self._last_take = float("-inf")        # monotonic time of the last batch taken
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._pending: dict[str, TokenDelta] = {}   # request id -> its delta since the last take
        self._urgent = False                        # a pending delta must not wait for the interval
        self._failure: BaseException | None = None
        self._ready = asyncio.Event()
        self._streaming: set[str] = set()           # engine thread only: requests with a delta put

    # ---- engine thread (OutputSink) ----------------------------------------------------------
    def put(self, outputs: list[RequestOutput]) -> None:
        deltas, urgent = [], False
        for out in outputs:
            delta = TokenDelta.from_output(out)
            urgent = urgent or is_urgent(delta) or out.request_id not in self._streaming
            if out.finished:
                self._streaming.discard(out.request_id)
            else:
                self._streaming.add(out.request_id)
            deltas.append(delta)
        with self._lock:
            # a reader holding tokens back for the interval wakes for an urgent one
            wake = not self._pending or urgent
            self._urgent = self._urgent or urgent
            for delta in deltas:   # one entry per request: a request that produced again is merged
                earlier = self._pending.get(delta.request_id)
                self._pending[delta.request_id] = delta if earlier is None else merge(earlier, delta)
        if wake:
            self._loop.call_soon_threadsafe(self._ready.set)

    def forget(self, request_id: str) -> None:
        """Engine thread: a request that ends without a last delta here (detached, then aborted)."""
        self._streaming.discard(request_id)

    def fail(self, exc: BaseException) -> None:
        self._failure = exc
        self._loop.call_soon_threadsafe(self._ready.set)

    # ---- event loop --------------------------------------------------------------------------------
    async def take(self) -> list[TokenDelta]:
        """Waits for at least one delta and returns all pending ones, one per
        request, no sooner than `min_interval_s` after the previous batch unless
        one of them is urgent (a request's first delta here, a finish); raises what the engine
        failed with once nothing is left."""
        while True:
            if self._batching_wait_s() > 0:
                self._ready.clear()   # then look again: a put after this look sets it
                wait_s = self._batching_wait_s()
                if wait_s > 0:
                    try:
                        await asyncio.wait_for(self._ready.wait(), wait_s)
                    except asyncio.TimeoutError:
                        pass
                    continue
            with self._lock:
                batch, self._pending, self._urgent = list(self._pending.values()), {}, False
            if batch:
                self._last_take = time.monotonic()
                return batch
            if self._failure is not None:
                raise self._failure
            self._ready.clear()
            with self._lock:
                if self._pending:
                    continue
            await self._ready.wait()

    def _batching_wait_s(self) -> float:
        """How long pending deltas should wait to be batched with later steps' (0: take them now)."""
        if self.min_interval_s <= 0 or self._failure is not None:
            return 0.0
        with self._lock:
            if not self._pending or self._urgent:
                return 0.0
        return self._last_take + self.min_interval_s - time.monotonic()


def is_urgent(delta: TokenDelta) -> bool:
    """A delta stream batching never holds back: a request's first token (its
    TTFT) or its end."""
    return delta.finished or delta.first_token_times is not None


def merge(earlier: TokenDelta, later: TokenDelta) -> TokenDelta:
    """One delta covering two consecutive ones of the same request."""
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = (earlier.logprobs or []) + (later.logprobs or [])
    return dataclasses.replace(
        later, token_ids=earlier.token_ids + later.token_ids, text=earlier.text + later.text, logprobs=logprobs,
        num_cached_tokens=max(earlier.num_cached_tokens, later.num_cached_tokens),
        first_token_times=earlier.first_token_times or later.first_token_times,
        prompt_logprobs=earlier.prompt_logprobs or later.prompt_logprobs)
