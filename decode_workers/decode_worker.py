"""The decode worker: receives a request's KV from a prefill worker and decodes
it in the continuous batch (plain class; decode_server.py wraps it for Ray Serve).

    generate(DecodeRequest)
        ─▶ reserving: blocks for the prompt's KV (waits while the cache is full)
        ─▶ receiving: staging buffers posted ── yield ReadyToReceive
                       (the router now tells the prefill worker to send)
        ─▶ scatter into the blocks, admit with the first token ── yield KVReceived
        ─▶ running: continuous batching decode ── yield RequestOutput ... finished
        ─▶ finished: blocks freed

Closing the generator early (client gone) or a failed transfer ends the request
wherever it is and frees its blocks; the prompt is never recomputed here when
the transfer succeeded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from cluster.transport import kv_handoff
from cluster.serving.handoff import DecodeRequest, KVReceived, KVTransferFailed, ReadyToReceive
from cluster.transport.kv_transport import KVReceiver, PeerAddress, TransferState
from engine.async_engine import AsyncEngine, settle_from_thread
from engine.engine_config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine


@dataclass(slots=True)
class _Pending:
    """A request between reserve and admission (engine thread only)."""
    request: DecodeRequest
    future: asyncio.Future                 # reserving: (bytes, receive future); receiving: (state, error, first)
    deadline: float
    block_ids: list[int] | None = None
    failed: bool = False                   # the transfer failed; waiting for the request's abort
    free_blocks_seen: int = -1             # free blocks at the last reserve that did not fit


class DecodeWorker:
    def __init__(self, config: EngineConfig, make_receiver: Callable[[int, torch.device], KVReceiver], *,
                 reserve_timeout_s: float = 60.0, transfer_timeout_s: float = 60.0, name: str = "decode"):
        """Call from a running event loop, then `await start()`."""
        self.config = config
        self.name = name
        self.reserve_timeout_s = reserve_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._make_receiver = make_receiver
        self._engine = AsyncEngine(lambda: LLMEngine(config), prefill=False, name=f"{name}-engine")
        self._reserving: dict[str, _Pending] = {}   # engine thread only
        self._receiving: dict[str, _Pending] = {}
        self.receivers: list[PeerAddress] = []

    async def start(self) -> None:
        await self._engine.ready()
        self.receivers = await self._engine.call(LLMEngine.collective_rpc, kv_handoff.attach_receiver,
                                                 self._make_receiver)
        self._engine.add_ticker(self._tick)

    async def generate(self, request: DecodeRequest) -> AsyncIterator:
        """Yields ReadyToReceive, KVReceived, then cumulative RequestOutputs (the
        first carries the prefill side's first token). Raises KVTransferFailed,
        InvalidRequestError, or TimeoutError when no blocks free up in time."""
        rid = request.request_id
        loop = asyncio.get_running_loop()
        stream = self._engine.open_stream(rid)
        finished = False
        try:
            reserved = loop.create_future()
            t0 = time.monotonic()
            await self._engine.call(self._reserve, request, reserved)
            nbytes, received = await reserved
            t1 = time.monotonic()
            yield ReadyToReceive(request.transfer_id, list(self.receivers), t1 - t0)
            state, error, first = await received
            if state is not TransferState.DONE:
                raise KVTransferFailed(f"the KV of request {rid} did not arrive at {self.name}: {error}")
            yield KVReceived(time.monotonic() - t1, nbytes)
            finished = first.finished
            yield first
            if not finished:
                async for out in self._engine.outputs(stream):
                    finished = out.finished
                    yield out
        finally:
            self._engine.close_stream(rid)
            if not finished:
                await self._engine.call_for_cleanup(self._abort, rid)

    def check_health(self) -> None:
        """Raises when the engine loop has stopped (a step failed, or a TP rank died)."""
        self._engine.check_alive()

    def stats(self) -> dict[str, float]:
        """Load figures for routing and metrics; requests still reserving count as waiting."""
        stats = self._engine.load_stats()
        if stats:
            stats["num_waiting"] += len(self._reserving)
            stats["num_receiving"] = float(len(self._receiving))
        return stats

    def shutdown(self) -> None:
        self._engine.shutdown()

    # ---- engine thread ----------------------------------------------------------------------
    def _reserve(self, engine: LLMEngine, request: DecodeRequest, future: asyncio.Future) -> None:
        rid = request.request_id
        if rid in self._reserving or rid in self._receiving:
            raise InvalidRequestError(f"request id {rid!r} is already in use on {self.name}", "request_id")
        pending = _Pending(request, future, time.monotonic() + self.reserve_timeout_s)
        self._reserving[rid] = pending
        self._try_reserve(engine, pending)

    def _try_reserve(self, engine: LLMEngine, pending: _Pending) -> None:
        """Reserves the blocks and posts the receives in one go (no engine step
        in between); resolves the reserve future with (bytes, receive future)."""
        r = pending.request
        try:
            blocks = engine.reserve_prefilled(
                r.request_id, r.prompt_token_ids, r.prefill.first_token_id, r.params,
                first_logprobs=r.prefill.first_logprobs, generator_state=r.prefill.generator_state)
            if blocks is not None:
                nbytes = sum(engine.collective_rpc(kv_handoff.start_receive, r.transfer_id, len(blocks),
                                                   r.prefill.sender_names, r.prefill.num_kv_heads))
        except Exception as exc:  # noqa: BLE001 - handed to the waiting request
            del self._reserving[r.request_id]
            if r.request_id in engine.scheduler.reserved:   # reserved, but the receives failed to post
                engine.collective_rpc(kv_handoff.forget_transfer, r.transfer_id)
                engine.abort_request(r.request_id)
            settle_from_thread(pending.future, exc=exc)
            return
        if blocks is None:
            pending.free_blocks_seen = engine.block_manager.num_free_blocks
            if time.monotonic() > pending.deadline:
                del self._reserving[r.request_id]
                settle_from_thread(pending.future, exc=TimeoutError(
                    f"{self.name} had no free KV blocks for request {r.request_id} for "
                    f"{self.reserve_timeout_s:.0f} s"))
            return
        del self._reserving[r.request_id]
        reserved = pending.future
        pending.block_ids = blocks
        pending.future = reserved.get_loop().create_future()
        pending.deadline = time.monotonic() + self.transfer_timeout_s
        self._receiving[r.request_id] = pending
        settle_from_thread(reserved, (nbytes, pending.future))

    def _admit(self, engine: LLMEngine, rid: str):
        """The KV is in: scatter it into the blocks and join the running batch."""
        pending = self._receiving.pop(rid)
        engine.collective_rpc(kv_handoff.finish_receive, pending.request.transfer_id, pending.block_ids)
        return engine.commit_prefilled(rid)

    def _abort(self, engine: LLMEngine, rid: str) -> None:
        pending = self._reserving.pop(rid, None) or self._receiving.pop(rid, None)
        if pending is not None:
            engine.collective_rpc(kv_handoff.forget_transfer, pending.request.transfer_id)
            settle_from_thread(pending.future, exc=asyncio.CancelledError())
        engine.abort_request(rid)

    def _tick(self, engine: LLMEngine) -> bool:
        free = engine.block_manager.num_free_blocks
        now = time.monotonic()
        for pending in list(self._reserving.values()):
            # blocks free up only as requests finish: retry when that happened (or to time out)
            if free != pending.free_blocks_seen or now > pending.deadline:
                self._try_reserve(engine, pending)
        waiting = {p.request.transfer_id: rid for rid, p in self._receiving.items() if not p.failed}
        if waiting:
            per_rank = engine.collective_rpc(kv_handoff.poll_transfers, list(waiting))
            now = time.monotonic()
            for tid, rid in waiting.items():
                pending = self._receiving[rid]
                state, error = kv_handoff.combine_states([r[tid] for r in per_rank])
                if not state.is_final and now > pending.deadline:
                    state, error = TransferState.FAILED, f"timed out after {self.transfer_timeout_s:.0f} s"
                if state is TransferState.DONE:
                    settle_from_thread(pending.future, (state, None, self._admit(engine, rid)))
                elif state is TransferState.FAILED:
                    # stays in _receiving: the request's abort forgets the transfer and frees the blocks
                    pending.failed = True
                    settle_from_thread(pending.future, (state, error, None))
        return bool(waiting)
