"""The router's side of a request: send it through a prefill worker and a
decode worker (or one colocated worker) and time every phase.

    RECEIVED ─▶ PREFILLING ─▶ TRANSFERRING ─▶ DECODING ─▶ FINISHED
        (or ABORTED when the client goes away, FAILED with a reason)

    prefill pool:  prefill() ─▶ PrefillResult                    (picks a prefill replica)
    decode pool:   generate(DecodeRequest) ─▶ ReadyToReceive      (picks a decode replica)
    prefill pool:  send_kv(result, ...)          (to the replica that holds the KV)
    decode pool:      ─▶ KVReceived ─▶ prefill pool: release(result)
                      ─▶ RequestOutput ... (streamed to the client)

A hand-off that fails before KVReceived (nothing streamed yet) is retried with a
new transfer id, steered away from the decode replica that failed; the prefill
side still holds the KV until the router releases it.

The pools are small interfaces: in a cluster they wrap Serve deployment
handles (router/serve_pools.py); in tests, plain worker objects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from cluster.serving.handoff import DecodeRequest, KVReceived, KVTransferFailed, PrefillResult, ReadyToReceive
from cluster.transport.kv_transport import PeerAddress
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from router.backend import BackendUnavailableError, GenerationBackend, ModelInfo
from router.timings import PhaseTimings

log = logging.getLogger(__name__)


class PrefillPool(Protocol):
    async def prefill(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams) -> PrefillResult: ...
    async def send_kv(self, result: PrefillResult, transfer_id: str, receivers: list[PeerAddress]) -> int: ...
    async def release(self, result: PrefillResult) -> None: ...
    async def check_health(self) -> None: ...


class DecodePool(Protocol):
    def generate(self, request: DecodeRequest, avoid_replica: str | None = None) -> AsyncIterator: ...
    async def check_health(self) -> None: ...


class ColocatedPool(Protocol):
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...
    async def check_health(self) -> None: ...


@dataclass(slots=True)
class _Phases:
    queue_s: float | None = None      # waiting in the prefill (or colocated) worker's queue
    prefill_s: float | None = None    # the prompt's forward pass(es) and the first token
    transfer_s: float | None = None   # ReadyToReceive → KV in the decode cache
    transfer_bytes: int | None = None

    def freeze(self) -> PhaseTimings:
        return PhaseTimings(queue_time=self.queue_s, prefill_time=self.prefill_s,
                            transfer_time=self.transfer_s, transfer_bytes=self.transfer_bytes)


class _TimedBackend(GenerationBackend):
    """A backend that records each request's phases while it runs."""

    def __init__(self, info: ModelInfo):
        self._info = info
        self._phases: dict[str, _Phases] = {}

    def model_info(self) -> ModelInfo:
        return self._info

    def phase_timings(self, request_id: str) -> PhaseTimings | None:
        """The phases of a finished request (popped: asked once, at the end)."""
        phases = self._phases.pop(request_id, None)
        return None if phases is None else phases.freeze()


class DisaggregatedBackend(_TimedBackend):
    """A failed hand-off (before any token was streamed) is retried once, on
    another decode replica when there is one; then the request fails with 503."""

    def __init__(self, info: ModelInfo, prefill: PrefillPool, decode: DecodePool, *,
                 max_transfer_attempts: int = 2):
        super().__init__(info)
        self._prefill, self._decode = prefill, decode
        self.max_transfer_attempts = max_transfer_attempts

    async def check_health(self) -> None:
        await self._prefill.check_health()
        await self._decode.check_health()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        phases = self._phases[request_id] = _Phases()
        result = await self._prefill.prefill(request_id, prompt_token_ids, params)
        phases.queue_s, phases.prefill_s = result.queue_time_s, result.prefill_time_s
        released = False
        avoid = None
        try:
            for attempt in range(1, self.max_transfer_attempts + 1):
                # a fresh transfer id per attempt; the prefill side still holds the KV
                request = DecodeRequest(request_id, prompt_token_ids, params, result, f"{request_id}#{attempt}")
                ready_at = None
                try:
                    async for event in self._decode.generate(request, avoid_replica=avoid):
                        if isinstance(event, ReadyToReceive):
                            ready_at, avoid = time.monotonic(), event.replica_id or None
                            phases.transfer_bytes = await self._send(result, event, request_id)
                        elif isinstance(event, KVReceived):
                            phases.transfer_s = time.monotonic() - (ready_at or time.monotonic())
                            released = True
                            await self._prefill.release(result)
                        else:
                            yield event
                    return
                except (KVTransferFailed, BackendUnavailableError) as exc:
                    # nothing has been streamed yet (tokens only come after KVReceived): safe to retry
                    if released or attempt == self.max_transfer_attempts:
                        raise BackendUnavailableError(str(exc)) from None
                    log.warning("KV hand-off of %s failed (%s); retrying on another decode worker", request_id, exc)
        finally:
            if not released:
                await self._prefill.release(result)

    async def _send(self, result: PrefillResult, ready: ReadyToReceive, request_id: str) -> int:
        try:
            return await self._prefill.send_kv(result, ready.transfer_id, ready.receivers)
        except (KeyError, RuntimeError) as exc:   # the hold expired, or the worker failed
            raise BackendUnavailableError(f"the prefill worker could not send the KV of {request_id}: {exc}") \
                from None


class ColocatedBackend(_TimedBackend):
    """Colocated mode: one worker prefills and decodes (no KV transfer)."""

    def __init__(self, info: ModelInfo, pool: ColocatedPool):
        super().__init__(info)
        self._pool = pool

    async def check_health(self) -> None:
        await self._pool.check_health()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        phases = self._phases[request_id] = _Phases()
        async for out in self._pool.generate(request_id, prompt_token_ids, params):
            if out.first_token_time is not None and phases.prefill_s is None:
                scheduled = out.first_scheduled_time or out.arrival_time
                phases.queue_s = scheduled - out.arrival_time
                phases.prefill_s = out.first_token_time - scheduled
            yield out
