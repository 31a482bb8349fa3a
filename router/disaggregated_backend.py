"""The router's side of a request: send it through a prefill worker and a
decode worker (or one colocated worker) and time every phase.

    RECEIVED ─▶ PREFILLING ─▶ TRANSFERRING ─▶ DECODING ─▶ FINISHED
        (or ABORTED when the client goes away, FAILED with a reason)

    prefill pool:  prefill() ─▶ PrefillResult                    (picks a prefill replica)
    decode pool:   generate(DecodeRequest) ─▶ ReadyToReceive      (picks a decode replica)
    prefill pool:  send_kv(result, ...)          (to the replica that holds the KV)
    decode pool:      ─▶ KVReceived ─▶ prefill pool: release(result)
                      ─▶ RequestOutput ... (streamed to the client)

The pools are small interfaces: in a cluster they wrap Serve deployment
handles (router/serve_pools.py); in tests, plain worker objects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from cluster.handoff import DecodeRequest, KVReceived, KVTransferFailed, PrefillResult, ReadyToReceive
from cluster.kv_transport import PeerAddress
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
    def generate(self, request: DecodeRequest) -> AsyncIterator: ...
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
    def __init__(self, info: ModelInfo, prefill: PrefillPool, decode: DecodePool):
        super().__init__(info)
        self._prefill, self._decode = prefill, decode

    async def check_health(self) -> None:
        await self._prefill.check_health()
        await self._decode.check_health()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        phases = self._phases[request_id] = _Phases()
        result = await self._prefill.prefill(request_id, prompt_token_ids, params)
        phases.queue_s, phases.prefill_s = result.queue_time_s, result.prefill_time_s
        released = False
        try:
            request = DecodeRequest(request_id, prompt_token_ids, params, result)
            ready_at = None
            async for event in self._decode.generate(request):
                if isinstance(event, ReadyToReceive):
                    ready_at = time.monotonic()
                    try:
                        phases.transfer_bytes = await self._prefill.send_kv(result, event.transfer_id,
                                                                            event.receivers)
                    except (KeyError, RuntimeError) as exc:   # the hold expired, or the worker failed
                        raise BackendUnavailableError(f"the prefill worker could not send the KV of "
                                                      f"{request_id}: {exc}") from None
                elif isinstance(event, KVReceived):
                    phases.transfer_s = time.monotonic() - (ready_at or time.monotonic())
                    released = True
                    await self._prefill.release(result)
                else:
                    yield event
        except KVTransferFailed as exc:
            raise BackendUnavailableError(str(exc)) from None
        finally:
            if not released:
                await self._prefill.release(result)


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
