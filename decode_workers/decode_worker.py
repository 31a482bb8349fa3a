"""The decode worker: continuous batching decode of requests whose KV a
prefill worker hands over, and of requests it prefills itself (short prompts
under conditional disaggregation, and every request in colocated mode). Plain
class; decode_server.py wraps it for Ray Serve.

    generate(DecodeRequest) -> Admitted
      prefilled elsewhere, one small state machine per request, polled by the engine thread:
        RESERVING   blocks for the prompt's KV (waits while the cache is full)
        RECEIVING   staging buffers posted (at most `staging_budget_bytes` per rank
                    at once: a hand-off past it waits as for blocks); this worker
                    asks the prefill replica that holds the KV to send it (by replica id)
        admitted    scattered into the blocks, joins the batch after its first token
                    (which the router already streamed); the prefill hold is released
      prefilled here: queued in this engine (prefill, then decode in the same batch)
    RUNNING   every step's new tokens go to the outbox of the request's subscriber
              (one router), which streams them as one batch per step
    finished (blocks freed) | aborted: abort(), a failed hand-off, or the subscriber left

After a successful transfer the prompt is recomputed here only if the request
is preempted (the KV cache ran out); hand-offs wait while a preempted request does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cluster.serving.messages import (
    Admitted,
    DecodeRequest,
    KVHolderLost,
    KVTransferFailed,
    PrefillResult,
    TokenDelta,
)
from cluster.transport import kv_handoff
from cluster.transport.kv_transport import KVReceiver, PeerAddress, TransferState
from decode_workers.delta_outbox import DeltaOutbox
from engine.async_engine import AsyncEngine, settle_from_thread
from engine.engine_config import EngineConfig
from engine.errors import EngineStoppedError, InvalidRequestError, RequestIdInUse
from engine.llm_engine import LLMEngine, StepStats
from engine.output_processor import ResumedText, resumed_text
from engine.outputs import OutputKind, ResumedOutput, aborted_output
from engine.sampler import advanced_generator_state
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

STREAM_IDLE_CLOSE_S = 5.0
# a subscriber whose admitted requests no stream has read for this long has no reader (its router
# died between a request's admission and its stream): its requests are aborted, its outbox dropped
ORPHAN_S = 60.0
# how often the engine thread reads every rank's KV receiver for the health check (rank 0's is read at once)
RANKS_RECEIVER_CHECK_S = 5.0


class PrefillPeer(Protocol):
    """The prefill replicas, as a decode worker reaches them."""

    async def send_kv(self, replica_id: str, request_id: str, transfer_id: str,
                      receivers: list[PeerAddress]) -> int:
        """Asks the replica holding the request's KV to send it to `receivers`
        (one per decode rank, receives already posted); returns the bytes queued.
        Raises KVHolderLost when the replica is gone or holds nothing for it."""

    def release(self, replica_id: str, request_id: str) -> None:
        """Tells the replica it may free the request's KV (fire and forget)."""

    async def renew(self, replica_id: str, request_id: str) -> bool | None:
        """Tells the replica to keep holding the request's KV for another lease:
        True if it does, False if it is gone or holds nothing for the request,
        None if that cannot be told (no answer in time)."""


class Phase(enum.Enum):
    RESERVING = "reserving"
    RECEIVING = "receiving"


@dataclass(slots=True)
class _HandOff:
    """A request between arrival and admission (engine thread only)."""
    request: DecodeRequest
    phase: Phase
    future: asyncio.Future                 # RESERVING: (bytes, arrival future); RECEIVING: None on arrival
    deadline: float
    block_ids: list[int] | None = None
    staging_bytes: int = 0                 # RECEIVING: bytes of the receive buffers posted on each rank
    failed: bool = False                   # the transfer failed; waiting for the request's abort
    room_seen: tuple[int, ...] = ()        # DecodeWorker._room when a reserve last did not fit


@dataclass(slots=True)
class _Subscriber:
    outbox: DeltaOutbox
    request_ids: set[str] = field(default_factory=set)
    streaming: bool = False
    unread_since: float | None = None    # monotonic: a request was admitted with no stream open


class DecodeWorker:
    def __init__(self, config: EngineConfig, make_receiver: Callable[[int, torch.device], KVReceiver] | None = None,
                 prefill_peer: PrefillPeer | None = None, *, reserve_timeout_s: float = 60.0,
                 transfer_timeout_s: float = 60.0, staging_budget_bytes: int | None = None,
                 name: str = "decode", replica_id: str = ""):
        """Without `make_receiver` and `prefill_peer` it prefills every request
        itself (colocated). `staging_budget_bytes`: the receive buffers posted at
        once on each rank stay within it (None: no bound), except that a hand-off
        with nothing else in flight always goes. Call from a running event loop,
        then `await start()`."""
        self.config = config
        self.staging_budget_bytes = staging_budget_bytes
        self.name = name
        self.replica_id = replica_id
        self.reserve_timeout_s = reserve_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._make_receiver = make_receiver
        self._peer = prefill_peer
        self._engine = AsyncEngine(lambda: LLMEngine(config), name=f"{name}-engine")
        self._engine.add_stop_hook(self._fail_handoffs)
        self._handoffs: dict[str, _HandOff] = {}        # engine thread only
        self._subscribers: dict[str, _Subscriber] = {}  # event loop only
        self._queued_prompt_tokens: dict[str, int] = {}  # prefilled here, first token not yet out
        self.receivers: list[PeerAddress] = []
        self._orphan_check: asyncio.Future | None = None
        self._ranks_receiver_problem: str | None = None   # any rank's receiver's, as last read (TP > 1)
        self._ranks_receiver_checked = 0.0

    async def start(self) -> None:
        await self._engine.ready()
        self._orphan_check = asyncio.ensure_future(self._abort_orphans())
        if self._make_receiver is not None:
            self.receivers = await self._engine.call(LLMEngine.collective_rpc, kv_handoff.attach_receiver,
                                                     self._make_receiver)
            self._engine.add_ticker(self._tick)

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, request: DecodeRequest) -> Admitted:
        """Takes the request into the batch; its outputs then stream to
        `request.subscriber` (a stream must read them within ORPHAN_S). Raises
        KVTransferFailed (KVHolderLost when the prefill replica no longer holds
        the KV), InvalidRequestError, TimeoutError when no blocks free up in time,
        or EngineStoppedError naming this replica; nothing is left behind then."""
        try:
            admitted = await self._generate(request)
        except EngineStoppedError as exc:
            raise EngineStoppedError(f"{self.name}: {exc}", self.replica_id) from None
        subscriber = self._subscribers.get(request.subscriber)
        if subscriber is not None and not subscriber.streaming and subscriber.unread_since is None:
            subscriber.unread_since = time.monotonic()
        return admitted

    async def _generate(self, request: DecodeRequest) -> Admitted:
        rid = request.request_id
        if request.prefill is not None and request.resume is not None:
            raise InvalidRequestError("a resumed request is prefilled here, not handed off", "resume")
        # before the request joins its subscriber: a stream closed during this wait aborts only
        # what the engine has already taken
        resume = await self._advanced(request.resume, request.params)
        # under any subscriber: a retry under a router's new stream must neither take over the output of
        # the attempt before it (attach) nor, failing, abort that attempt and leave its id behind there;
        # checked before the subscriber is made, which a refused request must not leave behind
        if any(rid in other.request_ids for other in self._subscribers.values()):
            raise RequestIdInUse(f"request id {rid!r} is already in use on {self.name}", self.replica_id)
        subscriber = self._subscriber(request.subscriber)
        self._engine.attach(rid, subscriber.outbox)
        subscriber.request_ids.add(rid)
        try:
            if request.prefill is None:
                resumed = resume.token_ids if resume is not None else []
                self._queued_prompt_tokens[rid] = len(request.prompt_token_ids) + len(resumed)
                # the resumed output's text rebuilt here, not between the engine's steps
                text = await asyncio.to_thread(resumed_text, self._engine.engine.tokenizer, request.prompt_token_ids,
                                               request.params.skip_special_tokens, resumed) if resumed else None
                await self._engine.call(_add_request, rid, request.prompt_token_ids, request.params, resume, text,
                                        time.monotonic())
                return Admitted(self.replica_id)
            return await self._receive(request)
        except BaseException:
            self._leave(request.subscriber, subscriber, rid)
            self._queued_prompt_tokens.pop(rid, None)
            await self._engine.call_for_cleanup(self._abort_unheard, rid, subscriber.outbox)
            raise

    def _abort_unheard(self, engine: LLMEngine, rid: str, outbox: DeltaOutbox) -> None:
        """Engine thread: aborts a request detached from its subscriber, whose outbox, which
        hears no abort for it, forgets it (it may have put its first token already)."""
        self._abort(engine, rid)
        outbox.forget(rid)

    async def _advanced(self, resume: ResumedOutput | None, params: SamplingParams) -> ResumedOutput | None:
        """`resume` with a seeded request's generator advanced past its tokens, on a
        thread of its own: one vocabulary-sized draw per token, which on the engine
        thread would hold up every request's next step."""
        if resume is None or params.seed is None or params.is_greedy or resume.generator_state is not None:
            return resume
        engine = self._engine.engine
        state = await asyncio.to_thread(advanced_generator_state, params.seed, len(resume.token_ids),
                                        engine.model_config.vocab_size, engine.device)
        return dataclasses.replace(resume, generator_state=state)

    async def _receive(self, request: DecodeRequest) -> Admitted:
        if self._peer is None or not self.receivers:
            raise InvalidRequestError(f"{self.name} takes no KV hand-offs (colocated); send the prompt", "prefill")
        rid, prefill = request.request_id, request.prefill
        loop = asyncio.get_running_loop()
        reserved = loop.create_future()
        t0 = time.monotonic()
        await self._engine.call(self._reserve, request, reserved)
        nbytes, arrived = await self._wait_for_blocks(reserved, prefill)
        t1 = time.monotonic()
        error = await self._send_and_arrive(request, arrived)
        if error is not None:
            raise KVTransferFailed(f"the KV of request {rid} did not arrive at {self.name}: {error}",
                                   self.replica_id)
        self._peer.release(prefill.replica_id, rid)
        return Admitted(self.replica_id, reserve_time_s=t1 - t0, transfer_time_s=time.monotonic() - t1,
                        transfer_bytes=nbytes)

    async def _send_and_arrive(self, request: DecodeRequest, arrived: asyncio.Future) -> str | None:
        """Asks the prefill replica to send and waits for the KV: None once it is in,
        else why not. The transfer's deadline runs while the send call is pending
        too (the prefill side may wait for its staging budget): whichever ends
        first decides, and a send call still pending when the transfer failed is
        cancelled. Raises KVTransferFailed when the send call fails."""
        rid, prefill = request.request_id, request.prefill
        send = asyncio.ensure_future(self._peer.send_kv(prefill.replica_id, rid, request.transfer_id,
                                                        list(self.receivers)))
        send.add_done_callback(_retrieved)   # (an arrival may settle it before the call answers)
        try:
            await asyncio.wait({send, arrived}, return_when=asyncio.FIRST_COMPLETED)
            if arrived.done() and arrived.result() is None:
                return None            # in (whatever the call answers, or before it does)
            if not send.done():
                send.cancel()
                return arrived.result()
            if not send.cancelled() and isinstance(send.exception(), KVHolderLost):
                raise KVHolderLost(str(send.exception()), self.replica_id)
            if send.cancelled() or send.exception() is not None:
                why = "cancelled" if send.cancelled() else send.exception()
                raise KVTransferFailed(f"the prefill worker could not send the KV of {rid}: {why}",
                                       self.replica_id)
            return await arrived
        except BaseException:
            send.cancel()
            arrived.cancel()   # nobody reads it now: the abort that follows settles nothing
            raise

    async def _wait_for_blocks(self, reserved: asyncio.Future,
                               prefill: PrefillResult) -> tuple[int, asyncio.Future]:
        """The reservation's result. Waiting for free blocks may outlast the
        hold's lease (reserve_timeout_s is longer): the hold is renewed meanwhile,
        every third of the lease. Raises KVHolderLost once a renewal finds the
        prefill replica gone or holding nothing (it died while this waited)."""
        renewal: asyncio.Future | None = None
        try:
            while not reserved.done():
                await asyncio.wait({reserved}, timeout=prefill.lease_s / 3)
                if not reserved.done():
                    self._engine.check_alive()   # (its stop hook settles the future; this is the backstop)
                    if renewal is not None and not renewal.done():
                        continue                 # one renewal at a time: each answer is read
                    if renewal is not None and not renewal.cancelled() and renewal.exception() is None \
                            and renewal.result() is False:
                        raise KVHolderLost(f"the prefill worker {prefill.replica_id} no longer holds the KV of "
                                           f"{prefill.request_id} (it stopped, or the hold's lease ran out) while "
                                           f"{self.name} waited for free blocks", self.replica_id)
                    renewal = asyncio.ensure_future(self._peer.renew(prefill.replica_id, prefill.request_id))
                    renewal.add_done_callback(_retrieved)
            return reserved.result()
        except BaseException:
            reserved.cancel()
            raise

    async def abort(self, request_id: str) -> None:
        """Ends the request wherever it is and frees its blocks; its subscriber
        gets a final delta with finish_reason "abort"."""
        await self._engine.call(self._abort, request_id)
        self._queued_prompt_tokens.pop(request_id, None)   # (its subscriber may never read that delta)
        for name, subscriber in list(self._subscribers.items()):
            if request_id in subscriber.request_ids and not subscriber.streaming:
                # a stream that never opens (the router saw this subscriber's stream fail) cleans nothing up
                self._leave(name, subscriber, request_id)

    async def stream(self, subscriber_id: str, min_interval_s: float = 0.0) -> AsyncIterator[list[TokenDelta]]:
        """The subscriber's deltas, one list per engine step (several steps when
        the reader is slower, or within `min_interval_s` of the previous list:
        delta_outbox.py's stream batching). Closing it aborts the subscriber's
        requests. It ends by itself once the subscriber has had no request here for
        STREAM_IDLE_CLOSE_S, so that a replica being scaled down holds no
        endless call and Serve can stop it."""
        subscriber = self._subscriber(subscriber_id)
        if subscriber.streaming:
            raise InvalidRequestError(f"subscriber {subscriber_id!r} already streams from {self.name}")
        subscriber.streaming, subscriber.unread_since = True, None
        subscriber.outbox.min_interval_s = min_interval_s
        try:
            while True:
                try:
                    batch = await asyncio.wait_for(subscriber.outbox.take(), STREAM_IDLE_CLOSE_S)
                except asyncio.TimeoutError:
                    if subscriber.request_ids:
                        continue
                    return       # idle: the reader reopens it for its next request here
                    # (no await between the check and the removal below: a request that
                    # arrives later gets a new subscriber, and its own stream)
                for delta in batch:
                    if delta.token_ids:
                        self._queued_prompt_tokens.pop(delta.request_id, None)
                    if delta.finished:
                        subscriber.request_ids.discard(delta.request_id)
                        self._engine.detach(delta.request_id)
                        self._queued_prompt_tokens.pop(delta.request_id, None)
                yield batch
        finally:
            del self._subscribers[subscriber_id]
            await self._abort_requests_of(subscriber)

    async def _abort_orphans(self) -> None:
        """Every ORPHAN_S / 4: the requests of subscribers that no stream has read since
        one was admitted, ORPHAN_S ago or more, are aborted (they would decode to their
        max_tokens for nobody), and the subscribers dropped with their outboxes."""
        while True:
            await asyncio.sleep(ORPHAN_S / 4)
            try:
                await self._abort_orphans_once(time.monotonic())
            except Exception:  # noqa: BLE001 - one failed pass must not end the checks for good
                log.exception("%s: the check for requests nobody reads failed; trying again", self.name)

    async def _abort_orphans_once(self, now: float) -> None:
        for name, subscriber in list(self._subscribers.items()):
            if subscriber.streaming or subscriber.unread_since is None or \
                    now - subscriber.unread_since < ORPHAN_S or self._subscribers.get(name) is not subscriber:
                continue
            log.warning("%s: subscriber %s has not read its %d requests for %.0f s (its router is gone?): "
                        "aborting them", self.name, name, len(subscriber.request_ids), now - subscriber.unread_since)
            del self._subscribers[name]
            try:
                await self._abort_requests_of(subscriber)
            except BaseException:
                self._subscribers.setdefault(name, subscriber)    # its requests aborted at the next check
                raise

    async def _abort_requests_of(self, subscriber: _Subscriber) -> None:
        """Aborts every request of a subscriber that was just dropped (no stream will read them),
        in one engine call, queued before any wait: a cancel during the wait stops none of them."""
        rids = list(subscriber.request_ids)      # an abort below wakes generate(), which discards its id
        for rid in rids:
            self._engine.detach(rid)
            self._queued_prompt_tokens.pop(rid, None)
        if rids:
            await self._engine.call_for_cleanup(self._abort_all, rids)

    def _abort_all(self, engine: LLMEngine, rids: list[str]) -> None:
        for rid in rids:
            self._abort(engine, rid)

    def _leave(self, name: str, subscriber: _Subscriber, request_id: str) -> None:
        """The request no longer streams to `subscriber`; one left with no request
        and no stream is forgotten."""
        subscriber.request_ids.discard(request_id)
        self._engine.detach(request_id)
        if not subscriber.request_ids and not subscriber.streaming and self._subscribers.get(name) is subscriber:
            del self._subscribers[name]

    def _subscriber(self, subscriber_id: str) -> _Subscriber:
        if subscriber_id not in self._subscribers:
            self._subscribers[subscriber_id] = _Subscriber(DeltaOutbox())
        return self._subscribers[subscriber_id]

    def check_health(self) -> None:
        """Raises when the engine loop has stopped (a step failed, or a TP rank died), or
        a rank's KV receiver can take no new prefill worker (Serve then replaces the
        replica): rank 0's read now, the other ranks' as the engine thread last read
        them (every RANKS_RECEIVER_CHECK_S)."""
        self._engine.check_alive()
        engine = self._engine.engine
        problem = kv_handoff.receiver_problem(engine.worker) if engine is not None else None
        if problem := problem or self._ranks_receiver_problem:
            raise EngineStoppedError(f"{self.name}: {problem}", self.replica_id)

    def step_samples(self) -> list[tuple[int, StepStats]]:
        """The engine steps run since the last call, numbered from the engine's first."""
        return self._engine.take_step_samples()

    def stats(self) -> dict[str, float]:
        """Load figures for routing and metrics: the engine's; hand-offs waiting
        for blocks count as waiting; prompt tokens queued for a local prefill."""
        stats = self._engine.load_stats()
        if stats:
            handoffs = list(self._handoffs.values())
            stats["num_waiting"] += sum(h.phase is Phase.RESERVING for h in handoffs)
            stats["num_receiving"] = float(sum(h.phase is Phase.RECEIVING for h in handoffs))
            stats["kv_staging_bytes"] = float(_receiving_bytes(handoffs))
            stats["queued_prefill_tokens"] = float(sum(self._queued_prompt_tokens.values()))
        return stats

    def shutdown(self) -> None:
        """Stops the engine and closes this rank's KV receiver (its peers hear at once;
        the other ranks' close with their processes)."""
        if self._orphan_check is not None:    # (shutdown may come from another thread)
            try:
                self._orphan_check.get_loop().call_soon_threadsafe(self._orphan_check.cancel)
            except RuntimeError:      # its loop is closed: the task went with it
                pass
        self._engine.shutdown()
        if self._engine.engine is not None:
            kv_handoff.close_transport(self._engine.engine.worker)

    # ---- engine thread ----------------------------------------------------------------------
    def _reserve(self, engine: LLMEngine, request: DecodeRequest, future: asyncio.Future) -> None:
        rid = request.request_id
        if rid in self._handoffs:
            raise RequestIdInUse(f"request id {rid!r} is already in use on {self.name}", self.replica_id)
        handoff = _HandOff(request, Phase.RESERVING, future, time.monotonic() + self.reserve_timeout_s)
        self._handoffs[rid] = handoff
        self._try_reserve(engine, handoff)

    def _try_reserve(self, engine: LLMEngine, handoff: _HandOff) -> None:
        """Reserves the blocks and posts the receives in one go (no engine step
        in between); resolves the reserve future with (bytes, arrival future)."""
        r, prefill = handoff.request, handoff.request.prefill
        first = prefill.first
        block_bytes = engine.worker.kv_cache.spec.bytes_per_block     # on each rank: K and V, all layers
        staging = -(-len(r.prompt_token_ids) // engine.block_manager.block_size) * block_bytes
        try:
            blocks = None
            if not self._staging_full(staging):
                blocks = engine.reserve_prefilled(
                    r.request_id, r.prompt_token_ids, first.token_ids[0], r.params,
                    first_logprobs=first.logprobs[0] if first.logprobs else None,
                    generator_state=prefill.generator_state, first_token_emitted=True,
                    output_kind=OutputKind.DELTA)
            if blocks is not None:
                nbytes = sum(engine.collective_rpc(kv_handoff.start_receive, r.transfer_id, len(blocks),
                                                   prefill.sender_names, prefill.num_kv_heads))
        except Exception as exc:  # noqa: BLE001 - handed to the waiting request
            del self._handoffs[r.request_id]
            if r.request_id in engine.scheduler.reserved:   # reserved, but the receives failed to post
                engine.collective_rpc(kv_handoff.forget_transfer, r.transfer_id)
                engine.abort_request(r.request_id)
            if not isinstance(exc, InvalidRequestError):
                # this replica's failure (its receiver closed, a staging buffer out of memory): a failed
                # hand-off, which the router tries on another replica, not an error for the client
                exc = KVTransferFailed(f"{self.name} could not post the receives of {r.request_id}: "
                                       f"{type(exc).__name__}: {exc}", self.replica_id)
            settle_from_thread(handoff.future, exc=exc)
            return
        if blocks is None:
            handoff.room_seen = self._room(engine)
            if time.monotonic() > handoff.deadline:
                del self._handoffs[r.request_id]
                # naming this replica: the router's retry goes to another, not back to this full one
                settle_from_thread(handoff.future, exc=KVTransferFailed(
                    f"{self.name} had no room for request {r.request_id} (free KV blocks, a place among "
                    f"its max_num_seqs {engine.scheduler.max_num_seqs}, and receive buffers within "
                    f"kv_transfer.staging_mib; none is taken while a preempted request waits to run again) "
                    f"for {self.reserve_timeout_s:g} s", self.replica_id))
            return
        reserved = handoff.future
        handoff.phase, handoff.block_ids = Phase.RECEIVING, blocks
        handoff.staging_bytes = len(blocks) * block_bytes
        handoff.future = reserved.get_loop().create_future()
        handoff.deadline = time.monotonic() + self.transfer_timeout_s
        settle_from_thread(reserved, (nbytes, handoff.future))

    def _admit(self, engine: LLMEngine, rid: str) -> str | None:
        """The KV is in: scatter it into the blocks and join the running batch.
        Returns None, or why that failed (the request is then aborted here, and
        its waiter retries it elsewhere)."""
        handoff = self._handoffs.pop(rid)
        try:
            engine.collective_rpc(kv_handoff.finish_receive, handoff.request.transfer_id, handoff.block_ids)
            out = engine.commit_prefilled(rid)
        except Exception as exc:  # noqa: BLE001 - handed to the waiting request
            log.exception("admitting request %s after its KV arrived failed", rid)
            try:
                engine.collective_rpc(kv_handoff.forget_transfer, handoff.request.transfer_id)
                engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - a rank is gone (the engine stops): the waiter still hears
                log.exception("cleaning up request %s after its admission failed", rid)
            return f"admitting it after its KV arrived failed: {exc}"
        if out.finished:   # ended on its first token after all: its subscriber still hears so
            self._engine.deliver([out])
        return None

    def _abort(self, engine: LLMEngine, rid: str) -> None:
        handoff = self._handoffs.pop(rid, None)
        if handoff is not None:
            # answered first: the collective below fails when a rank is gone, and nothing else would
            # (not a CancelledError: the router must not take it for its own client leaving)
            settle_from_thread(handoff.future, exc=KVTransferFailed(
                f"request {rid} was aborted on {self.name} while it waited for its KV", self.replica_id))
            engine.collective_rpc(kv_handoff.forget_transfer, handoff.request.transfer_id)
        if engine.abort_request(rid):
            self._engine.deliver([aborted_output(rid)])

    def _fail_handoffs(self, reason: BaseException) -> None:
        """The engine loop ended (engine thread): the requests waiting for blocks or
        for their KV fail now, as nothing else would ever settle their waits."""
        handoffs, self._handoffs = self._handoffs, {}
        for rid, handoff in handoffs.items():
            settle_from_thread(handoff.future, exc=EngineStoppedError(
                f"{self.name}'s engine stopped while request {rid} waited for its KV ({reason})"))

    def _staging_full(self, staging_bytes: int) -> bool:
        """Whether `staging_bytes` more would pass the budget while other receives are in flight."""
        in_use = _receiving_bytes(self._handoffs.values())
        return self.staging_budget_bytes is not None and in_use > 0 and \
            in_use + staging_bytes > self.staging_budget_bytes

    def _room(self, engine: LLMEngine) -> tuple[int, ...]:
        """What a hand-off waits for: free KV blocks, sequences holding a place in
        the batch, the receive buffers in flight, and the waiting sequences whose
        room a reserve keeps (the head, any preempted: Scheduler.reserve)."""
        waiting = engine.scheduler.waiting
        return (engine.block_manager.num_free_blocks, engine.scheduler.num_seqs_in_batch,
                _receiving_bytes(self._handoffs.values()), len(waiting),
                id(waiting[0]) if waiting else 0)

    def _tick(self, engine: LLMEngine) -> bool:
        room = self._room(engine)
        now = time.monotonic()
        if engine.tp.size > 1 and now - self._ranks_receiver_checked > RANKS_RECEIVER_CHECK_S:
            self._ranks_receiver_checked = now
            problems = engine.collective_rpc(kv_handoff.receiver_problem)
            self._ranks_receiver_problem = next((f"rank {rank}: {p}" for rank, p in enumerate(problems) if p), None)
        for handoff in [h for h in self._handoffs.values() if h.phase is Phase.RESERVING]:
            # blocks and places in the batch free up only as requests finish: retry when
            # that happened (or to time out)
            if room != handoff.room_seen or now > handoff.deadline:
                self._try_reserve(engine, handoff)
        waiting = {h.request.transfer_id: rid for rid, h in self._handoffs.items()
                   if h.phase is Phase.RECEIVING and not h.failed}
        if waiting:
            per_rank = engine.collective_rpc(kv_handoff.poll_transfers, list(waiting))
            now = time.monotonic()
            for tid, rid in waiting.items():
                handoff = self._handoffs[rid]
                state, error = kv_handoff.combine_states([r[tid] for r in per_rank])
                if not state.is_final and now > handoff.deadline:
                    state, error = TransferState.FAILED, f"timed out after {self.transfer_timeout_s:g} s"
                if state is TransferState.DONE:
                    settle_from_thread(handoff.future, self._admit(engine, rid))
                elif state is TransferState.FAILED:
                    # stays here: the request's abort forgets the transfer and frees the blocks
                    handoff.failed = True
                    settle_from_thread(handoff.future, error or "failed")
        return bool(waiting)


def _add_request(engine: LLMEngine, request_id: str, prompt_token_ids: list[int], params,
                 resume: ResumedOutput | None, text: ResumedText | None, arrival: float) -> None:
    """`arrival`: when the worker took it (its queue time counts the wait for the engine thread)."""
    engine.add_request(request_id, prompt_token_ids, params, resume=resume, resumed_text=text,
                       output_kind=OutputKind.DELTA, arrival_time=arrival)


def _retrieved(task: asyncio.Future) -> None:
    """Marks a task's outcome read (no "exception was never retrieved" for a call
    whose answer came too late to matter)."""
    if not task.cancelled():
        task.exception()


def _receiving_bytes(handoffs: Iterable[_HandOff]) -> int:
    """Bytes of receive buffers the hand-offs have posted on each rank (failed
    transfers' too, until their abort)."""
    return sum(h.staging_bytes for h in handoffs if h.phase is Phase.RECEIVING)

