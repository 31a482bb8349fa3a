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

Migration: when a worker dies or its stream breaks mid-request (before or
after the hand-off), the request continues on another decode replica: the
prompt plus every token already streamed is prefilled there (under a new
internal id, so a late delta of the failed attempt is not taken for the new
one) and the stream resumes with the next token; the client sees one stream.
The new replica takes the streamed tokens as the request's own output
(engine.outputs.ResumedOutput): a stop string may span the failure point,
penalties and max_tokens count them, a seeded generator continues where it
was, and text the failed worker held back (a partial stop string, bytes of a
character) is sent. Output is the same as without the failure. At most
`max_migrations` per request; past it the error says so.

The pools are small interfaces: in a cluster they wrap Serve deployment
handles (router/serve_pools.py); in tests, plain worker objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

from cluster.serving.messages import (
    Admitted,
    DecodeRequest,
    KVHolderLost,
    KVTransferFailed,
    PrefillResult,
    TokenDelta,
)
from engine.errors import RequestIdInUse
from engine.outputs import RequestOutput, ResumedOutput
from engine.sampling_params import SamplingParams
from router.backend import BackendUnavailableError, GenerationBackend, ModelInfo
from router.disaggregation_policy import DisaggregationPolicy
from router.stream_fanout import StreamFanout
from router.timings import PhaseTimings

log = logging.getLogger(__name__)

# how long a request's end waits for the abort of its copy on a replica (the abort goes on past it)
ABORT_WAIT_S = 5.0


class PrefillPool(Protocol):
    async def prefill(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams) -> PrefillResult: ...
    def release(self, result: PrefillResult) -> None: ...
    def abort_everywhere(self, request_id: str) -> None:
        """Every replica drops `request_id` and the KV it holds for it (in the background)."""
    async def check_health(self) -> None: ...


class DecodePool(Protocol):
    async def generate(self, request: DecodeRequest, avoid_replica: str | None = None) -> Admitted: ...
    async def abort(self, replica_id: str, request_id: str) -> None: ...
    def abort_everywhere(self, request_id: str) -> None:
        """Every replica drops `request_id` (in the background; unknown ids are a no-op)."""
    def stream(self, replica_id: str, subscriber: str) -> AsyncIterator[list[TokenDelta]]: ...
    async def check_health(self) -> None: ...


@dataclass(slots=True)
class _Phases:
    queue_s: float | None = None      # waiting in the worker's queue before the prompt ran
    prefill_s: float | None = None    # the prompt's forward pass(es) and the first token
    reserve_s: float | None = None    # the decode worker waiting for free KV blocks
    transfer_s: float | None = None   # receives posted → KV in the decode cache
    transfer_bytes: int | None = None
    prefilled_on: str | None = None   # "prefill" | "decode"
    migrations: int = 0

    def freeze(self) -> PhaseTimings:
        return PhaseTimings(queue_time=self.queue_s, prefill_time=self.prefill_s, reserve_time=self.reserve_s,
                            transfer_time=self.transfer_s, transfer_bytes=self.transfer_bytes,
                            prefilled_on=self.prefilled_on, migrations=self.migrations)

    def first_token(self, delta: TokenDelta) -> None:
        if delta.first_token_times is not None and self.prefill_s is None:
            self.queue_s, self.prefill_s = delta.first_token_times.queue_s, delta.first_token_times.prefill_s


class _Accumulator:
    """A request's output so far, kept for a migration, and the RequestOutputs
    the HTTP layer reads: deltas (engine.outputs.OutputKind.DELTA), so that a
    token costs the router the same however long the output already is."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.token_ids: list[int] = []
        self.num_chars = 0                  # characters of text streamed
        self.logprobs: list | None = None
        self.num_cached_tokens = 0

    def resumed(self) -> ResumedOutput:
        """What a worker that continues this request must know of its output so far."""
        return ResumedOutput(list(self.token_ids), self.num_chars,
                             None if self.logprobs is None else list(self.logprobs))

    def add(self, delta: TokenDelta) -> RequestOutput:
        self.token_ids += delta.token_ids
        self.num_chars += len(delta.text)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids, text=delta.text,
            token_ids=delta.token_ids, delta_text=delta.text, delta_token_ids=delta.token_ids,
            logprobs=delta.logprobs, finished=delta.finished, finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason, num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=len(self.token_ids), prompt_logprobs=delta.prompt_logprobs)


class ServingBackend(GenerationBackend):
    def __init__(self, info: ModelInfo, decode: DecodePool, prefill: PrefillPool | None = None,
                 policy: DisaggregationPolicy | None = None, *, subscriber: str,
                 max_transfer_attempts: int = 2, max_migrations: int = 3):
        """Without `prefill` (colocated mode) every request is prefilled on its
        decode replica; with it, `policy` decides per request (default: always
        remote). `subscriber` names this router's output streams (unique per router)."""
        self._info = info
        self._decode, self._prefill, self._policy = decode, prefill, policy
        self.max_transfer_attempts = max_transfer_attempts
        self.max_migrations = max_migrations
        self._fanout = StreamFanout(decode.stream, decode.abort, subscriber)
        self._phases: dict[str, _Phases] = {}
        self._running: dict[str, _Accumulator] = {}   # requests under way, by id

    def mean_running_output_tokens(self) -> float | None:
        """The mean output tokens so far of the requests under way (None: none): a
        lower bound of their output lengths, which shows outputs getting longer
        before any of them ends (the autoscaler reads it)."""
        running = list(self._running.values())
        return sum(len(acc.token_ids) for acc in running) / len(running) if running else None

    def model_info(self) -> ModelInfo:
        return self._info

    def phase_timings(self, request_id: str) -> PhaseTimings | None:
        """The phases of a finished request (popped: asked once, at the end)."""
        phases = self._phases.pop(request_id, None)
        return None if phases is None else phases.freeze()

    async def check_health(self) -> None:
        """Raises unless a decode (or colocated) replica answers: with no prefill
        replica running, prompts are prefilled on the decode replicas."""
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
        acc = self._running[request_id] = _Accumulator(request_id, prompt_token_ids)
        failed_on: list[str | None] = [None]        # the replica the last attempt failed on
        try:
            for migration in range(self.max_migrations + 1):
                try:
                    # aclosing: a client that leaves runs the attempt's clean-up now, not when it is collected
                    async with contextlib.aclosing(self._attempt(request_id, migration, acc, params, phases,
                                                                 failed_on)) as attempt:
                        async for out in attempt:
                            yield out
                    return
                except BackendUnavailableError as exc:
                    failed_on[0] = exc.replica_id or failed_on[0]   # the next attempt avoids it
                    if self._fanout.closed:      # the router is going away: nothing to move the request to
                        raise
                    if migration == self.max_migrations:
                        why = ("migration is off (max_migrations: 0)" if migration == 0 else
                               f"the request was already moved to another worker {migration} time(s), the "
                               "limit (max_migrations)")
                        raise BackendUnavailableError(f"{exc}; {why}", reason=f"the worker serving the request "
                                                      f"failed, and {why}") from None
                    log.warning("request %s: its worker failed after %d output tokens (%s); continuing it on "
                                "another decode worker", request_id, len(acc.token_ids), exc)
                    phases.migrations += 1
        finally:
            self._running.pop(request_id, None)

    async def _attempt(self, request_id: str, migration: int, acc: _Accumulator, params: SamplingParams,
                       phases: _Phases, failed_on: list[str | None]) -> AsyncIterator[RequestOutput]:
        """One try at the request. The first prefills where the policy says; a
        migration (a worker died or its stream broke) prefills the prompt plus
        every token already sent on a decode replica other than the one that
        failed, under a new internal id, and continues the stream from there."""
        attempt_id = request_id if migration == 0 else f"{request_id}~{migration}"
        prompt = acc.prompt_token_ids
        resume = acc.resumed() if acc.token_ids else None
        if resume is not None and params.prompt_logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=None)   # they went out with the first token
        queue = self._fanout.expect(attempt_id)
        replica, finished = None, False
        held: PrefillResult | None = None   # KV a prefill replica holds for this attempt, not yet handed off
        # a prompt prefilled on a decode replica is in flight until its first token (or the attempt's end)
        local_prefill = contextlib.ExitStack()
        try:
            result = None
            if migration == 0 and not self._local(len(prompt)):
                # None: the prefill pool has no replica running
                try:
                    result = await self._prefill_remotely(attempt_id, prompt, params)
                except BackendUnavailableError as exc:
                    if not exc.replica_id:   # the call may have run unheard: its KV held until the lease ends
                        self._prefill.abort_everywhere(attempt_id)
                    raise
            if result is None:
                resumed = len(resume.token_ids) if resume is not None else 0
                local_prefill.enter_context(self._in_flight(True, len(prompt) + resumed))
                subscriber = self._fanout.submitting(attempt_id)
                try:
                    admitted = await self._decode.generate(
                        DecodeRequest(attempt_id, prompt, params, subscriber, resume=resume),
                        avoid_replica=failed_on[0])
                except BackendUnavailableError as exc:
                    if not exc.replica_id:   # the call may have run on some replica: no copy decodes unheard
                        self._decode.abort_everywhere(attempt_id)
                    raise
                phases.prefilled_on = phases.prefilled_on or "decode"   # where the request's first prefill ran
            else:
                phases.prefilled_on = "prefill"
                phases.first_token(result.first)
                finished = result.first.finished
                held = None if finished else result
                yield acc.add(result.first)   # a client that leaves here closes us before the hand-off
                if finished:
                    return
                held = None   # from here _hand_off releases it unless a decode replica took it
                if result.first.prompt_logprobs is not None:    # the client has them: not for the decode side
                    result = dataclasses.replace(result, first=dataclasses.replace(result.first, prompt_logprobs=None))
                admitted = await self._hand_off(attempt_id, prompt, params, result)
                phases.reserve_s = admitted.reserve_time_s
                phases.transfer_s, phases.transfer_bytes = admitted.transfer_time_s, admitted.transfer_bytes
            replica = admitted.replica_id
            self._fanout.bind(attempt_id, replica)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    # aborted below even so: the replica aborts a failed stream's requests itself, but one
                    # it took under a subscriber whose stream never opened (submitted while the stream
                    # failed, or as the replica ended it) would decode for nobody; a dead one fails fast
                    failed_on[0] = replica
                    raise item
                local_prefill.close()
                phases.first_token(item)
                finished = item.finished
                yield acc.add(item)
        finally:
            local_prefill.close()
            aborting = replica is not None and not finished
            self._fanout.forget(attempt_id, aborting_on=replica if aborting else None)
            if held is not None:
                self._prefill.release(held)
            if aborting:
                abort = asyncio.ensure_future(self._decode.abort(replica, attempt_id))
                abort.add_done_callback(lambda _: self._fanout.abort_done(replica, attempt_id))
                # bounded: a migration must not wait on a replica that is unreachable but not yet declared dead
                await _shielded(abort, f"abort of {attempt_id}", ABORT_WAIT_S)

    async def _prefill_remotely(self, request_id: str, prompt_token_ids: list[int],
                                params: SamplingParams) -> PrefillResult | None:
        """The prefill pool's answer; None when, before it came, the pool turned
        out to have no replica running (they died and no replacement is up yet:
        a call would wait for one), so that a decode replica prefills instead."""
        with self._in_flight(False, len(prompt_token_ids)):
            if self._policy is None:
                return await self._prefill.prefill(request_id, prompt_token_ids, params)
            call = asyncio.ensure_future(self._prefill.prefill(request_id, prompt_token_ids, params))
            emptied = asyncio.ensure_future(self._policy.prefill_pool_emptied())
            try:
                await asyncio.wait({call, emptied}, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                if call.done() and not call.cancelled() and call.exception() is None:
                    # the result came in as this request was cancelled: nobody hands its KV off
                    self._prefill.release(call.result())
                raise
            finally:
                call.cancel()      # a no-op once done; else the call is cancelled on its replica too
                emptied.cancel()
            if call.done():
                return call.result()
            log.warning("request %s: no prefill replica is running; a decode replica prefills it", request_id)
            return None

    def _in_flight(self, local: bool, num_prompt_tokens: int):
        """The policy's count of prompt tokens in flight (nothing to count without a policy)."""
        return nullcontext() if self._policy is None else self._policy.in_flight(local, num_prompt_tokens)

    async def _hand_off(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        result: PrefillResult) -> Admitted:
        """A decode replica takes the request and its KV (it releases the
        prefill hold on success); retried once elsewhere on failure, except when
        the prefill replica lost the KV (BackendUnavailableError: the request is
        prefilled again). Past the last try, BackendUnavailableError: the
        request moves (migration)."""
        avoid = None
        admitted = unsure = False
        try:
            for attempt in range(1, self.max_transfer_attempts + 1):
                # a fresh transfer id per attempt; the prefill side still holds the KV
                request = DecodeRequest(request_id, prompt_token_ids, params, self._fanout.submitting(request_id),
                                        result, f"{request_id}#{attempt}")
                try:
                    done = await self._decode.generate(request, avoid_replica=avoid)
                    admitted = True
                    if self._policy is not None and done.transfer_time_s is not None:
                        self._policy.observe_handoff(done.transfer_time_s)
                    return done
                except KVHolderLost as exc:
                    # no decode replica can take KV that is gone: the request is prefilled again
                    raise BackendUnavailableError(str(exc)) from None
                except (KVTransferFailed, BackendUnavailableError, TimeoutError, RequestIdInUse) as exc:
                    # RequestIdInUse: a retry met the attempt before it, which the router could not
                    # tell had reached that replica
                    unsure = unsure or isinstance(exc, RequestIdInUse) or not getattr(exc, "replica_id", "")
                    if attempt == self.max_transfer_attempts:
                        raise BackendUnavailableError(str(exc), getattr(exc, "replica_id", "")) from None
                    avoid = getattr(exc, "replica_id", None) or None
                    log.warning("KV hand-off of %s failed (%s); retrying on another decode worker", request_id, exc)
            raise AssertionError("unreachable")
        finally:
            if not admitted:
                self._prefill.release(result)
                if unsure:   # a try that ran unheard may have taken the KV (and now decodes for nobody)
                    self._decode.abort_everywhere(request_id)


async def _shielded(work: asyncio.Future, what: str, timeout_s: float) -> None:
    """Clean-up that runs to the end even when the caller is being cancelled or
    stops waiting for it (after `timeout_s`: then it ends in the background)."""
    work.add_done_callback(lambda done: done.cancelled() or done.exception())   # retrieved, even if late
    try:
        await asyncio.wait_for(asyncio.shield(work), timeout_s)
    except asyncio.TimeoutError:
        log.warning("%s is still running after %.0f s; not waited for", what, timeout_s)
    except Exception as exc:  # noqa: BLE001 - the response is decided by now
        log.debug("%s failed: %s", what, exc)
