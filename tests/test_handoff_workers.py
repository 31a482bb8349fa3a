"""Prefill worker → KV transport → decode worker, without Ray: the plain worker
classes behind the Serve deployments, driven by the router's ServingBackend.

- fake transport: parity, the first token streamed from the prefill side,
  conditional disaggregation, per-step output batches, and every failure
  (injected, peer death, client abort, expired lease) ends the request with a
  clear error and frees the blocks on both sides;
- real per-pair gloo groups between TP gangs of different degrees: the KV that
  lands in the decode cache is bit-for-bit the prefill cache's, re-sharded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from cluster.transport import kv_handoff
from cluster.transport.fake_transport import FakeTransportHub
from cluster.transport.kv_transport import TransferState
from cluster.transport.transport_factory import (
    TransportSettings,
    receiver_factory,
    sender_factory,
)
from cluster.serving.messages import DecodeRequest, KVHolderLost, KVTransferFailed
from decode_workers.decode_worker import DecodeWorker
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import EngineStoppedError
from engine.outputs import joined
from engine.kv_head_map import remap_kv_shards
from prefill_workers.prefill_worker import PrefillWorker
from router.backend import BackendUnavailableError, ModelInfo
from router.disaggregation_policy import DisaggregationPolicy
from router.serving_backend import ServingBackend

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _later(coro) -> None:
    """Fire and forget, as a Serve call that nobody awaits."""
    asyncio.get_running_loop().create_task(coro)


class LocalPrefillPool:
    """The prefill pool over one in-process worker (Serve routes these calls in a cluster)."""

    def __init__(self, worker: PrefillWorker):
        self.worker = worker
        self.calls = 0

    async def prefill(self, request_id, prompt_token_ids, params):
        self.calls += 1
        return await self.worker.prefill(request_id, prompt_token_ids, params)

    def release(self, result):
        _later(self.worker.release(result.request_id))

    def abort_everywhere(self, request_id):
        _later(self.worker.abort(request_id))


class LocalPrefillPeer:
    """The prefill pool as the decode worker reaches it."""

    def __init__(self, worker: PrefillWorker):
        self.worker = worker

    async def send_kv(self, replica_id, request_id, transfer_id, receivers):
        try:
            return await self.worker.send_kv(request_id, transfer_id, receivers)
        except KeyError:            # as ServePrefillPeer maps it
            raise KVHolderLost(f"the prefill worker holds no KV for {request_id}") from None

    def release(self, replica_id, request_id):
        _later(self.worker.release(request_id))

    async def renew(self, replica_id, request_id):
        return await self.worker.renew(request_id)


class LocalDecodePool:
    """The decode pool over one in-process worker (a retry lands on the same one)."""

    def __init__(self, worker: DecodeWorker):
        self.worker = worker
        self.attempts = 0
        self.local = 0
        self.broadcast_aborts: list[str] = []
        self._cleanups: set[asyncio.Future] = set()

    async def generate(self, request, avoid_replica=None):
        self.attempts += request.prefill is not None
        self.local += request.prefill is None
        return await self.worker.generate(request)

    async def abort(self, replica_id, request_id):
        await self.worker.abort(request_id)

    def abort_everywhere(self, request_id):
        self.broadcast_aborts.append(request_id)
        self._cleanups.add(asyncio.ensure_future(self.worker.abort(request_id)))

    def stream(self, replica_id, subscriber):
        return self.worker.stream(subscriber)


class Pair:
    def __init__(self, model_dir, hub: FakeTransportHub, lease_s: float = 30.0,
                 policy: DisaggregationPolicy | None = None, max_migrations: int = 0,
                 staging_budget_bytes: int | None = None, send_budget_bytes: int | None = None):
        """max_migrations 0 (migration off): these tests look at the hand-off's own retries.
        The staging budgets: the decode worker's, the prefill worker's."""
        config = EngineConfig(model=str(model_dir), max_model_len=128, block_size=8, dtype="float32",
                              num_kv_blocks=64)
        self.hub = hub
        self.prefill = PrefillWorker(config, lambda rank, device: hub.sender(f"p{rank}"), lease_s=lease_s,
                                     staging_budget_bytes=send_budget_bytes, replica_id="P")
        self.decode = DecodeWorker(config, lambda rank, device: hub.receiver(f"d{rank}"),
                                   LocalPrefillPeer(self.prefill), transfer_timeout_s=10,
                                   staging_budget_bytes=staging_budget_bytes, replica_id="D")
        self.prefill_pool = LocalPrefillPool(self.prefill)
        self.decode_pool = LocalDecodePool(self.decode)
        self.backend = ServingBackend(ModelInfo("tiny", 128, 512), self.decode_pool, self.prefill_pool, policy,
                                      subscriber="router-0", max_migrations=max_migrations)

    async def start(self):
        await self.prefill.start()
        await self.decode.start()
        return self

    async def run(self, request_id: str, prompt: list[int], params=GREEDY):
        """The request's whole output (the backend streams deltas)."""
        return joined([out async for out in self.backend.generate(request_id, prompt, params)])

    async def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Until neither side holds a block (prefix-cached blocks count as free)."""
        deadline = time.monotonic() + timeout_s
        while True:
            p, d = self.prefill.stats(), self.decode.stats()
            if p["kv_cache_usage"] == 0 and p["num_held"] == 0 and d["kv_cache_usage"] == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks still held: prefill {p}, decode {d}")
            await asyncio.sleep(0.02)

    async def shutdown(self):
        await self.backend.close()
        self.prefill.shutdown()
        self.decode.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42] * 6, [300, 2, 77, 91, 100, 12, 13, 14, 15, 16, 17]]
ONE_BLOCK_PROMPTS = [[5 + i, 6, 7, 8, 9, 10, 11] for i in range(4)]   # 7 tokens, blocks of 8


def _uncount_forgotten(monkeypatch, in_flight: set) -> None:
    """A transfer forgotten on any rank leaves `in_flight`."""
    forget = kv_handoff.forget_transfer
    monkeypatch.setattr(kv_handoff, "forget_transfer",
                        lambda worker, tid: (in_flight.discard(tid), forget(worker, tid))[1])


def _block_bytes(model_dir) -> int:
    """One KV block of Pair's engines, K and V, all layers."""
    config = EngineConfig(model=str(model_dir), max_model_len=128, block_size=8, dtype="float32", num_kv_blocks=64)
    return LLMEngine(config).worker.kv_cache.spec.bytes_per_block


def _sends(engine) -> list[list[str]]:
    """The transfers each rank's sender still tracks."""
    return engine.collective_rpc(lambda worker: sorted(worker.attachments[kv_handoff.SENDS]))


async def _until(condition, timeout_s: float = 30.0) -> None:
    """Polls `condition` until it holds; `timeout_s` is a hang guard, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still not true after {timeout_s:g} s"
        await asyncio.sleep(0.01)


async def _hold_engine(engine) -> tuple[threading.Event, asyncio.Future]:
    """The AsyncEngine's thread held in a call (as in a long step) until the returned gate is set:
    calls queued meanwhile run after it, in order. Returns (the gate, the held call)."""
    gate, entered = threading.Event(), threading.Event()

    def hold(_engine) -> None:
        entered.set()
        gate.wait(30)
    held = asyncio.ensure_future(engine.call(hold))
    await _until(entered.is_set)
    return gate, held


def _queued_calls(engine) -> int:
    """Calls waiting for the AsyncEngine's thread."""
    return engine._calls.qsize()


class _LeaseClock:
    """The prefill worker's clock (its leases) made the test's: it stands still but for `advance`, so a
    loaded machine's stalls never run a lease out, until `run` lets it go on at real speed. The
    worker's ticks are counted, so that a test can wait for one that saw the time it set."""

    def __init__(self, monkeypatch):
        from prefill_workers import prefill_worker
        self._frozen, self._running_since, self.ticks = time.monotonic(), None, 0
        monkeypatch.setattr(prefill_worker, "time", SimpleNamespace(monotonic=self))
        tick = prefill_worker.PrefillWorker._tick

        def counted(worker, engine):
            try:
                return tick(worker, engine)
            finally:
                self.ticks += 1
        monkeypatch.setattr(prefill_worker.PrefillWorker, "_tick", counted)   # (before the worker starts)

    def __call__(self) -> float:
        if self._running_since is None:
            return self._frozen
        return self._frozen + time.monotonic() - self._running_since

    def run(self) -> None:
        self._frozen, self._running_since = self(), time.monotonic()

    async def advance(self, seconds: float, worker: PrefillWorker) -> None:
        """What `worker`'s engine has queued runs at the old time; then the clock moves on, and this
        waits until a whole tick ran at the new time."""
        await worker._engine.call(lambda engine: None)
        self._frozen += seconds
        seen = self.ticks
        deadline = time.monotonic() + 30
        while self.ticks < seen + 2:       # (the tick under way may have read the old time)
            assert time.monotonic() < deadline, "the prefill engine stopped ticking"
            worker._engine.wake()
            await asyncio.sleep(0.01)


def test_handoff_matches_transformers_greedy(model_dirs, reference):
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        try:
            outs = await asyncio.gather(*[pair.run(str(i), p) for i, p in enumerate(PROMPTS)])
            await pair.wait_idle()
            return outs
        finally:
            await pair.shutdown()
    outs = run(main())
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference("tiny").greedy(tuple(prompt), 10)
        assert out.finished and out.finish_reason == "length"


def test_prompt_logprobs_come_from_the_prefill_worker_and_stay_off_the_hand_off(model_dirs, reference):
    """The prefill worker scores the prompt; the scores reach the client with the first
    token, and the request handed to the decode worker carries none of them."""
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        handed = []
        generate = pair.decode_pool.generate

        async def recording(request, avoid_replica=None):
            handed.append(request)
            return await generate(request, avoid_replica)
        pair.decode_pool.generate = recording
        try:
            return await pair.run("s", PROMPTS[1], dataclasses.replace(GREEDY, prompt_logprobs=2)), handed
        finally:
            await pair.shutdown()
    out, handed = run(main())
    alone = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, block_size=8,
                                   dtype="float32"))
    alone.add_request("s", PROMPTS[1], dataclasses.replace(GREEDY, max_tokens=1, prompt_logprobs=2))
    (expected,) = alone.run_to_completion()
    assert out.prompt_logprobs == expected.prompt_logprobs
    assert out.token_ids == reference("tiny").greedy(tuple(PROMPTS[1]), 10)
    (request,) = handed
    assert request.prefill is not None and request.prefill.first.prompt_logprobs is None


@pytest.mark.parametrize("budget_blocks, most_in_flight", [(None, 4), (2, 2), (0.5, 1)])
def test_receive_buffers_in_flight_stay_within_the_staging_budget(model_dirs, reference, monkeypatch,
                                                                  budget_blocks, most_in_flight):
    # four one-block prompts handed off at once over transfers that take 0.3 s each; a budget
    # smaller than one request's KV still lets one at a time through
    posted, in_flight = [], set()
    start, finish = kv_handoff.start_receive, kv_handoff.finish_receive

    def counted_start(worker, transfer_id, num_blocks, *args):
        in_flight.add(transfer_id)
        posted.append(len(in_flight))
        return start(worker, transfer_id, num_blocks, *args)

    monkeypatch.setattr(kv_handoff, "start_receive", counted_start)
    monkeypatch.setattr(kv_handoff, "finish_receive",
                        lambda worker, tid, *a: (in_flight.discard(tid), finish(worker, tid, *a))[1])
    _uncount_forgotten(monkeypatch, in_flight)
    prompts = ONE_BLOCK_PROMPTS

    async def main():
        block_bytes = _block_bytes(model_dirs["tiny"])
        budget = None if budget_blocks is None else int(budget_blocks * block_bytes)
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(delay_s=0.3), staging_budget_bytes=budget).start()
        try:
            outs = await asyncio.gather(*[pair.run(str(i), p) for i, p in enumerate(prompts)])
            await pair.wait_idle()
            return outs
        finally:
            await pair.shutdown()

    outs = run(main())
    assert max(posted) == most_in_flight and len(posted) == 4
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference("tiny").greedy(tuple(prompt), 10)


@pytest.mark.parametrize("budget_blocks, most_in_flight", [(None, 4), (2, 2), (0.5, 1)])
def test_packed_sends_in_flight_stay_within_the_prefill_staging_budget(model_dirs, reference, monkeypatch,
                                                                       budget_blocks, most_in_flight):
    # the decode side takes all four one-block hand-offs at once (no budget of its own, as with
    # four decode workers); the prefill side packs and sends at most its budget's worth at a time
    started, in_flight, seen = [], set(), []
    start, poll = kv_handoff.start_send, kv_handoff.poll_transfers

    def counted_start(worker, transfer_id, *args):
        in_flight.add(transfer_id)
        started.append(len(in_flight))
        return start(worker, transfer_id, *args)

    def counted_poll(worker, transfer_ids):
        states = poll(worker, transfer_ids)
        in_flight.difference_update(tid for tid, (state, _) in states.items() if state.is_final)
        return states

    monkeypatch.setattr(kv_handoff, "start_send", counted_start)
    monkeypatch.setattr(kv_handoff, "poll_transfers", counted_poll)
    _uncount_forgotten(monkeypatch, in_flight)
    prompts = ONE_BLOCK_PROMPTS

    async def main():
        block_bytes = _block_bytes(model_dirs["tiny"])
        budget = None if budget_blocks is None else int(budget_blocks * block_bytes)
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(delay_s=0.3), send_budget_bytes=budget).start()

        async def watch():
            while True:
                seen.append(pair.prefill.stats()["kv_staging_bytes"] / block_bytes)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        try:
            outs = await asyncio.gather(*[pair.run(str(i), p) for i, p in enumerate(prompts)])
            await pair.wait_idle()
            assert pair.prefill.stats()["kv_staging_bytes"] == 0
            return outs
        finally:
            watcher.cancel()
            await pair.shutdown()

    outs = run(main())
    assert max(started) == most_in_flight and len(started) == 4
    assert max(seen) == most_in_flight     # the stat counts the packed copies, one block each
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference("tiny").greedy(tuple(prompt), 10)


@pytest.mark.parametrize("when", ["connect", "transfer"])
def test_a_failed_transfer_is_retried_once_then_fails_cleanly(model_dirs, reference, when):
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        try:
            pair.hub.fail_next(1, when=when, message="link down")
            retried = await pair.run("retried", PROMPTS[0])
            assert pair.decode_pool.attempts == 2
            await pair.wait_idle()
            pair.hub.fail_next(2, when="transfer", message="link down")   # the pair is up by now
            with pytest.raises(BackendUnavailableError, match=r"did not arrive at decode.*link down.*migration is off"):
                await pair.run("bad", PROMPTS[1])
            assert pair.decode_pool.attempts == 4
            await pair.wait_idle()
            # the next request goes through on the same pair of workers
            return retried, await pair.run("good", PROMPTS[1])
        finally:
            await pair.shutdown()
    retried, good = run(main())
    assert retried.token_ids == reference("tiny").greedy(tuple(PROMPTS[0]), 10)
    assert good.token_ids == reference("tiny").greedy(tuple(PROMPTS[1]), 10)


def test_a_receive_that_cannot_be_posted_is_a_failed_hand_off_retried_elsewhere(model_dirs, reference,
                                                                               monkeypatch):
    # the decode side's receiver closed (or a staging buffer out of memory) as the receives were posted:
    # the client, who has the first token, must not get a 500 in the middle of its stream
    from cluster.transport.fake_transport import FakeReceiver
    expect, failures = FakeReceiver.expect, []

    def expect_once_failing(self, transfer_id, sender_name, buffer):
        if not failures:
            failures.append(transfer_id)
            raise RuntimeError("injected: the KV receiver is closed")
        return expect(self, transfer_id, sender_name, buffer)
    monkeypatch.setattr(FakeReceiver, "expect", expect_once_failing)

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        try:
            out = await pair.run("r", PROMPTS[0])
            assert failures and pair.decode_pool.attempts == 2
            await pair.wait_idle()
            return out
        finally:
            await pair.shutdown()
    assert run(main()).token_ids == reference("tiny").greedy(tuple(PROMPTS[0]), 10)


def test_a_prompts_queue_time_counts_its_wait_for_the_engine_thread(model_dirs):
    # timed from when the engine thread took it, a prompt that arrived during a long step reported no
    # queue time: TTFT minus (queue + prefill) left a gap nothing explained
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        gate = threading.Event()
        try:
            gate, held = await _hold_engine(pair.prefill._engine)          # a long step in progress
            prefill = asyncio.ensure_future(pair.prefill.prefill("r", PROMPTS[0], GREEDY))
            await _until(lambda: "r" in pair.prefill._queued_prompt_tokens)   # it arrived
            arrived = time.monotonic()
            await asyncio.sleep(0.2)
            released = time.monotonic()
            gate.set()
            await held
            result = await prefill
            assert await pair.prefill.release("r")
            return result.first.first_token_times, released - arrived
        finally:
            gate.set()
            await pair.shutdown()
    times, waited = run(main())
    # arrival <= arrived, first scheduled >= released: at least the wait the test made, whatever the load
    assert times.queue_s >= waited, (times, waited)


def test_a_failed_scatter_into_the_decode_cache_forgets_its_staging_buffers(model_dirs, reference):
    # the pieces were taken off the books before the write: a write that failed (a CUDA error,
    # say) left the receiver's expect and its staging buffer registered for good
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        kv_cache = pair.decode._engine.engine.worker.kv_cache
        write, failures = kv_cache.write_blocks, []

        def write_once_failing(block_ids, buffer, heads=None):
            if not failures:
                failures.append(1)
                raise RuntimeError("injected: the scatter failed")
            return write(block_ids, buffer, heads)
        kv_cache.write_blocks = write_once_failing
        try:
            out = await pair.run("r", PROMPTS[0])
            await pair.wait_idle()
            with pair.hub._lock:
                left = dict(pair.hub._expects)
            return out, failures, left
        finally:
            await pair.shutdown()
    out, failures, left = run(main())
    assert failures == [1] and out.token_ids == reference("tiny").greedy(tuple(PROMPTS[0]), 10)   # retried
    assert left == {}


def test_a_request_that_cannot_join_the_batch_after_its_kv_arrived_is_retried(model_dirs, reference):
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        engine = pair.decode._engine.engine
        commit, failures = engine.commit_prefilled, []

        def commit_once_failing(request_id):
            if not failures:
                failures.append(request_id)
                raise RuntimeError("injected commit failure")
            return commit(request_id)

        engine.commit_prefilled = commit_once_failing
        try:
            out = await asyncio.wait_for(pair.run("r", PROMPTS[0]), 30)   # not a hang
            assert failures == ["r"] and pair.decode_pool.attempts == 2
            await pair.wait_idle()                                           # nothing leaked
            return out
        finally:
            await pair.shutdown()
    assert run(main()).token_ids == reference("tiny").greedy(tuple(PROMPTS[0]), 10)


def test_a_dead_sender_fails_the_transfer_instead_of_hanging(model_dirs):
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(delay_s=5.0)).start()
        try:
            task = asyncio.create_task(pair.run("x", PROMPTS[2]))
            while pair.decode.stats()["num_receiving"] == 0 or pair.prefill.stats()["num_held"] == 0:
                await asyncio.sleep(0.01)
            pair.hub.kill("p0")   # for good: the retry finds the sender dead too
            with pytest.raises(BackendUnavailableError, match="p0"):
                await task
            await pair.wait_idle()
        finally:
            await pair.shutdown()
    run(main())


def test_a_send_call_that_outlasts_the_transfer_deadline_is_cancelled_at_it(model_dirs):
    """The decode side's transfer deadline runs while the prefill replica has not
    answered the send call yet (it may wait for its staging budget): at the
    deadline the hand-off fails and the call is cancelled, instead of both sides
    waiting for the call's own timeout."""
    class SilentPeer(LocalPrefillPeer):
        def __init__(self, worker):
            super().__init__(worker)
            self.cancelled = 0

        async def send_kv(self, replica_id, request_id, transfer_id, receivers):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        peer = pair.decode._peer = SilentPeer(pair.prefill)
        pair.decode.transfer_timeout_s = 0.4
        try:
            # a hang guard: the calls never answer, so only the deadline ends them
            with pytest.raises(BackendUnavailableError, match="timed out after 0.4 s"):
                await asyncio.wait_for(pair.run("x", PROMPTS[0]), 30)
            assert peer.cancelled == 2                 # two attempts (one retry), each call cancelled at it
            await pair.wait_idle()
        finally:
            await pair.shutdown()
    run(main())


def test_a_worker_that_shuts_down_closes_its_kv_transport(model_dirs):
    """Its peers hear at once: a transfer from a prefill worker that stopped fails
    instead of waiting for the transport's timeout."""
    async def main():
        hub = FakeTransportHub(delay_s=60.0)
        pair = await Pair(model_dirs["tiny"], hub).start()
        try:
            receiver = hub.receiver("decode-x")
            await pair.prefill.prefill("r", PROMPTS[0], GREEDY)
            receiver.expect("t/0", "p0", torch.zeros(_block_bytes(model_dirs["tiny"]), dtype=torch.uint8))
            await pair.prefill.send_kv("r", "t", [receiver.address])
            assert receiver.poll("t/0", "p0") is TransferState.TRANSFERRING
            pair.prefill.shutdown()
            assert receiver.poll("t/0", "p0") is TransferState.FAILED
            assert "p0 closed" in receiver.error("t/0", "p0")
        finally:
            await pair.shutdown()
    run(main())


def test_a_client_that_leaves_mid_transfer_frees_both_sides(model_dirs):
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(delay_s=60.0)).start()
        try:
            task = asyncio.create_task(pair.run("gone", PROMPTS[0]))
            while pair.decode.stats()["num_receiving"] == 0:
                await asyncio.sleep(0.01)
            assert pair.decode.stats()["kv_cache_usage"] > 0 and pair.prefill.stats()["num_held"] == 1
            one_block = pair.decode._engine.engine.worker.kv_cache.spec.bytes_per_block
            assert pair.decode.stats()["kv_staging_bytes"] == one_block       # a 7-token prompt, blocks of 8
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await pair.wait_idle()
            assert pair.decode.stats()["kv_staging_bytes"] == 0
        finally:
            await pair.shutdown()
    run(main())


def test_kv_nobody_picks_up_is_freed_when_its_lease_expires(model_dirs):
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), lease_s=0.3).start()
        try:
            result = await pair.prefill.prefill("orphan", PROMPTS[1], GREEDY)
            assert result.num_blocks == 3 and pair.prefill.stats()["num_held"] == 1
            await pair.wait_idle(timeout_s=5)
            assert await pair.prefill.release("orphan") is False
        finally:
            await pair.shutdown()
    run(main())


def test_a_renewed_hold_outlives_its_lease_and_then_expires(model_dirs, monkeypatch):
    clock = _LeaseClock(monkeypatch)

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), lease_s=30.0).start()
        try:
            result = await pair.prefill.prefill("waiting", PROMPTS[1], GREEDY)
            assert result.lease_s == 30.0
            for _ in range(4):                              # 80 s: over twice the lease, renewed every 20 s
                await clock.advance(20.0, pair.prefill)
                assert await pair.prefill.renew("waiting") is True
            assert pair.prefill.stats()["num_held"] == 1
            await clock.advance(31.0, pair.prefill)         # no more renewals: it expires
            assert pair.prefill.stats()["num_held"] == 0
            await pair.wait_idle()
            assert await pair.prefill.renew("waiting") is False
        finally:
            await pair.shutdown()
    run(main())


def test_a_send_starts_the_lease_again(model_dirs, monkeypatch):
    """A decode worker that asks for the KV late in the lease gets the whole
    lease for the transfer: the hold is not freed under a send."""
    from cluster.transport.kv_transport import PeerAddress
    clock = _LeaseClock(monkeypatch)

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), lease_s=30.0).start()
        try:
            await pair.prefill.prefill("late", PROMPTS[1], GREEDY)
            await clock.advance(20.0, pair.prefill)
            # nobody posted the receive: the fake transfer fails, and the hold stays for a retry
            await pair.prefill.send_kv("late", "t-late", [PeerAddress("d0", "127.0.0.1", 1)])
            await clock.advance(20.0, pair.prefill)        # 40 s: past the first lease
            assert pair.prefill.stats()["num_held"] == 1
            await clock.advance(11.0, pair.prefill)        # 51 s: past the one the send started too
            assert pair.prefill.stats()["num_held"] == 0
            await pair.wait_idle()
        finally:
            await pair.shutdown()
    run(main())


def test_a_hold_is_not_freed_while_its_send_is_on_the_wire(model_dirs, monkeypatch):
    """A transfer that outlasts the lease keeps its hold until it ends (for one
    more lease at most); then the lease applies again."""
    from cluster.transport.kv_transport import PeerAddress
    clock = _LeaseClock(monkeypatch)

    async def main():
        hub = FakeTransportHub(delay_s=45.0, clock=clock)   # the transfer takes 45 s of the lease clock
        pair = await Pair(model_dirs["tiny"], hub, lease_s=30.0).start()
        try:
            await pair.prefill.prefill("probe", PROMPTS[1], GREEDY)     # learns the packed size
            nbytes = await pair.prefill.send_kv("probe", "t-probe", [PeerAddress("nobody", "fake", 0)])
            await pair.prefill.abort("probe")
            receiver, received = hub.receiver("slow-decode"), torch.zeros(nbytes, dtype=torch.uint8)
            await pair.prefill.prefill("slow", PROMPTS[1], GREEDY)
            receiver.expect("t-slow/0", "p0", received)       # rank 0's part
            await pair.prefill.send_kv("slow", "t-slow", [receiver.address])
            assert receiver.poll("t-slow/0", "p0") is TransferState.TRANSFERRING     # started at 0 s
            held = await pair.prefill._engine.call(
                lambda e: e.read_kv_shards(list(e.held_sequence("slow").block_table))[0])
            await clock.advance(40.0, pair.prefill)          # past the lease, the transfer still on the wire
            assert pair.prefill.stats()["num_held"] == 1
            assert receiver.poll("t-slow/0", "p0") is TransferState.TRANSFERRING
            await clock.advance(10.0, pair.prefill)          # 50 s: the transfer is done
            assert receiver.poll("t-slow/0", "p0") is TransferState.DONE
            assert torch.equal(received.view(held.dtype), held.flatten())   # the held blocks, whole
            await pair.wait_idle(timeout_s=5)                # never released: the lease frees it now
        finally:
            await pair.shutdown()
    run(main())


def test_a_send_that_never_ends_keeps_its_hold_one_more_lease_at_most(model_dirs, monkeypatch):
    from cluster.transport.kv_transport import PeerAddress
    clock = _LeaseClock(monkeypatch)

    async def main():
        hub = FakeTransportHub(delay_s=600.0, clock=clock)   # a transport that never finishes it
        pair = await Pair(model_dirs["tiny"], hub, lease_s=30.0).start()
        try:
            await pair.prefill.prefill("probe", PROMPTS[1], GREEDY)
            nbytes = await pair.prefill.send_kv("probe", "t-probe", [PeerAddress("nobody", "fake", 0)])
            await pair.prefill.abort("probe")
            receiver = hub.receiver("stuck-decode")
            await pair.prefill.prefill("stuck", PROMPTS[1], GREEDY)
            receiver.expect("t-stuck/0", "p0", torch.zeros(nbytes, dtype=torch.uint8))
            await pair.prefill.send_kv("stuck", "t-stuck", [receiver.address])
            assert receiver.poll("t-stuck/0", "p0") is TransferState.TRANSFERRING
            await clock.advance(45.0, pair.prefill)           # past the lease, within the second
            assert pair.prefill.stats()["num_held"] == 1
            await clock.advance(20.0, pair.prefill)           # 65 s: past the second: freed all the same
            assert pair.prefill.stats()["num_held"] == 0
            assert receiver.poll("t-stuck/0", "p0") is not TransferState.DONE
            await pair.wait_idle(timeout_s=5)
        finally:
            await pair.shutdown()
    run(main())


def test_a_decode_worker_waiting_for_blocks_renews_the_hold_until_they_free_up(monkeypatch):
    """Blocks can take longer to free up than the hold's lease (reserve_timeout_s
    is the longer): the waiting decode worker renews the hold every third of it."""
    from decode_workers import decode_worker
    renewed, waits, reserved = [], [], None

    class Peer:
        async def renew(self, replica_id, request_id):
            renewed.append((replica_id, request_id))
            if len(renewed) == 3:                       # the blocks free up after the third renewal
                reserved.set_result((1024, "arrival"))
            return True

    class SpiedAsyncio:
        """decode_worker's asyncio, the timeouts of its waits noted."""
        def __getattr__(self, name):
            return getattr(asyncio, name)

        @staticmethod
        async def wait(aws, *, timeout=None, **kwargs):
            waits.append(timeout)
            return await asyncio.wait(aws, timeout=timeout, **kwargs)

    monkeypatch.setattr(decode_worker, "asyncio", SpiedAsyncio())

    async def main():
        nonlocal reserved
        worker = DecodeWorker.__new__(DecodeWorker)     # the wait needs no engine, only that it runs
        worker._peer = Peer()
        worker._engine = SimpleNamespace(check_alive=lambda: None)
        prefill = SimpleNamespace(replica_id="P", request_id="r1", lease_s=0.15)
        reserved = asyncio.get_running_loop().create_future()
        assert await worker._wait_for_blocks(reserved, prefill) == (1024, "arrival")
        # a renewal per wait of a third of the lease (the gaps never reach the lease, whatever the
        # machine's load), and none once the blocks are there
        assert renewed == [("P", "r1")] * 3
        assert len(waits) == 4 and all(timeout == pytest.approx(0.15 / 3) for timeout in waits)

        waiting = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(worker._wait_for_blocks(waiting, prefill))
        await _until(lambda: len(waits) > 4)            # it waits
        task.cancel()                                   # the request went away: the reservation too
        with pytest.raises(asyncio.CancelledError):
            await task
        assert waiting.cancelled()
    run(main())


def test_a_hand_off_waiting_for_blocks_gives_up_once_the_prefill_worker_lost_the_kv(model_dirs, monkeypatch):
    """The decode cache is full, so the hand-off waits for blocks (up to
    reserve_timeout_s, a minute), renewing the prefill hold. The prefill worker
    loses the hold (as when its replica dies): the next renewal finds nothing
    there, and the hand-off fails with KVHolderLost within a third of the lease
    or two, leaving nothing behind, instead of waiting out the minute."""
    _LeaseClock(monkeypatch)      # stands still: only the abort loses the hold, never a stall of the machine

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), lease_s=0.3).start()
        pair.decode._engine.engine.reserve_prefilled = lambda *a, **kw: None     # no room: it waits
        renewals, renew, lost = [], pair.decode._peer.renew, False

        async def noted_renew(replica_id, request_id):
            renewals.append(lost)                     # (started after the hold was lost?)
            return await renew(replica_id, request_id)
        pair.decode._peer.renew = noted_renew
        try:
            first = await pair.prefill.prefill("h", PROMPTS[0], GREEDY)
            waiting = asyncio.ensure_future(pair.decode.generate(
                DecodeRequest("h", PROMPTS[0], GREEDY, "sub", first, "h#1")))
            await _until(lambda: len(renewals) >= 3)  # renewed meanwhile: still waiting
            assert not waiting.done() and pair.prefill.stats()["num_held"] == 1
            await pair.prefill.abort("h")
            lost = True
            with pytest.raises(KVHolderLost, match="no longer holds the KV of h") as info:
                await asyncio.wait_for(waiting, 30)   # a hang guard: reserve_timeout_s is a minute
            # the next renewal (or the one after it) found nothing there: no more were made
            assert info.value.replica_id == "D" and renewals.count(True) <= 2, renewals
            assert pair.decode.stats()["num_waiting"] == 0
            await pair.wait_idle(timeout_s=2)
        finally:
            await pair.shutdown()
    run(main())


def test_a_hand_off_that_finds_no_room_in_time_names_the_full_replica(model_dirs):
    """Past reserve_timeout_s without room, the hand-off fails naming its decode
    replica, so that the router's retry goes to another one instead of waiting out
    the same full replica again; the prefill side keeps its hold for that retry."""
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        pair.decode.reserve_timeout_s = 0.2
        pair.decode._engine.engine.reserve_prefilled = lambda *a, **kw: None     # no room: it waits
        try:
            first = await pair.prefill.prefill("h", PROMPTS[0], GREEDY)
            with pytest.raises(KVTransferFailed, match="decode had no room for request h .* for 0.2 s") as info:
                await asyncio.wait_for(pair.decode.generate(
                    DecodeRequest("h", PROMPTS[0], GREEDY, "sub", first, "h#1")), 5.0)
            assert info.value.replica_id == "D"
            assert pair.decode.stats()["num_waiting"] == 0 and pair.prefill.stats()["num_held"] == 1
            await pair.prefill.abort("h")
            await pair.wait_idle(timeout_s=2)
        finally:
            await pair.shutdown()
    run(main())


def test_a_gone_prefill_replica_reads_as_a_lost_hold_to_the_decode_side():
    """ServePrefillPeer: a call to a prefill replica that is gone (or that holds
    nothing for the request) is KVHolderLost for send_kv and False for renew;
    a renewal with no answer in time is None (not known)."""
    from ray.exceptions import RayTaskError

    from cluster.serving.replica_routing import ReplicaGoneError
    from decode_workers import decode_server

    class Response:
        def __init__(self, outcome):
            self.outcome, self.cancelled = outcome, False

        def __await__(self):
            yield from asyncio.sleep(0).__await__()
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome

        def cancel(self):
            self.cancelled = True
            if isinstance(self.outcome, BaseException):   # as Serve's cancel() does for a failed call
                raise self.outcome

    class Handle:
        def __init__(self, outcome):
            self.send_kv = self.renew = SimpleNamespace(remote=lambda *a, **kw: Response(outcome))

    async def main():
        for outcome, fragment in ((ReplicaGoneError("replica P is not running"), "is gone"),
                                  (KeyError("h"), "holds no KV for h")):
            peer = decode_server.ServePrefillPeer(Handle(outcome))
            with pytest.raises(KVHolderLost, match=fragment):
                await peer.send_kv("P", "h", "h#1", [])
        with pytest.raises(TimeoutError):       # anything else is the transfer's own failure
            await decode_server.ServePrefillPeer(Handle(TimeoutError("slow"))).send_kv("P", "h", "h#1", [])
        assert await decode_server.ServePrefillPeer(Handle(ReplicaGoneError("gone"))).renew("P", "h") is False
        assert await decode_server.ServePrefillPeer(Handle(False)).renew("P", "h") is False
        assert await decode_server.ServePrefillPeer(Handle(True)).renew("P", "h") is True
        assert await decode_server.ServePrefillPeer(Handle(RuntimeError("no answer"))).renew("P", "h") is None
        # a replica whose engine stopped holds nothing it can send (Ray wraps the replica's own error)
        stopped = RayTaskError("send_kv", "traceback", EngineStoppedError("the engine stopped"))
        with pytest.raises(KVHolderLost, match="cannot serve"):
            await decode_server.ServePrefillPeer(Handle(stopped)).send_kv("P", "h", "h#1", [])
        assert await decode_server.ServePrefillPeer(Handle(stopped)).renew("P", "h") is False
    run(main())


def test_a_renewal_slower_than_a_third_of_the_lease_is_still_read():
    """Renewals go one at a time: an answer that comes after the next tick is
    read there, not dropped for a newer renewal (whose answer could be late too)."""
    class SlowPeer:
        calls = 0

        async def renew(self, replica_id, request_id):
            self.calls += 1
            await asyncio.sleep(0.12)             # over two ticks of a 0.15 s lease
            return False                          # the holder is gone

    async def main():
        worker = DecodeWorker.__new__(DecodeWorker)
        worker._peer, worker.name, worker.replica_id = SlowPeer(), "decode", "D"
        worker._engine = SimpleNamespace(check_alive=lambda: None)
        prefill = SimpleNamespace(replica_id="P", request_id="r1", lease_s=0.15)
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(KVHolderLost, match="no longer holds the KV of r1"):
            await asyncio.wait_for(worker._wait_for_blocks(never, prefill), 2.0)
        return worker._peer.calls
    assert run(main()) == 1


@pytest.mark.parametrize("phase", ["waiting for blocks", "receiving"])
def test_a_hand_off_fails_at_once_when_the_decode_engine_stops(model_dirs, phase, monkeypatch):
    """A hand-off waits on what only the engine loop settles (free blocks, the KV
    arriving): when the loop stops, the request fails with EngineStoppedError
    (which the router retries elsewhere), and the prefill hold is no longer
    renewed, so it ends with its lease (once no send reads it)."""
    clock = _LeaseClock(monkeypatch)       # stands still until the engine stopped: no stall runs the lease out

    async def main():
        hub = FakeTransportHub()
        pair = await Pair(model_dirs["tiny"], hub, lease_s=1.0).start()
        engine = pair.decode._engine.engine
        if phase == "waiting for blocks":
            engine.reserve_prefilled = lambda *a, **kw: None      # no room: it waits for blocks
        else:
            hub.delay_s = 60.0                                     # the KV takes a minute to arrive
        first = await pair.prefill.prefill("h", PROMPTS[0], GREEDY)
        waiting = asyncio.ensure_future(pair.decode.generate(DecodeRequest("h", PROMPTS[0], GREEDY, "sub", first,
                                                                           "h#1")))
        await _until(lambda: pair.decode.stats()["num_waiting" if phase == "waiting for blocks" else "num_receiving"])
        assert not waiting.done()

        def fails(**kwargs):
            raise RuntimeError("a step failed")
        engine.step = fails
        await pair.decode.generate(DecodeRequest("other", [1, 2, 3], GREEDY, "sub2"))   # makes the loop step
        # at the loop's stop, not at a deadline (the transfer's 10 s, the wait for blocks' minute): the message
        # says so; the timeout is a hang guard
        with pytest.raises(EngineStoppedError, match="engine stopped while request h waited for its KV"):
            await asyncio.wait_for(waiting, 30)
        hub.delay_s = 0.0             # a send still on the wire keeps its blocks until it ends: now
        clock.run()                   # the lease (1 s), unrenewed, runs out; a renewed one never would
        await _until(lambda: pair.prefill.stats()["num_held"] == 0, timeout_s=10)
        pair.prefill.shutdown()
        pair.decode.shutdown()
    run(main())


def test_a_hand_off_aborted_on_the_decode_side_fails_as_a_transfer_not_as_a_cancel(model_dirs):
    """A decode replica that aborts a waiting hand-off (its router's stream closed)
    answers it with KVTransferFailed naming itself, which the router retries
    elsewhere; a CancelledError would read as the client having left."""
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        pair.decode._engine.engine.reserve_prefilled = lambda *a, **kw: None     # it waits for blocks
        first = await pair.prefill.prefill("h", PROMPTS[0], GREEDY)
        waiting = asyncio.ensure_future(pair.decode.generate(DecodeRequest("h", PROMPTS[0], GREEDY, "sub", first,
                                                                           "h#1")))
        await asyncio.sleep(0.2)
        await pair.decode.abort("h")
        with pytest.raises(KVTransferFailed, match="aborted on") as exc:
            await asyncio.wait_for(waiting, 5.0)
        assert exc.value.replica_id == "D"
        pair.prefill.shutdown()
        pair.decode.shutdown()
    run(main())


def test_an_abort_that_lands_before_the_first_token_ends_the_prefill_call(model_dirs):
    """Serve cancels a call on a best-effort basis: the router's broadcast abort can
    reach a prefill replica whose call still runs, after its prompt was added and
    before its first token. The call used to wait for that token for ever."""
    import threading

    from engine.errors import RequestAbortedError

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        gate = threading.Event()
        blocker = asyncio.ensure_future(pair.prefill._engine.call(lambda engine: gate.wait(5)))
        await asyncio.sleep(0.05)
        # queued behind the blocker, in this order: the prompt's add, then the abort (no step between)
        call = asyncio.ensure_future(pair.prefill.prefill("r", PROMPTS[0], GREEDY))
        await asyncio.sleep(0.05)
        abort = asyncio.ensure_future(pair.prefill.abort("r"))
        await asyncio.sleep(0.05)
        gate.set()
        await blocker
        await asyncio.wait_for(abort, 5.0)
        with pytest.raises(RequestAbortedError, match="aborted on .* before its first token"):
            await asyncio.wait_for(call, 5.0)
        assert pair.prefill.stats()["queued_prefill_tokens"] == 0
        await pair.wait_idle()
        pair.prefill.shutdown()
        pair.decode.shutdown()
    run(main())


def test_a_prefill_call_that_arrives_after_its_abort_is_refused(model_dirs):
    """The router's broadcast abort can overtake the call it cleans up after (the client left
    while the call was on its way): the call ran to a hold nobody would release until its
    lease ran out. It is refused now, holding nothing; other requests are served."""
    from engine.errors import RequestAbortedError

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        await pair.prefill.abort("gone")
        with pytest.raises(RequestAbortedError, match="aborted on .* before it arrived"):
            await pair.prefill.prefill("gone", PROMPTS[0], GREEDY)
        assert pair.prefill.stats()["num_held"] == 0
        assert pair.prefill.stats()["queued_prefill_tokens"] == 0
        assert (await pair.run("other", PROMPTS[0])).finish_reason == "length"
        await pair.wait_idle()
        pair.prefill.shutdown()
        pair.decode.shutdown()
    run(main())


def test_a_worker_whose_engine_stopped_reports_no_room_to_the_router():
    from cluster.serving.worker_deployment import WorkerDeployment

    class Stopped:
        def check_health(self):
            raise EngineStoppedError("the engine is not running")

        def stats(self):
            return {"free_kv_blocks": 900.0}            # its last figures: stale

        def shutdown(self):                             # the replica's __del__ stops its worker
            pass
        def step_samples(self):
            return []
    replica = WorkerDeployment.__new__(WorkerDeployment)
    replica.worker = Stopped()
    stats = replica.record_routing_stats()
    assert stats["free_kv_blocks"] == 0.0 and stats["queued_prefill_tokens"] >= 1e18
    # nor is it a replica serving to the autoscaler (it counted one until Serve replaced it)
    with pytest.raises(EngineStoppedError):
        replica.step_samples()


def test_each_replica_samples_unseeded_requests_with_a_seed_of_its_own(monkeypatch):
    """Replicas of one deployment get one EngineConfig; with its seed they drew the same noise,
    and the choices of an `n` request, spread over them, came out the same."""
    from cluster.serving import worker_deployment
    from cluster.serving.worker_deployment import WorkerDeployment

    ids = iter(["replica-a", "replica-b"])
    monkeypatch.setattr(worker_deployment.serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id=next(ids))))
    monkeypatch.setattr(worker_deployment.sys, "setswitchinterval", lambda interval: None)
    monkeypatch.setattr(worker_deployment, "use_serve_handlers", lambda: None)   # (this process's loggers)
    deployed = EngineConfig(model="tiny", seed=0)
    configs = []
    for _ in range(2):
        replica = WorkerDeployment.__new__(WorkerDeployment)
        configs.append(run(replica.join_gang(deployed)))
        assert replica.replica_id in ("replica-a", "replica-b")
    assert configs[0].seed != configs[1].seed
    assert [dataclasses.replace(c, seed=0) for c in configs] == [deployed, deployed]


def test_a_send_retried_before_the_first_was_noted_forgets_the_first(model_dirs):
    """One rank packs and queues a send off the engine thread and notes it there
    later; a retry (towards another decode worker) that comes while the engine is
    busy must still forget the first send, not leave it queued beside the second."""
    async def main():
        hub = FakeTransportHub()
        pair = await Pair(model_dirs["tiny"], hub).start()
        prefill = pair.prefill
        await prefill.prefill("r", PROMPTS[1], GREEDY)
        receivers = list(pair.decode.receivers)
        gate, held = await _hold_engine(prefill._engine)          # a long step: no note for now
        try:
            await prefill.send_kv("r", "r#1", receivers)          # packed here, its note queued
            assert "r" in prefill._sends_to_note
            retry = asyncio.ensure_future(prefill.send_kv("r", "r#2", receivers))
            await _until(lambda: _queued_calls(prefill._engine) >= 2)     # the retry queued behind the note
        finally:
            gate.set()
        await held
        await retry

        assert await prefill._engine.call(_sends) == [["r#2"]]
        assert await prefill.release("r")
        await pair.wait_idle()
        prefill.shutdown()
        pair.decode.shutdown()
    run(main())


def test_a_send_waiting_for_the_prefill_staging_budget_keeps_its_hold(model_dirs, reference):
    """Two one-block hand-offs on a budget of one block, each transfer longer than
    the lease: the second waits for the first to end, its hold renewed meanwhile,
    and neither is retried."""
    async def main():
        block = _block_bytes(model_dirs["tiny"])
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(delay_s=1.0), lease_s=0.6,
                          send_budget_bytes=block).start()
        try:
            outs = await asyncio.gather(*[pair.run(str(i), p) for i, p in enumerate(ONE_BLOCK_PROMPTS[:2])])
            assert pair.decode_pool.attempts == 2
            await pair.wait_idle()
            return outs
        finally:
            await pair.shutdown()

    for prompt, out in zip(ONE_BLOCK_PROMPTS, run(main())):
        assert out.token_ids == reference("tiny").greedy(tuple(prompt), 10)


async def _packing_slowly(prefill, request_id: str, seconds: float, monkeypatch):
    """The KV `request_id` holds, as it will arrive; from now on packing a send takes
    `seconds` longer. Returns (that KV, the cache, its own read_blocks to restore)."""
    held = await prefill._engine.call(
        lambda e: e.read_kv_shards(list(e.held_sequence(request_id).block_table))[0])
    kv_cache = prefill._engine.engine.worker.kv_cache
    read_blocks = kv_cache.read_blocks

    def slow_read(block_ids, heads=None):
        time.sleep(seconds)
        return read_blocks(block_ids, heads)

    monkeypatch.setattr(kv_cache, "read_blocks", slow_read)
    return held, kv_cache, read_blocks


def _expecting(hub: FakeTransportHub, held: torch.Tensor, piece_id: str):
    """A receiver expecting `held`'s bytes from the prefill worker's rank ("p0") as `piece_id`:
    (the receiver, the buffer they arrive in)."""
    receiver = hub.receiver("decode-x")
    received = torch.zeros(held.numel() * held.element_size(), dtype=torch.uint8)
    receiver.expect(piece_id, "p0", received)
    return receiver, received


async def _arrives_whole(receiver, piece_id: str, received: torch.Tensor, held: torch.Tensor) -> None:
    """Within 5 s the piece is DONE, and the buffer holds `held`'s bytes."""
    deadline = time.monotonic() + 5
    while (state := receiver.poll(piece_id, "p0")) is not TransferState.DONE:
        assert time.monotonic() < deadline, state
        await asyncio.sleep(0.05)
    assert torch.equal(received.view(held.dtype), held.flatten())


def test_a_hold_packed_off_the_engine_thread_is_not_freed_while_it_packs(model_dirs, monkeypatch):
    """One rank packs on the caller's thread while the engine thread runs on. A
    lease that runs out during a slow pack must not free the blocks being read
    (the next prompt would write into them): the hold stays, the send carries
    the held KV whole, and the lease starts again once the send is noted."""
    async def main():
        hub = FakeTransportHub()
        pair = await Pair(model_dirs["tiny"], hub, lease_s=1.2).start()
        prefill = pair.prefill
        try:
            await prefill.prefill("slow", PROMPTS[1], GREEDY)
            # past the lease (1.2 s, of which > 1 s was left when it began)
            held, kv_cache, read_blocks = await _packing_slowly(prefill, "slow", 1.6, monkeypatch)
            receiver, received = _expecting(hub, held, "t-slow/0")
            await prefill.send_kv("slow", "t-slow", [receiver.address])
            monkeypatch.setattr(kv_cache, "read_blocks", read_blocks)
            await asyncio.sleep(0.3)            # the engine thread notes the send
            assert prefill.stats()["num_held"] == 1
            await _arrives_whole(receiver, "t-slow/0", received, held)
            assert await prefill.release("slow")
            await pair.wait_idle()
        finally:
            await pair.shutdown()
    run(main())


def test_a_release_that_arrives_while_a_send_is_packed_waits_for_that_send(model_dirs, monkeypatch):
    """A release (say, a decode worker's from an earlier try) reaches the prefill worker
    while its one rank packs the next send: the send still goes out whole, and the
    blocks are freed when it ends (before, the release acted as an abort: the send was
    forgotten and its decode worker waited out the transfer timeout)."""
    async def main():
        hub = FakeTransportHub(delay_s=0.5)      # the bytes move for 0.5 s once the send is posted
        pair = await Pair(model_dirs["tiny"], hub).start()
        prefill = pair.prefill
        gate, released = threading.Event(), threading.Event()
        release_here = prefill._release

        def noted_release(engine, request_id):
            try:
                return release_here(engine, request_id)
            finally:
                released.set()
        monkeypatch.setattr(prefill, "_release", noted_release)
        try:
            await prefill.prefill("r", PROMPTS[1], GREEDY)
            held, kv_cache, read_blocks = await _packing_slowly(prefill, "r", 0.0, monkeypatch)
            receiver, received = _expecting(hub, held, "t-r/0")

            def read_once_released(block_ids, heads=None):
                # packing, on this (the event loop's) thread: the engine, let go, runs the release meanwhile
                gate.set()
                assert released.wait(30), "the release did not run while the send was packed"
                return read_blocks(block_ids, heads)

            gate, step = await _hold_engine(prefill._engine)     # a step: the release queues behind it
            release = asyncio.create_task(prefill.release("r"))
            await _until(lambda: _queued_calls(prefill._engine) >= 1)
            monkeypatch.setattr(kv_cache, "read_blocks", read_once_released)
            await prefill.send_kv("r", "t-r", [receiver.address])
            assert await release
            await step
            monkeypatch.setattr(kv_cache, "read_blocks", read_blocks)
            await _arrives_whole(receiver, "t-r/0", received, held)
            await pair.wait_idle()                         # and the release frees the hold after the send
        finally:
            gate.set()
            await pair.shutdown()
    run(main())


def test_a_decode_worker_whose_kv_receiver_gave_up_fails_its_health_check(model_dirs):
    from cluster.transport.kv_handoff import RECEIVER

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        try:
            pair.decode.check_health()                                       # healthy
            receiver = pair.decode._engine.engine.worker.attachments[RECEIVER]
            receiver.problem = lambda: "KV receiver d0 stopped accepting pairs: its store failed"
            with pytest.raises(EngineStoppedError, match="stopped accepting pairs") as info:
                pair.decode.check_health()
            assert info.value.replica_id == "D"
        finally:
            await pair.shutdown()
    run(main())


def _follower_receiver_gives_up(worker) -> None:
    """(A collective call.) The KV receiver of every rank but 0 stops accepting pairs."""
    if worker.tp.rank > 0:
        worker.attachments[kv_handoff.RECEIVER]._accept_failure = "KV receiver stopped accepting pairs: injected"


def test_a_tp_decode_worker_whose_follower_ranks_receiver_gave_up_fails_its_health_check(model_dirs, monkeypatch):
    # every hand-off to the replica then fails at the connect timeout and is retried elsewhere, while routing
    # by free blocks keeps choosing it: only rank 0's receiver was read
    from decode_workers import decode_worker
    monkeypatch.setattr(decode_worker, "RANKS_RECEIVER_CHECK_S", 0.2, raising=False)
    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, block_size=8, dtype="float32",
                          num_kv_blocks=32, tensor_parallel_size=2)

    async def main():
        worker = DecodeWorker(config, receiver_factory(TransportSettings(timeout_s=20), "d"),
                              SimpleNamespace(), replica_id="D")
        await worker.start()
        try:
            await asyncio.sleep(0.5)
            worker.check_health()                                            # healthy
            await worker._engine.call(LLMEngine.collective_rpc, _follower_receiver_gives_up)
            deadline = time.monotonic() + 10
            while True:
                try:
                    worker.check_health()
                except EngineStoppedError as exc:
                    return exc
                assert time.monotonic() < deadline, "the follower rank's receiver was never read"
                await asyncio.sleep(0.05)
        finally:
            worker.shutdown()
    error = run(main())
    assert "rank 1: KV receiver stopped accepting pairs: injected" in str(error) and error.replica_id == "D"


async def _nothing_left_on_the_wire(pair: Pair, release: str | None = None) -> None:
    """No send is tracked nor counted by the staging budget; the holds then free
    (after releasing `release`'s, when given)."""
    assert await pair.prefill._engine.call(_sends) == [[]]
    assert pair.prefill.stats()["kv_staging_bytes"] == 0
    if release is not None:
        assert await pair.prefill.release(release)
    await pair.wait_idle()


def _noted(prefill: PrefillWorker, request_id: str, transfer_id: str) -> bool:
    """The engine thread noted the send `transfer_id` of `request_id`'s hold."""
    hold = prefill._holds.get(request_id)
    return hold is not None and hold.transfer_id == transfer_id


async def _retry_queued_behind_a_long_step(pair: Pair) -> tuple[asyncio.Task, threading.Event, asyncio.Future]:
    """Request "r" prefilled and its first send ("r#1") noted; the engine held in a
    long step until the returned gate is set; a retry ("r#2") queued for it.
    Returns (the retry's task, the gate, the long step)."""
    prefill = pair.prefill
    await prefill.prefill("r", PROMPTS[1], GREEDY)
    receivers = list(pair.decode.receivers)
    await prefill.send_kv("r", "r#1", receivers)
    await _until(lambda: _noted(prefill, "r", "r#1"))          # noted: a retry goes to the engine
    gate, step = await _hold_engine(prefill._engine)            # a long step
    retry = asyncio.create_task(prefill.send_kv("r", "r#2", receivers))
    await _until(lambda: _queued_calls(prefill._engine) >= 1)
    return retry, gate, step


def test_a_send_call_cancelled_while_queued_for_the_engine_forgets_the_send_it_starts(model_dirs):
    """send_kv's caller goes away while its call waits for the engine thread: the
    send the engine starts afterwards is forgotten, and its packed copy is not
    left on the wire uncounted by the staging budget."""
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(delay_s=5.0)).start()
        gate = threading.Event()
        try:
            retry, gate, step = await _retry_queued_behind_a_long_step(pair)
            retry.cancel()
            await asyncio.gather(retry, return_exceptions=True)     # its clean-up queued behind its send
            assert retry.cancelled()
            gate.set()
            await step
            await _nothing_left_on_the_wire(pair, release="r")
        finally:
            gate.set()
            await pair.shutdown()
    run(main())


def test_a_release_that_came_while_a_cancelled_send_was_queued_frees_the_hold(model_dirs):
    """The release found the send in flight and waited for it; the send's caller
    then went away: once the engine forgets that send, the hold goes too (not a
    lease later)."""
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(delay_s=5.0)).start()
        prefill = pair.prefill
        gate = threading.Event()
        try:
            retry, gate, step = await _retry_queued_behind_a_long_step(pair)
            release = asyncio.create_task(prefill.release("r"))        # queued behind the retry's send
            await _until(lambda: _queued_calls(prefill._engine) >= 2)
            retry.cancel()
            await asyncio.gather(retry, return_exceptions=True)     # its clean-up queued behind the release
            assert retry.cancelled()
            gate.set()
            assert await release
            await _until(lambda: not prefill.stats()["num_held"], timeout_s=10)   # not a lease (30 s) later
            await _nothing_left_on_the_wire(pair)
        finally:
            gate.set()
            await pair.shutdown()
    run(main())


def test_a_send_for_a_request_holding_nothing_fails_at_once_whatever_waits_for_the_budget(model_dirs):
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), send_budget_bytes=1024).start()
        prefill = pair.prefill
        try:
            await prefill._send_budget.acquire("busy", 1024)
            waiting = asyncio.create_task(prefill._send_budget.acquire("queued", 1024, timeout_s=30))
            await _until(lambda: prefill._send_budget._waiting)
            # not a wait for the budget (send_wait_s, then a TimeoutError): the timeout is a hang guard
            with pytest.raises(KeyError, match="holds no KV"):
                await asyncio.wait_for(prefill.send_kv("nothing", "n#1", list(pair.decode.receivers)), 30)
            waiting.cancel()
        finally:
            await pair.shutdown()
    run(main())


def test_a_send_that_fails_on_one_rank_is_forgotten_on_every_rank(model_dirs, monkeypatch):
    """With several ranks, one rank failing to pack leaves the others' pieces
    queued: the whole transfer is forgotten, on every rank."""
    from engine.model_worker import RankCallError

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(delay_s=5.0)).start()
        prefill = pair.prefill
        engine = prefill._engine.engine
        try:
            await prefill.prefill("r", PROMPTS[1], GREEDY)
            receivers = list(pair.decode.receivers)
            await prefill.send_kv("r", "r#1", receivers)
            await _until(lambda: _noted(prefill, "r", "r#1"))          # noted: a retry goes to the engine
            collective_rpc = engine.collective_rpc

            def another_rank_fails(fn, *args):
                results = collective_rpc(fn, *args)                      # this rank queued its pieces
                if fn is kv_handoff.start_send:
                    raise RankCallError("rank 1: out of memory packing the KV")
                return results

            monkeypatch.setattr(engine, "collective_rpc", another_rank_fails)
            with pytest.raises(RankCallError, match="out of memory"):
                await prefill.send_kv("r", "r#2", receivers)
            monkeypatch.setattr(engine, "collective_rpc", collective_rpc)
            await _nothing_left_on_the_wire(pair, release="r")
        finally:
            await pair.shutdown()
    run(main())


# ---- real pair groups between TP gangs -------------------------------------------------------
def _wait(engine: LLMEngine, tid: str, deadline: float) -> TransferState:
    while True:
        (state, error) = kv_handoff.combine_states([r[tid] for r in engine.collective_rpc(
            kv_handoff.poll_transfers, [tid])])
        if state.is_final or time.monotonic() > deadline:
            assert state is TransferState.DONE, error
            return state
        time.sleep(0.005)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1), (2, 2)])
def test_kv_arrives_bit_for_bit_between_tp_gangs(model_dirs, reference, prefill_tp, decode_tp):
    base = dict(model=str(model_dirs["tiny"]), max_model_len=128, block_size=8, dtype="float32", num_kv_blocks=32)
    prefill = LLMEngine(EngineConfig(**base, tensor_parallel_size=prefill_tp))
    decode = LLMEngine(EngineConfig(**base, tensor_parallel_size=decode_tp))
    settings = TransportSettings(timeout_s=20)
    try:
        names = prefill.collective_rpc(kv_handoff.attach_sender, sender_factory(settings, "p"))
        addresses = decode.collective_rpc(kv_handoff.attach_receiver, receiver_factory(settings, "d"))
        assert len(names) == prefill_tp and len(addresses) == decode_tp
        heads = prefill.model_config.num_kv_heads
        prompt = PROMPTS[2] * 2
        prefill.add_request("r", prompt, GREEDY, hold_kv=True)
        (first,) = prefill.run_to_completion()
        src_blocks = prefill.held_sequence("r").block_table
        dst_blocks = decode.reserve_prefilled("r", prompt, first.token_ids[0], GREEDY)
        decode.collective_rpc(kv_handoff.start_receive, "t", len(dst_blocks), names, heads)
        packed = prefill.collective_rpc(kv_handoff.start_send, "t", src_blocks, addresses, heads)
        spec = prefill.kv_cache.spec
        assert max(packed) == kv_handoff.packed_bytes_per_rank(
            len(src_blocks), spec.bytes_per_block // spec.num_kv_heads, heads, prefill_tp, decode_tp)
        deadline = time.monotonic() + 30
        _wait(decode, "t", deadline)
        _wait(prefill, "t", deadline)
        decode.collective_rpc(kv_handoff.finish_receive, "t", dst_blocks)
        sent = remap_kv_shards(prefill.read_kv_shards(src_blocks), heads, decode_tp)
        got = decode.read_kv_shards(dst_blocks)
        assert len(sent) == len(got) and all(torch.equal(s, g) for s, g in zip(sent, got))
        assert any(s.abs().sum() > 0 for s in sent)   # real KV, not two zero caches
        decode.commit_prefilled("r")
        (out,) = decode.run_to_completion()
        assert out.token_ids == reference("tiny").greedy(tuple(prompt), 10)
    finally:
        for engine in (prefill, decode):
            engine.collective_rpc(kv_handoff.close_transport)
            engine.shutdown()


def test_a_hand_off_whose_admission_and_clean_up_both_fail_is_answered(model_dirs):
    """A rank that dies as the KV is scattered in fails the admission, and the
    clean-up's collective after it: the waiting request still hears why (it waited
    for ever: the hand-off had left the table that a stopping engine fails)."""
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        engine = pair.decode._engine.engine
        rpc = engine.collective_rpc

        def rank_gone(*args):
            raise RuntimeError("a tensor-parallel rank died")

        def without_forget(fn, *args):
            return rank_gone() if fn is kv_handoff.forget_transfer else rpc(fn, *args)
        engine.commit_prefilled = rank_gone
        engine.collective_rpc = without_forget
        try:
            first = await pair.prefill.prefill("h", PROMPTS[0], GREEDY)
            with pytest.raises(KVTransferFailed, match="admitting it after its KV arrived failed: a tensor-parallel"):
                await asyncio.wait_for(pair.decode.generate(
                    DecodeRequest("h", PROMPTS[0], GREEDY, "sub", first, "h#1")), 10.0)
        finally:
            engine.collective_rpc = rpc
            await pair.prefill.abort("h")
            await pair.shutdown()
    run(main())


def test_a_stream_cancelled_again_while_it_aborts_its_requests_still_aborts_every_one(model_dirs):
    """Closing a subscriber's stream aborts its requests; a second cancel during that
    clean-up (the replica shutting down right after) stopped it after the first, and
    the rest decoded to their max_tokens for nobody."""
    import threading

    from decode_workers import decode_worker
    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=1024, block_size=8, dtype="float32")
    params = dataclasses.replace(GREEDY, max_tokens=900, ignore_eos=True)
    gate = threading.Event()

    async def main():
        worker = decode_worker.DecodeWorker(config, replica_id="D")
        await worker.start()
        try:
            for i in range(3):
                await worker.generate(DecodeRequest(f"r{i}", PROMPTS[i], params, "router"))
            # the engine held between two steps: none of the three can finish meanwhile
            held = asyncio.ensure_future(worker._engine.call(lambda engine: gate.wait(30)))

            async def reader():
                async for _ in worker.stream("router"):
                    pass
            streaming = asyncio.ensure_future(reader())
            await asyncio.sleep(0.2)             # (the reader waits for the engine's next step)
            streaming.cancel()                   # the stream closes: its finally aborts the three
            while "router" in worker._subscribers:
                await asyncio.sleep(0)           # (the finally's first line: then it waits on an abort)
            streaming.cancel()                   # and is cancelled again in the middle of it
            await asyncio.gather(streaming, return_exceptions=True)
            gate.set()
            await held
            for _ in range(200):                 # (the engine thread runs the aborts when it can)
                if len(aborted) >= 3:
                    break
                await asyncio.sleep(0.05)
            return aborted
        finally:
            gate.set()
            worker.shutdown()
    aborted = []
    abort = decode_worker.DecodeWorker._abort

    def spy(self, engine, rid):
        aborted.append(rid)
        abort(self, engine, rid)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_worker.DecodeWorker, "_abort", spy)
        assert sorted(run(main())) == ["r0", "r1", "r2"]


def test_requests_no_stream_ever_reads_are_aborted(model_dirs, monkeypatch):
    """A router that dies between a request's admission and its stream leaves the
    request decoding to its max_tokens for nobody, and its subscriber's outbox for
    ever: past ORPHAN_S unread, the worker aborts them. A subscriber that streams
    keeps its requests."""
    from decode_workers import decode_worker
    monkeypatch.setattr(decode_worker, "ORPHAN_S", 0.4)
    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, block_size=8, dtype="float32")
    params = dataclasses.replace(GREEDY, max_tokens=100, ignore_eos=True)

    async def main():
        worker = decode_worker.DecodeWorker(config, replica_id="D")
        await worker.start()
        try:
            await worker.generate(DecodeRequest("orphan", PROMPTS[0], params, "gone-router"))
            await worker.generate(DecodeRequest("read", PROMPTS[1], params, "live-router"))
            read = []

            async def reader():
                async for batch in worker.stream("live-router"):
                    read.extend(d for d in batch if d.request_id == "read")
                    await asyncio.sleep(0.3)         # slow, but reading
            streaming = asyncio.ensure_future(reader())
            await asyncio.sleep(1.5)
            stats = worker.stats()
            assert "gone-router" not in worker._subscribers and "live-router" in worker._subscribers
            assert stats["num_running"] + stats["num_waiting"] <= 1      # the orphan is gone
            assert read and not any(d.finish_reason == "abort" for d in read)
            streaming.cancel()
        finally:
            worker.shutdown()
    run(main())


def test_a_failed_orphan_check_is_logged_and_the_next_one_runs(model_dirs, monkeypatch, caplog):
    # the check ran in a task nobody awaited: one exception ended it silently, and requests no stream
    # reads decoded to their max_tokens from then on
    from decode_workers import decode_worker
    monkeypatch.setattr(decode_worker, "ORPHAN_S", 0.4)
    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, block_size=8, dtype="float32")
    params = dataclasses.replace(GREEDY, max_tokens=100, ignore_eos=True)
    failures, aborting = [], []

    async def main():
        worker = decode_worker.DecodeWorker(config, replica_id="D")
        abort_requests_of = worker._abort_requests_of

        async def fails_once(subscriber):
            aborting.append(sorted(subscriber.request_ids))
            if not failures:
                failures.append(1)
                raise RuntimeError("an engine call failed")
            await abort_requests_of(subscriber)
        worker._abort_requests_of = fails_once
        await worker.start()
        gate = threading.Event()
        try:
            await worker.generate(DecodeRequest("orphan", PROMPTS[0], params, "gone-router"))
            await worker.generate(DecodeRequest("orphan-2", PROMPTS[1], params, "gone-too"))
            # held: the requests cannot end by themselves while the checks run
            held = asyncio.ensure_future(worker._engine.call(lambda engine: gate.wait(30)))
            deadline = asyncio.get_running_loop().time() + 30
            while len(aborting) < 2:      # a pass after the one that failed reached a subscriber
                assert asyncio.get_running_loop().time() < deadline, "no check ran after the failed one"
                await asyncio.sleep(0.05)
            gate.set()       # (its abort waits for the engine)
            await held
            while {"gone-router", "gone-too"} & set(worker._subscribers) or len(aborting) < 3:   # both, in the end
                assert asyncio.get_running_loop().time() < deadline, "the failed abort was not tried again"
                await asyncio.sleep(0.05)
        finally:
            gate.set()
            worker.shutdown()
    with caplog.at_level("ERROR", logger="decode_workers.decode_worker"):
        run(main())
    assert failures and "the check for requests nobody reads failed" in caplog.text
    # the subscriber whose abort failed is tried again, not left decoding for nobody
    assert sorted(map(tuple, aborting)) == [("orphan",), ("orphan",), ("orphan-2",)]


def test_a_request_whose_admission_fails_after_its_first_token_leaves_its_outbox(model_dirs, monkeypatch):
    # the client left while its admission waited for the engine, which had already put the first
    # token: detached first, the abort that followed reached no outbox, which kept the id for ever
    from decode_workers import decode_worker
    from engine.outputs import RequestOutput
    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, block_size=8, dtype="float32")
    add_request, workers = decode_worker._add_request, []

    def added_then_failed(engine, request_id, *args):
        add_request(engine, request_id, *args)
        workers[0]._engine.deliver([RequestOutput(request_id, [1, 2], text="a", token_ids=[7], delta_text="a",
                                                  delta_token_ids=[7])])
        raise RuntimeError("the client left")
    monkeypatch.setattr(decode_worker, "_add_request", added_then_failed)

    async def main():
        worker = decode_worker.DecodeWorker(config, replica_id="D")
        workers.append(worker)
        await worker.start()
        try:
            subscriber = worker._subscriber("router-0")
            subscriber.streaming = True                        # (kept: a stream reads it)
            with pytest.raises(RuntimeError, match="the client left"):
                await worker.generate(DecodeRequest("r", PROMPTS[0], GREEDY, "router-0"))
            await worker._engine.call(lambda engine: None)      # the clean-up's engine call has run
            return subscriber.outbox._streaming, worker.stats()
        finally:
            worker.shutdown()
    streaming, stats = run(main())
    assert streaming == set() and stats["num_running"] + stats["num_waiting"] == 0
