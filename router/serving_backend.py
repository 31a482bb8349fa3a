"""The router's side of a request: prefill it (on a prefill replica, or on the
decode replica itself), stream its tokens from a decode replica, and time every
phase.

    RECEIVED ─▶ PREFILLING ─▶ (first token to the client) ─▶ TRANSFERRING ─▶ DECODING ─▶ FINISHED
        (or ABORTED when the client goes away, FAILED with a reason)

    remote prefill:  prefill pool  prefill()           ─▶ PrefillResult: the first token, streamed at once
                     decode pool   generate(request)   ─▶ Admitted (the decode replica asked the prefill
                                                          replica for the KV and released it)
    local prefill:   decode pool   generate(request)   ─▶ Admitted (prefill runs in the decode batch)
    then:            the decode replica's output stream ─▶ TokenDelta per step (router/stream_fanout.py)

Two remote calls per request (prefill, generate) plus the shared output
streams. A hand-off that fails (nothing after the first token has been
streamed yet) is retried with a new transfer id, steered away from the decode
replica that failed; the prefill side still holds the KV until a decode replica
or this router releases it. In colocated mode there is no prefill pool and every
request is prefilled locally.

The pools are small interfaces: in a cluster they wrap Serve deployment
handles (router/serve_pools.py); in tests, plain worker objects.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

from cluster.serving.messages import (
    Admitted,
    DecodeRequest,
    KVTransferFailed,
    PrefillResult,
    TokenDelta,
)
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from router.backend import BackendUnavailableError, GenerationBackend, ModelInfo
from router.disaggregation_policy import DisaggregationPolicy
from router.stream_fanout import StreamFanout
from router.timings import PhaseTimings

log = logging.getLogger(__name__)


class PrefillPool(Protocol):
    async def prefill(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams) -> PrefillResult: ...
    def release(self, result: PrefillResult) -> None: ...
    async def check_health(self) -> None: ...


class DecodePool(Protocol):
    async def generate(self, request: DecodeRequest, avoid_replica: str | None = None) -> Admitted: ...
    async def abort(self, replica_id: str, request_id: str) -> None: ...
    def stream(self, replica_id: str, subscriber: str) -> AsyncIterator[list[TokenDelta]]: ...
    async def check_health(self) -> None: ...


@dataclass(slots=True)
class _Phases:
    queue_s: float | None = None      # waiting in the worker's queue before the prompt ran
    prefill_s: float | None = None    # the prompt's forward pass(es) and the first token
    transfer_s: float | None = None   # receives posted → KV in the decode cache
    transfer_bytes: int | None = None
    prefilled_on: str | None = None   # "prefill" | "decode"

    def freeze(self) -> PhaseTimings:
        return PhaseTimings(queue_time=self.queue_s, prefill_time=self.prefill_s,
                            transfer_time=self.transfer_s, transfer_bytes=self.transfer_bytes,
                            prefilled_on=self.prefilled_on)

    def first_token(self, delta: TokenDelta) -> None:
        if delta.first_token_times is not None and self.prefill_s is None:
            self.queue_s, self.prefill_s = delta.first_token_times.queue_s, delta.first_token_times.prefill_s


class _Accumulator:
    """Cumulative RequestOutputs (what the HTTP layer reads) from deltas; each
    output is a new object the caller may keep."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list | None = None
        self.num_cached_tokens = 0

    def add(self, delta: TokenDelta) -> RequestOutput:
        self.token_ids += delta.token_ids
        self.text += delta.text
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids, text=self.text,
            token_ids=list(self.token_ids), delta_text=delta.text, delta_token_ids=list(delta.token_ids),
            logprobs=None if self.logprobs is None else list(self.logprobs), finished=delta.finished,
            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
            num_cached_tokens=self.num_cached_tokens)


class ServingBackend(GenerationBackend):
    def __init__(self, info: ModelInfo, decode: DecodePool, prefill: PrefillPool | None = None,
                 policy: DisaggregationPolicy | None = None, *, subscriber: str,
                 max_transfer_attempts: int = 2):
        """Without `prefill` (colocated mode) every request is prefilled on its
        decode replica; with it, `policy` decides per request (default: always
        remote). `subscriber` names this router's output streams."""
        self._info = info
        self._decode, self._prefill, self._policy = decode, prefill, policy
        self.subscriber = subscriber
        self.max_transfer_attempts = max_transfer_attempts
        self._fanout = StreamFanout(lambda replica: decode.stream(replica, subscriber), decode.abort)
        self._phases: dict[str, _Phases] = {}

    def model_info(self) -> ModelInfo:
        return self._info

    def phase_timings(self, request_id: str) -> PhaseTimings | None:
        """The phases of a finished request (popped: asked once, at the end)."""
        phases = self._phases.pop(request_id, None)
        return None if phases is None else phases.freeze()

    async def check_health(self) -> None:
        if self._prefill is not None:
            await self._prefill.check_health()
        await self._decode.check_health()

    async def close(self) -> None:
        await self._fanout.close()

    def _local(self, num_prompt_tokens: int) -> bool:
        if self._prefill is None:
            return True
        return self._policy is not None and self._policy.prefill_locally(num_prompt_tokens)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        phases = self._phases[request_id] = _Phases()
        acc = _Accumulator(request_id, prompt_token_ids)
        queue = self._fanout.expect(request_id)
        replica, finished = None, False
        try:
            if self._local(len(prompt_token_ids)):
                phases.prefilled_on = "decode"
                admitted = await self._prefill_locally(request_id, prompt_token_ids, params)
            else:
                phases.prefilled_on = "prefill"
                result = await self._prefill_remotely(request_id, prompt_token_ids, params)
                phases.first_token(result.first)
                finished = result.first.finished
                yield acc.add(result.first)
                if finished:
                    return
                admitted = await self._hand_off(request_id, prompt_token_ids, params, result)
                phases.transfer_s, phases.transfer_bytes = admitted.transfer_time_s, admitted.transfer_bytes
            replica = admitted.replica_id
            self._fanout.bind(request_id, replica)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                phases.first_token(item)
                finished = item.finished
                yield acc.add(item)
        finally:
            self._fanout.forget(request_id)
            if replica is not None and not finished:
                await _shielded(self._decode.abort(replica, request_id), f"abort of {request_id}")

    async def _prefill_locally(self, request_id: str, prompt_token_ids: list[int],
                               params: SamplingParams) -> Admitted:
        # in flight until admitted: close enough, the prompt is queued on the replica by then
        with self._in_flight(True, len(prompt_token_ids)):
            return await self._decode.generate(DecodeRequest(request_id, prompt_token_ids, params, self.subscriber))

    async def _prefill_remotely(self, request_id: str, prompt_token_ids: list[int],
                                params: SamplingParams) -> PrefillResult:
        with self._in_flight(False, len(prompt_token_ids)):
            return await self._prefill.prefill(request_id, prompt_token_ids, params)

    def _in_flight(self, local: bool, num_prompt_tokens: int):
        """The policy's count of prompt tokens in flight (nothing to count without a policy)."""
        return nullcontext() if self._policy is None else self._policy.in_flight(local, num_prompt_tokens)

    async def _hand_off(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        result: PrefillResult) -> Admitted:
        """A decode replica takes the request and its KV (it releases the
        prefill hold on success); retried once elsewhere on failure."""
        avoid = None
        admitted = False
        try:
            for attempt in range(1, self.max_transfer_attempts + 1):
                # a fresh transfer id per attempt; the prefill side still holds the KV
                request = DecodeRequest(request_id, prompt_token_ids, params, self.subscriber, result,
                                        f"{request_id}#{attempt}")
                try:
                    done = await self._decode.generate(request, avoid_replica=avoid)
                    admitted = True
                    if self._policy is not None and done.transfer_time_s is not None:
                        self._policy.observe_handoff(done.transfer_time_s)
                    return done
                except (KVTransferFailed, BackendUnavailableError, TimeoutError) as exc:
                    if attempt == self.max_transfer_attempts:
                        raise BackendUnavailableError(str(exc)) from None
                    avoid = getattr(exc, "replica_id", None) or None
                    log.warning("KV hand-off of %s failed (%s); retrying on another decode worker", request_id, exc)
            raise AssertionError("unreachable")
        finally:
            if not admitted:
                self._prefill.release(result)


async def _shielded(work, what: str) -> None:
    """Clean-up that runs to the end even when the caller is being cancelled."""
    try:
        await asyncio.shield(work)
    except Exception as exc:  # noqa: BLE001 - the response is decided by now
        log.debug("%s failed: %s", what, exc)
