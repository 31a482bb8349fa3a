"""The reworked serving path without Ray: the first token comes from the
prefill side before any KV moves, conditional disaggregation keeps short
prompts off the prefill pool with the same output, colocated workers stream
too, and a worker's output stream carries one delta per request per batch."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from cluster.serving.messages import DecodeRequest
from cluster.transport.fake_transport import FakeTransportHub
from decode_workers.decode_worker import DecodeWorker
from decode_workers.delta_outbox import is_urgent
from engine import EngineConfig, SamplingParams
from engine.outputs import joined
from router.backend import ModelInfo
from router.disaggregation_policy import DisaggregationPolicy, DisaggregationSettings
from router.serving_backend import ServingBackend
from tests.test_handoff_workers import GREEDY, PROMPTS, LocalDecodePool, Pair, run


def test_the_first_token_reaches_the_client_before_the_kv_moves(model_dirs, reference):
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(delay_s=0.5)).start()
        try:
            outputs = pair.backend.generate("r", PROMPTS[0], GREEDY)
            first = await anext(outputs)
            # streamed from the prefill result: the decode worker has not even been asked yet
            assert first.token_ids == reference("tiny").greedy(tuple(PROMPTS[0]), 1)
            assert pair.decode_pool.attempts == 0 and pair.decode.stats()["num_running"] == 0
            rest = [out.delta_token_ids async for out in outputs]
            phases = pair.backend.phase_timings("r")
            await pair.wait_idle()
            return first.delta_token_ids, rest, phases
        finally:
            await pair.shutdown()
    first, rest, phases = run(main())
    tokens = first + [t for delta in rest for t in delta]
    assert tokens == reference("tiny").greedy(tuple(PROMPTS[0]), 10)   # each token exactly once
    assert phases.prefill_time > 0 and phases.transfer_time >= 0.5
    assert 0 <= phases.reserve_time < 0.5          # blocks free at once: the decode worker's wait for them
    # the prompt's blocks of K and V, every layer, float32: what pdserve_kv_transfer_bytes reports
    config = json.loads((model_dirs["tiny"] / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    blocks = -(-len(PROMPTS[0]) // 8)                                   # Pair's block_size
    assert phases.transfer_bytes == \
        config["num_hidden_layers"] * 2 * blocks * 8 * config["num_key_value_heads"] * head_dim * 4


def test_a_client_that_leaves_on_the_first_token_frees_the_prefill_hold(model_dirs):
    """Closed while the first token goes out, before any decode worker was
    asked: the router releases the KV the prefill worker holds (not its lease)."""
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), lease_s=600).start()
        try:
            outputs = pair.backend.generate("r", PROMPTS[0], GREEDY)
            await anext(outputs)
            held = pair.prefill.stats()["num_held"]
            await outputs.aclose()
            await pair.wait_idle()
            return held, pair.prefill.stats()["num_held"], pair.decode_pool.attempts
        finally:
            await pair.shutdown()
    assert run(main()) == (1.0, 0.0, 0)


def test_a_request_that_ends_on_its_first_token_never_reaches_a_decode_worker(model_dirs, reference):
    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        try:
            out = await pair.run("one", PROMPTS[1], SamplingParams(max_tokens=1, temperature=0.0))
            await pair.wait_idle()   # the prefill side freed the KV without being told
            return out, pair.decode_pool.attempts
        finally:
            await pair.shutdown()
    out, attempts = run(main())
    assert out.finished and out.finish_reason == "length" and attempts == 0
    assert out.token_ids == reference("tiny").greedy(tuple(PROMPTS[1]), 1)


def test_conditional_disaggregation_keeps_short_prompts_on_the_decode_worker(model_dirs, reference):
    short, long = [5, 6, 7, 8], [40, 41, 42] * 8     # 4 and 24 tokens; the threshold is 8
    policy = DisaggregationPolicy(DisaggregationSettings("conditional", local_prefill_max_tokens=8))

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), policy=policy).start()
        try:
            local = await pair.run("short", short)
            calls_after_short = (pair.prefill_pool.calls, pair.decode_pool.local)
            remote = await pair.run("long", long)
            calls_after_long = (pair.prefill_pool.calls, pair.decode_pool.attempts)
            await pair.wait_idle()
            return local, remote, calls_after_short, calls_after_long
        finally:
            await pair.shutdown()
    local, remote, after_short, after_long = run(main())
    assert after_short == (0, 1)          # never reached the prefill pool
    assert after_long == (1, 1)           # prefilled remotely, handed off once
    assert local.token_ids == reference("tiny").greedy(tuple(short), 10)
    assert remote.token_ids == reference("tiny").greedy(tuple(long), 10)


def test_the_policy_overflows_to_the_decode_worker_only_when_the_prefill_pool_is_behind():
    policy = DisaggregationPolicy(DisaggregationSettings("conditional", local_prefill_max_tokens=16,
                                                         max_remote_wait_s=0.5))
    assert not policy.prefill_locally(100)   # nothing measured yet: no evidence of a backlog
    policy.observe_workers("prefill", [{"prefill_s_per_token": 0.001}])
    policy.observe_workers("decode", [{"prefill_s_per_token": 0.002}])
    assert policy.prefill_locally(16) and not policy.prefill_locally(100)
    policy.started(False, 400)           # 0.4 s of prompts ahead on the prefill replica: within the limit
    assert not policy.prefill_locally(100)
    policy.started(False, 600)           # 1 s ahead: the decode worker's 0.2 s is sooner than 1.1 s
    assert policy.predict_remote_s(100) > policy.predict_local_s(100)
    assert policy.prefill_locally(100)
    assert not policy.prefill_locally(1000)   # 2 s locally: still sooner remotely
    policy.observe_workers("prefill", [{"prefill_s_per_token": 0.001}, {"prefill_s_per_token": 0.001}])
    assert not policy.prefill_locally(100)   # a second prefill replica halves the wait
    policy.first_token(False, 1000)
    assert policy.predict_remote_wait_s() == 0
    always = DisaggregationPolicy(DisaggregationSettings("always"))
    assert not always.prefill_locally(1)
    always.observe_workers("prefill", [])    # the prefill replicas died; no replacement runs yet
    assert always.prefill_locally(5000) and policy.prefill_locally(1000) is False
    always.observe_workers("prefill", [{"prefill_s_per_token": 0.001}])
    assert not always.prefill_locally(5000)


def test_a_prompt_sent_to_a_decode_worker_counts_as_in_flight_until_its_first_token():
    """A decode replica answers `generate` once the prompt is queued there; the prompt
    still waits for its prefill, and the policy must see it, or every long prompt of a
    backlog overflows onto the decode replicas (19 of 20 here, before)."""
    from cluster.serving.messages import Admitted

    class QueueingDecodePool:        # queues each request, and no token comes within the test
        def __init__(self):
            self.local = 0

        async def generate(self, request, avoid_replica=None):
            self.local += request.prefill is None
            return Admitted("D0")

        async def abort(self, replica_id, request_id):
            pass

        async def stream(self, replica_id, subscriber):
            await asyncio.Event().wait()
            yield []

    class BackloggedPrefillPool:     # never answers within the test
        def __init__(self):
            self.calls = 0

        async def prefill(self, request_id, prompt, params):
            self.calls += 1
            await asyncio.Event().wait()

        def release(self, result):
            pass

    async def main():
        policy = DisaggregationPolicy(DisaggregationSettings())
        for role in ("prefill", "decode"):
            policy.observe_workers(role, [{"prefill_s_per_token": 1e-3}])   # 2 s a 2,000-token prompt
        decode, prefill = QueueingDecodePool(), BackloggedPrefillPool()
        backend = ServingBackend(ModelInfo("m", 100_000, 1000), decode, prefill, policy, subscriber="r")

        async def consume(i):
            async for _ in backend.generate(f"req{i}", [1] * 2000, SamplingParams(max_tokens=8)):
                pass
        tasks = []
        for i in range(20):
            tasks.append(asyncio.ensure_future(consume(i)))
            await asyncio.sleep(0.01)
        counts = (prefill.calls, decode.local, policy._local.tokens_in_flight)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return counts, policy._local.tokens_in_flight
    (remote, local, local_in_flight), after = run(main())
    assert (remote, local) == (10, 10)       # each side's queue grows in turn
    assert local_in_flight == 10 * 2000 and after == 0


@pytest.mark.parametrize("min_interval_s", [0.0, 60.0])
def test_a_worker_stream_carries_one_delta_per_request_per_batch(model_dirs, reference, min_interval_s):
    """Eight requests decoding together on a colocated worker: every batch names a
    request at most once, the batches' deltas rebuild each request exactly, and
    there are far fewer batches than tokens (one message per step, not per token).
    With stream batching over a long interval, only a first token or a finish
    sends a batch: every batch carries one."""
    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, block_size=8, dtype="float32",
                          num_kv_blocks=64)
    prompts = {f"r{i}": [7 + i, 20, 30 + i, 41] for i in range(8)}

    async def main():
        worker = DecodeWorker(config, replica_id="C")
        await worker.start()
        gate = threading.Event()
        try:
            stream = worker.stream("router-0", min_interval_s)
            # the engine held until all eight are queued: they decode as one batch from the first step, else
            # a loaded loop admitting them one by one makes more steps than the bound below allows
            held = asyncio.ensure_future(worker._engine.call(lambda engine: gate.wait(30)))
            admissions = [asyncio.ensure_future(worker.generate(DecodeRequest(rid, prompt, GREEDY, "router-0")))
                          for rid, prompt in prompts.items()]

            async def queued():
                while len(worker._queued_prompt_tokens) < len(prompts):
                    await asyncio.sleep(0.01)
            await asyncio.wait_for(queued(), 30)      # a hang guard only
            gate.set()
            await held
            for admitted in await asyncio.gather(*admissions):
                assert admitted.replica_id == "C" and admitted.transfer_time_s is None
            batches, done = [], set()
            while len(done) < len(prompts):
                batch = await asyncio.wait_for(anext(stream), 30)
                batches.append(batch)
                done |= {d.request_id for d in batch if d.finished}
            await stream.aclose()
            return batches
        finally:
            gate.set()
            worker.shutdown()
    batches = run(main())
    tokens = {rid: [] for rid in prompts}
    for batch in batches:
        ids = [d.request_id for d in batch]
        assert len(ids) == len(set(ids)), ids
        for d in batch:
            tokens[d.request_id] += d.token_ids
    for rid, prompt in prompts.items():
        assert tokens[rid] == reference("tiny").greedy(tuple(prompt), 10, ignore_eos=True)
    assert len(batches) <= 10 + 8    # ~one per step (10 tokens each), not one per token (80)
    if min_interval_s:
        assert all(any(is_urgent(d) for d in batch) for batch in batches)
        assert sum(len(d.token_ids) > 1 for batch in batches for d in batch) > 0   # steps were merged


def test_colocated_backend_matches_transformers(model_dirs, reference):
    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, block_size=8, dtype="float32",
                          num_kv_blocks=64)

    async def main():
        worker = DecodeWorker(config, replica_id="C")
        await worker.start()
        backend = ServingBackend(ModelInfo("tiny", 128, 512), LocalDecodePool(worker), subscriber="router-0")
        try:
            async def one(i, prompt):
                return joined([out async for out in backend.generate(str(i), prompt, GREEDY)])
            outs = await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)])
            phases = backend.phase_timings("0")
            return outs, phases
        finally:
            await backend.close()
            worker.shutdown()
    outs, phases = run(main())
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference("tiny").greedy(tuple(prompt), 10) and out.finish_reason == "length"
    assert phases.prefill_time > 0 and phases.transfer_time is None


def test_a_background_abort_broadcast_a_hung_replica_never_answers_is_given_up(monkeypatch):
    # one task per client that left, kept until every replica answered: a replica whose loop hung
    # (until its health check fails it, minutes) kept them all
    import router.serve_pools as pools

    class HungBroadcast:
        async def results_async(self):
            await asyncio.Event().wait()

    class Handle:
        def broadcast(self, method, *args, **kwargs):
            return HungBroadcast()

    monkeypatch.setattr(pools, "ABORT_BROADCAST_TIMEOUT_S", 0.05)
    monkeypatch.setattr(pools, "detached", lambda call: call())
    abort_everywhere = pools._AbortEverywhere(Handle())

    async def main():
        for i in range(20):
            abort_everywhere(f"left-{i}")()
        assert len(abort_everywhere._cleanups) == 20
        await asyncio.sleep(0.3)
        return len(abort_everywhere._cleanups)

    assert asyncio.run(main()) == 0
