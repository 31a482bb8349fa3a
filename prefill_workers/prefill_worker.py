"""The prefill worker: a prefill-only engine loop that hands each request's KV
to a decode worker (plain class; prefill_server.py wraps it for Ray Serve).

    prefill(request) ─▶ waiting ─▶ running (batched, chunked prefill; prefix cache on)
                                     │ first token sampled: returned at once (the client's TTFT)
                                     ▼
                                 holding: KV blocks kept ──send_kv──▶ sending (packed copies on the wire;
                                     │   (asked by the decode worker    at most `staging_budget_bytes` of
                                     │    that posted the receives)     them per rank: send_budget.py)
                  release (the decode side has the KV), abort, or lease expiry
                  (a decode worker still waiting for free blocks renews the lease)
                                     ▼
                                   freed

A request that ended on its first token (EOS, a stop, max_tokens 1) holds
nothing. A hold that nobody releases (the router or decode worker died) is
freed when its lease runs out (a send starts it again, and a send still on
the wire keeps it until the transfer ends, one more lease at most); a release that
arrives while the send is still in flight is carried out when the transfer
ends. A send that must wait for the staging budget renews the lease first and
waits at most `send_wait_s` (then it is refused and the decode side tries
elsewhere). With one rank the KV is packed and queued on the caller's thread,
without waiting for the engine's current step to end (held blocks are never
written by a step): while it packs, the hold is marked as being sent, and the
engine thread neither expires nor frees it (an abort or release meanwhile is
carried out once the send is recorded).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.serving.messages import PrefillResult, TokenDelta
from cluster.transport import kv_handoff
from cluster.transport.kv_transport import KVSender, PeerAddress, TransferState
from engine.async_engine import AsyncEngine, EngineStoppedError, settle_from_thread
from engine.engine_config import EngineConfig
from engine.errors import RequestAbortedError
from engine.llm_engine import LLMEngine, StepStats
from engine.outputs import OutputKind, RequestOutput, aborted_output
from engine.sampling_params import SamplingParams
from prefill_workers.send_budget import SendBudget

log = logging.getLogger(__name__)

# send_kv packs on the caller's thread only while the hold's lease has this long left:
# the engine thread frees an expired hold's blocks, and a step may then write them
_LEASE_MARGIN_S = 1.0


@dataclass(slots=True)
class _Hold:
    deadline: float                      # monotonic; the lease
    num_blocks: int
    transfer_id: str | None = None       # set once send_kv started
    transfer_state: TransferState | None = None
    release_requested: bool = False
    drop_requested: bool = False         # dropped while packed off the engine thread: done once noted


class PrefillWorker:
    def __init__(self, config: EngineConfig, make_sender: Callable[[int, torch.device], KVSender], *,
                 lease_s: float = 60.0, staging_budget_bytes: int | None = None, send_wait_s: float = 15.0,
                 name: str = "prefill", replica_id: str = ""):
        """`staging_budget_bytes`: the packed copies that sends in flight hold on
        each rank stay within it (None: no bound), except that a send with nothing
        else in flight always goes; a send waits for room at most `send_wait_s`
        (keep it under the receivers' transfer timeout). Call from a running
        event loop, then `await start()`."""
        self.config = config
        self.name = name
        self.replica_id = replica_id
        self.lease_s = lease_s
        self.send_wait_s = send_wait_s
        self._make_sender = make_sender
        self._engine = AsyncEngine(lambda: LLMEngine(config), decode=False, name=f"{name}-engine")
        self._holds: dict[str, _Hold] = {}     # changed only on the engine thread
        self._sends_to_note: set[str] = set()  # packed off the engine thread, _note_send not run yet
        self._sends_to_note_lock = threading.Lock()   # with a hold's drop: never both at once
        self._queued_prompt_tokens: dict[str, int] = {}
        # request id -> when it was aborted (monotonic), for lease_s: a prefill call that arrives after its
        # abort (the router's broadcast overtook it) is refused, not run to a hold nobody will release
        self._aborted: dict[str, float] = {}
        self._send_budget = SendBudget(staging_budget_bytes)
        self.sender_names: list[str] = []
        self.num_kv_heads = 0
        self._head_block_bytes = 0   # one KV head of one block, K and V, all layers

    async def start(self) -> None:
        engine = await self._engine.ready()
        self.num_kv_heads = engine.model_config.num_kv_heads
        spec = engine.kv_cache.spec
        self._head_block_bytes = spec.bytes_per_block // spec.num_kv_heads
        self.sender_names = await self._engine.call(LLMEngine.collective_rpc, kv_handoff.attach_sender,
                                                    self._make_sender)
        self._engine.add_ticker(self._tick)

    # ---- requests ------------------------------------------------------------------------------
    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> PrefillResult:
        """Runs the prompt, samples the first token and holds the KV. Raises
        InvalidRequestError for a prompt this model cannot take."""
        arrival = time.monotonic()     # its queue time counts the wait for the engine thread to take it
        if request_id in self._aborted:
            raise RequestAbortedError(f"request {request_id} was aborted on {self.name} before it arrived")
        held = asyncio.get_running_loop().create_future()
        self._engine.attach(request_id, _HoldOnFirstToken(self, held))
        self._queued_prompt_tokens[request_id] = len(prompt_token_ids)
        try:
            await self._engine.call(_add_held_request, request_id, prompt_token_ids, params, arrival)
            return await held
        except BaseException as exc:
            await self._engine.call_for_cleanup(self._drop, request_id)
            if isinstance(exc, EngineStoppedError):
                raise EngineStoppedError(f"{self.name}: {exc}", self.replica_id) from None
            raise
        finally:
            self._engine.detach(request_id)
            self._queued_prompt_tokens.pop(request_id, None)

    async def send_kv(self, request_id: str, transfer_id: str, receivers: list[PeerAddress]) -> int:
        """Starts sending the held KV to a decode gang (one address per decode
        rank, whose receives are already posted), once the packed copies fit in
        the staging budget; returns the bytes queued. Raises KeyError when the
        request holds nothing here, TimeoutError when the budget has no room
        within `send_wait_s`."""
        hold = self._holds.get(request_id)
        if hold is None:   # nothing to send, nothing to wait for: the engine thread says so (KeyError)
            return await self._engine.call(self._start_send, request_id, transfer_id, receivers)
        nbytes = kv_handoff.packed_bytes_per_rank(hold.num_blocks, self._head_block_bytes, self.num_kv_heads,
                                                  self.config.tensor_parallel_size, len(receivers))
        if hold.transfer_id not in (None, transfer_id):   # a retry: the send it replaces is forgotten first
            self._send_budget.release(hold.transfer_id)
        renewing = None
        if not self._send_budget.fits(nbytes):   # the wait must not outlast the lease
            renewing = asyncio.ensure_future(self._renew_every_third_of_the_lease(request_id))
        try:
            await self._send_budget.acquire(transfer_id, nbytes, self.send_wait_s)
        except TimeoutError as exc:
            raise TimeoutError(f"{self.name} could not start sending the KV of {request_id}: {exc} "
                               f"(kv_transfer.staging_mib bounds them)") from None
        finally:
            if renewing is not None:
                renewing.cancel()
        try:
            return await self._send(request_id, transfer_id, receivers)
        except asyncio.CancelledError:
            # the engine may still start the send queued for it: what it started is forgotten after it
            try:
                self._engine.submit(self._abandon_send, request_id, transfer_id)
            except EngineStoppedError:
                pass     # nothing runs there any more
            raise
        except BaseException:
            self._send_budget.release(transfer_id)
            raise

    async def _renew_every_third_of_the_lease(self, request_id: str) -> None:
        """Until cancelled, or the hold is gone (or the engine stopped: the send fails anyway)."""
        try:
            while await self._engine.call(self._renew, request_id):
                await asyncio.sleep(self.lease_s / 3)
        except EngineStoppedError:
            pass

    async def _send(self, request_id: str, transfer_id: str, receivers: list[PeerAddress]) -> int:
        if self.config.tensor_parallel_size > 1:   # every rank packs its heads: between steps
            return await self._engine.call(self._start_send, request_id, transfer_id, receivers)
        engine = self._engine.engine
        with self._sends_to_note_lock:
            hold = self._holds.get(request_id)
            packs_here = hold is not None and hold.transfer_id is None and request_id not in self._sends_to_note \
                and hold.deadline - time.monotonic() >= _LEASE_MARGIN_S
            if packs_here:   # from here until _note_send the engine thread neither expires nor frees it
                self._sends_to_note.add(request_id)
        if not packs_here:
            # unknown, a retry (its first send maybe not yet noted: the call queues behind the note), or a
            # lease about to run out: the engine thread decides
            return await self._engine.call(self._start_send, request_id, transfer_id, receivers)
        try:
            block_ids = list(engine.held_sequence(request_id).block_table)
            (nbytes,) = engine.collective_rpc(kv_handoff.start_send, transfer_id, block_ids, receivers,
                                              self.num_kv_heads)
            self._engine.submit(self._note_send, request_id, transfer_id)
        except BaseException:
            try:
                self._engine.submit(self._note_send, request_id, None)
            except EngineStoppedError:
                pass
            with self._sends_to_note_lock:    # (if the note could not be queued)
                self._sends_to_note.discard(request_id)
            raise
        return nbytes

    async def renew(self, request_id: str) -> bool:
        """A decode worker still means to take the KV (it waits for free blocks):
        the lease starts again. False if the request holds nothing here."""
        return await self._engine.call(self._renew, request_id)

    async def release(self, request_id: str) -> bool:
        """The decode side has the KV (or gave up): free the blocks once no
        transfer reads them. False if the request holds nothing here."""
        return await self._engine.call(self._release, request_id)

    async def abort(self, request_id: str) -> None:
        """Stops the request wherever it is and frees what it holds; a prefill call for it
        that comes later (it was still on its way) is refused."""
        now = time.monotonic()
        while self._aborted and now - next(iter(self._aborted.values())) > self.lease_s:   # oldest first
            del self._aborted[next(iter(self._aborted))]
        self._aborted.pop(request_id, None)       # (kept in the order of abort times: pruned from the front)
        self._aborted[request_id] = now
        await self._engine.call(self._drop, request_id)

    def check_health(self) -> None:
        """Raises when the engine loop has stopped (a step failed, or a TP rank died)."""
        self._engine.check_alive()

    def step_samples(self) -> list[tuple[int, StepStats]]:
        """The engine steps run since the last call, numbered from the engine's first."""
        return self._engine.take_step_samples()

    def stats(self) -> dict[str, float]:
        """Load figures for routing and metrics: the engine's, the prompt tokens
        not yet prefilled, the requests holding KV, and the packed copies of
        sends in flight (per rank)."""
        stats = self._engine.load_stats()
        if stats:
            stats["queued_prefill_tokens"] = float(sum(self._queued_prompt_tokens.values()))
            stats["num_held"] = float(len(self._holds))
            stats["kv_staging_bytes"] = float(self._send_budget.in_flight_bytes)
        return stats

    def shutdown(self) -> None:
        """Stops the engine and closes this rank's KV sender (its peers hear at once;
        the other ranks' close with their processes)."""
        self._engine.shutdown()
        if self._engine.engine is not None:
            kv_handoff.close_transport(self._engine.engine.worker)

    # ---- engine thread ----------------------------------------------------------------------
    def _hold(self, out: RequestOutput) -> PrefillResult:
        """Right after the step that sampled the first token."""
        engine, deadline = self._engine.engine, time.monotonic() + self.lease_s
        seq = engine.held_sequence(out.request_id)
        result = PrefillResult(
            request_id=out.request_id, first=TokenDelta.from_output(out),
            generator_state=seq.generator.get_state() if seq.generator is not None else None,
            num_blocks=len(seq.block_table), sender_names=list(self.sender_names),
            num_kv_heads=self.num_kv_heads, replica_id=self.replica_id, lease_s=self.lease_s)
        if out.finished:   # nothing left to decode: nobody will ask for the KV
            engine.release_kv(out.request_id)
        else:
            self._holds[out.request_id] = _Hold(deadline, len(seq.block_table))
        return result

    def _note_send(self, engine: LLMEngine, request_id: str, transfer_id: str | None) -> None:
        """Records a send started off the engine thread (one rank; None: it failed to
        start), and carries out a drop asked for while it was packed (a release
        asked for then waits for the send to end)."""
        with self._sends_to_note_lock:
            self._sends_to_note.discard(request_id)
        hold = self._holds.get(request_id)
        if hold is None:   # (not expected: a hold being sent is not dropped) stop the send
            if transfer_id is not None:
                self._forget_send(engine, transfer_id)
            return
        if transfer_id is not None:
            hold.transfer_id, hold.transfer_state = transfer_id, TransferState.PENDING
            self._renew(engine, request_id)
        # a release waits for the send it met (its end frees the hold: _tick); an abort does not
        if hold.drop_requested or (hold.release_requested and transfer_id is None):
            self._drop(engine, request_id)

    def _abandon_send(self, engine: LLMEngine, request_id: str, transfer_id: str) -> None:
        """send_kv's caller went away after queueing `transfer_id` (engine thread,
        after that queued call): the send it started, if any, is forgotten; the
        hold stays for a retry, a release or its lease."""
        hold = self._holds.get(request_id)
        if hold is not None and hold.transfer_id == transfer_id:
            hold.transfer_id, hold.transfer_state = None, None
        self._forget_send(engine, transfer_id)
        if hold is not None and (hold.release_requested or hold.drop_requested):   # waited for this send
            self._drop(engine, request_id)

    def _start_send(self, engine: LLMEngine, request_id: str, transfer_id: str,
                    receivers: list[PeerAddress]) -> int:
        hold = self._holds.get(request_id)
        if hold is None:
            raise KeyError(f"request {request_id!r} holds no KV on {self.name} (lease expired or aborted)")
        if hold.transfer_id is not None:
            # a retry towards another decode worker: the router gave up on the last attempt
            self._forget_send(engine, hold.transfer_id)
        block_ids = list(engine.held_sequence(request_id).block_table)
        try:
            nbytes = sum(engine.collective_rpc(kv_handoff.start_send, transfer_id, block_ids, receivers,
                                               self.num_kv_heads))
        except BaseException:
            # a rank that failed forgot its own pieces; the others queued theirs
            engine.collective_rpc(kv_handoff.forget_transfer, transfer_id)
            raise
        hold.transfer_id, hold.transfer_state = transfer_id, TransferState.PENDING
        self._renew(engine, request_id)
        return nbytes

    def _renew(self, engine: LLMEngine, request_id: str) -> bool:
        hold = self._holds.get(request_id)
        if hold is not None:
            hold.deadline = time.monotonic() + self.lease_s
        return hold is not None

    def _release(self, engine: LLMEngine, request_id: str) -> bool:
        hold = self._holds.get(request_id)
        if hold is None:
            return False
        hold.release_requested = True
        with self._sends_to_note_lock:
            packing = request_id in self._sends_to_note      # a send is being packed: _note_send decides
        if not packing and (hold.transfer_state is None or hold.transfer_state.is_final):
            self._drop(engine, request_id)
        return True

    def _drop(self, engine: LLMEngine, request_id: str) -> None:
        with self._sends_to_note_lock:
            hold = self._holds.get(request_id)
            if hold is not None and request_id in self._sends_to_note:   # being packed: _note_send drops it
                hold.drop_requested = True
                return
            self._holds.pop(request_id, None)
        if hold is not None and hold.transfer_id is not None:
            self._forget_send(engine, hold.transfer_id)
        if engine.abort_request(request_id) and hold is None:
            # aborted before its first token: its prefill() call still waits for one (an abort that
            # overtook the caller's own cancellation, which Serve cancels on a best-effort basis)
            self._engine.deliver([aborted_output(request_id)])

    def _forget_send(self, engine: LLMEngine, transfer_id: str) -> None:
        engine.collective_rpc(kv_handoff.forget_transfer, transfer_id)
        self._send_budget.release(transfer_id)

    def _tick(self, engine: LLMEngine) -> bool:
        """Polls the sends in flight, frees released holds and expired leases."""
        in_flight = {h.transfer_id: rid for rid, h in self._holds.items()
                     if h.transfer_id is not None and not h.transfer_state.is_final}
        if in_flight:
            per_rank = engine.collective_rpc(kv_handoff.poll_transfers, list(in_flight))
            for tid, rid in in_flight.items():
                state, error = kv_handoff.combine_states([r[tid] for r in per_rank])
                hold = self._holds[rid]
                hold.transfer_state = state
                if state.is_final:
                    self._send_budget.release(tid)
                if state is TransferState.FAILED:
                    log.warning("KV send of %s failed: %s", rid, error)
                if state.is_final and hold.release_requested:
                    self._drop(engine, rid)
        now = time.monotonic()
        # a send on the wire keeps its hold past the lease until it ends (a transport's sends
        # end within its timeout), for one more lease at most
        expired = [rid for rid, h in self._holds.items()
                   if h.deadline < now and rid not in self._sends_to_note and not h.drop_requested
                   and (h.transfer_state is None or h.transfer_state.is_final or h.deadline + self.lease_s < now)]
        for rid in expired:
            log.warning("the KV lease of %s expired after %.0f s without a release; freeing it", rid, self.lease_s)
            self._drop(engine, rid)
        return bool(in_flight)


class _HoldOnFirstToken:
    """The output sink of one prefill request: on the engine thread, as soon as
    the first token is out, set up the hold and answer the caller (no wait for
    another engine iteration)."""

    def __init__(self, worker: PrefillWorker, future: asyncio.Future):
        self.worker, self.future = worker, future

    def put(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finish_reason == "abort" and not out.token_ids:
                settle_from_thread(self.future, exc=RequestAbortedError(
                    f"request {out.request_id} was aborted on {self.worker.name} before its first token"))
                continue
            try:
                settle_from_thread(self.future, self.worker._hold(out))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                settle_from_thread(self.future, exc=exc)

    def fail(self, exc: BaseException) -> None:
        settle_from_thread(self.future, exc=EngineStoppedError(f"the engine stopped: {exc}"))


def _add_held_request(engine: LLMEngine, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, arrival: float) -> None:
    engine.add_request(request_id, prompt_token_ids, params, hold_kv=True, output_kind=OutputKind.DELTA,
                       arrival_time=arrival)

