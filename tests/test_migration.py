"""Request migration without Ray: a decode worker that stops mid-stream, its
requests continued on the other one, one uninterrupted stream per request and
greedy output equal to transformers'."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import pytest

from decode_workers.decode_worker import DecodeWorker
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import EngineStoppedError
from engine.outputs import joined
from router.backend import BackendUnavailableError, ModelInfo
from router.serving_backend import ServingBackend
from tests.test_handoff_workers import PROMPTS, run

TOKENS = 24
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


class TwoWorkerPool:
    """Decode replicas A and B in process; a request goes to the first live one it is not steered away from."""

    def __init__(self, workers: dict[str, DecodeWorker]):
        self.workers = workers
        self.dead: set[str] = set()
        self.placed: list[tuple[str, str]] = []          # (request id, replica)
        self._cleanups: set[asyncio.Future] = set()

    async def generate(self, request, avoid_replica=None):
        for name, worker in self.workers.items():
            if name != avoid_replica and name not in self.dead:
                self.placed.append((request.request_id, name))
                try:
                    return await worker.generate(request)
                except EngineStoppedError as exc:    # as router/serve_pools.py maps it
                    raise BackendUnavailableError(f"the decode worker is unavailable: {exc}",
                                                  exc.replica_id) from None
        raise BackendUnavailableError("no decode worker left")

    async def abort(self, replica_id, request_id):
        if replica_id in self.dead:
            raise BackendUnavailableError(f"{replica_id} is gone")
        await self.workers[replica_id].abort(request_id)

    def abort_everywhere(self, request_id):
        for name, worker in self.workers.items():
            if name not in self.dead:
                self._cleanups.add(asyncio.ensure_future(worker.abort(request_id)))

    def stream(self, replica_id, subscriber):
        return self.workers[replica_id].stream(subscriber)

    def stall(self, name: str, seconds: float = 0.5) -> None:
        """The worker's engine takes no step for a while (from its next step boundary):
        what runs there stays unfinished until a kill that follows lands."""
        self.workers[name]._engine.submit(lambda engine: time.sleep(seconds))

    def slow_down(self, name: str, step_s: float) -> None:
        """Every step of the worker's engine takes `step_s` more (from its next step
        boundary): a request's tokens come over several of its stream's deltas however
        fast the machine (the tiny model's 24 tokens otherwise fit one delta)."""
        def slower_steps(engine) -> None:
            step = engine.step

            def slower(*args, **kwargs):
                time.sleep(step_s)
                return step(*args, **kwargs)
            engine.step = slower
        self.workers[name]._engine.submit(slower_steps)

    def kill(self, name: str) -> None:
        """The worker's engine stops: its streams fail, as when its process dies."""
        self.dead.add(name)
        self.workers[name].shutdown()


def _workers(model_dirs) -> dict[str, DecodeWorker]:
    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, block_size=8, dtype="float32",
                          num_kv_blocks=128)
    return {name: DecodeWorker(config, replica_id=name) for name in ("A", "B")}


async def _started_workers(model_dirs) -> dict[str, DecodeWorker]:
    workers = _workers(model_dirs)
    for w in workers.values():
        await w.start()
    return workers


def _kill_a_worker_midstream(model_dirs, params: SamplingParams):
    """Every prompt starts on A; A dies once the first request streamed 6 tokens.
    Returns each request's outputs and where its attempts were placed."""
    async def main():
        workers = await _started_workers(model_dirs)
        pool = TwoWorkerPool(workers)
        backend = ServingBackend(ModelInfo("tiny", 128, 512), pool, subscriber="router-0")
        killed = asyncio.Event()

        async def one(i, prompt):
            outs = []
            async for out in backend.generate(f"r{i}", prompt, params):
                outs.append(out)
                # at least: a busy reader gets several steps' tokens in one output
                if i == 0 and out.num_output_tokens >= 6 and not killed.is_set():
                    killed.set()
                    pool.stall("A")         # none of its requests ends there before the kill lands
                    await asyncio.to_thread(pool.kill, "A")
            return outs

        try:
            return await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)]), pool.placed
        finally:
            await backend.close()
            for name, w in workers.items():
                if name not in pool.dead:
                    w.shutdown()

    results, placed = run(main())
    assert {r for r, replica in placed if replica == "A"} == {f"r{i}" for i in range(len(PROMPTS))}
    moved = {r.split("~")[0] for r, replica in placed if replica == "B"}
    assert moved == {f"r{i}" for i in range(len(PROMPTS))}     # every request was on A, and moved
    for outs in results:
        # one stream: every output carries the tokens after the previous one's
        counts = [out.num_output_tokens for out in outs]
        assert counts == list(itertools.accumulate(len(out.delta_token_ids) for out in outs))
    return [joined(outs) for outs in results]


def test_requests_on_a_dying_worker_continue_on_the_other(model_dirs, reference):
    results = _kill_a_worker_midstream(model_dirs, GREEDY)
    for prompt, final in zip(PROMPTS, results):
        assert final.finished and final.finish_reason == "length"
        assert final.token_ids == reference("tiny").greedy(tuple(prompt), TOKENS)


def test_a_request_scoring_its_prompt_moves_without_scoring_it_again(model_dirs, reference):
    """The prompt logprobs went out with the first token: the worker that continues the
    request is not asked for them again (an engine refuses to resume a request that asks)."""
    results = _kill_a_worker_midstream(model_dirs, dataclasses.replace(GREEDY, prompt_logprobs=1))
    undisturbed = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, block_size=8,
                                         dtype="float32"))
    for prompt, final in zip(PROMPTS, results):
        assert final.token_ids == reference("tiny").greedy(tuple(prompt), TOKENS)
        undisturbed.add_request("r", prompt, dataclasses.replace(GREEDY, max_tokens=1, prompt_logprobs=1))
        (alone,) = undisturbed.run_to_completion()
        assert len(final.prompt_logprobs) == len(prompt)
        assert final.prompt_logprobs[0] is None and alone.prompt_logprobs[0] is None
        # the same entries; the logprobs as close as batches of other shapes compute them (the streams
        # share the workers' steps as their timing falls)
        for got, want in zip(final.prompt_logprobs[1:], alone.prompt_logprobs[1:]):
            assert (got.token_id, got.rank, [t for t, _ in got.top]) == \
                (want.token_id, want.rank, [t for t, _ in want.top])
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [lp for _, lp in got.top] == pytest.approx([lp for _, lp in want.top], abs=1e-4)


def test_seeded_sampling_with_penalties_continues_as_if_nothing_failed(model_dirs):
    """The new worker advances the seeded generator past the streamed tokens and
    counts them in the penalties: the output is the undisturbed run's."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.9, top_k=40, seed=5, presence_penalty=0.6,
                            frequency_penalty=0.3, ignore_eos=True)
    results = _kill_a_worker_midstream(model_dirs, params)
    undisturbed = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, block_size=8,
                                         dtype="float32"))
    for i, prompt in enumerate(PROMPTS):
        undisturbed.add_request(str(i), prompt, params)
    expected = {int(o.request_id): o for o in undisturbed.run_to_completion()}
    for i, final in enumerate(results):
        assert (final.token_ids, final.text) == (expected[i].token_ids, expected[i].text)


def test_with_migration_off_the_error_says_so(model_dirs):
    async def main():
        workers = await _started_workers(model_dirs)
        pool = TwoWorkerPool(workers)
        backend = ServingBackend(ModelInfo("tiny", 128, 512), pool, subscriber="router-0", max_migrations=0)
        try:
            async for out in backend.generate("r0", PROMPTS[0], GREEDY):
                # at least: a busy reader gets several steps' tokens in one output
                if out.num_output_tokens >= 3 and "A" not in pool.dead:
                    pool.stall("A")
                    await asyncio.to_thread(pool.kill, "A")
        finally:
            await backend.close()
            workers["B"].shutdown()

    with pytest.raises(BackendUnavailableError, match=r"migration is off \(max_migrations: 0\)") as failed:
        run(main())
    # what the client is told (Ray's error text in the message stays in the log)
    assert failed.value.reason == "the worker serving the request failed, and migration is off (max_migrations: 0)"


def _one_stream_moved_once(outs, local: int, reference) -> None:
    """PROMPTS[1]'s outputs: one stream of transformers' greedy tokens, moved once (its one
    prefill on the decode worker: the migration)."""
    assert joined(outs).token_ids == reference("tiny").greedy(tuple(PROMPTS[1]), TOKENS)
    assert [out.num_output_tokens for out in outs] == \
        list(itertools.accumulate(len(out.delta_token_ids) for out in outs))
    assert local == 1


def test_a_hand_off_that_keeps_failing_continues_on_the_decode_worker(model_dirs, reference):
    """The first token came from the prefill worker; both tries to move its KV fail; the
    request continues on the decode worker from prompt + first token."""
    from cluster.transport.fake_transport import FakeTransportHub
    from tests.test_handoff_workers import Pair

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), max_migrations=1).start()
        try:
            await pair.run("warm", PROMPTS[0])                       # the pair is connected
            pair.hub.fail_next(2, when="transfer", message="link down")
            outs = [out async for out in pair.backend.generate("moved", PROMPTS[1], GREEDY)]
            await pair.wait_idle()
            return outs, pair.decode_pool.local
        finally:
            await pair.shutdown()

    _one_stream_moved_once(*run(main()), reference)


def _first_hand_off_of_r_unheard(pair) -> list[asyncio.Future]:
    """Request "r"'s first hand-off call reaches the decode worker but fails at the router (Ray's
    "actor unavailable": it may have executed). Returns the list that gets that call's task."""
    generate, tries = pair.decode_pool.generate, []

    async def reached_but_unanswered(request, avoid_replica=None):
        if request.prefill is not None and request.request_id == "r" and not tries:
            tries.append(asyncio.ensure_future(generate(request)))
            await asyncio.sleep(0)          # it runs on the worker up to its first wait
            raise BackendUnavailableError("the decode worker is unavailable: actor unavailable")
        return await generate(request, avoid_replica)

    pair.decode_pool.generate = reached_but_unanswered
    return tries


def test_a_hand_off_retried_onto_the_replica_that_took_the_first_try_moves_the_request(model_dirs, reference):
    """The first hand-off call reaches the decode worker but fails at the router (Ray's
    "actor unavailable": it may have executed); the retry lands on the same worker, which
    runs the first try under that id: the retry fails there as a transfer would, and the
    request moves (before: a 400 after the client had its first token)."""
    from cluster.transport.fake_transport import FakeTransportHub
    from tests.test_handoff_workers import Pair

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), max_migrations=1).start()
        tries = _first_hand_off_of_r_unheard(pair)
        try:
            await pair.run("warm", PROMPTS[0])
            outs = [out async for out in pair.backend.generate("r", PROMPTS[1], GREEDY)]
            await asyncio.gather(*tries, return_exceptions=True)
            await pair.wait_idle()
            return outs, pair.decode_pool.local
        finally:
            await pair.shutdown()

    _one_stream_moved_once(*run(main()), reference)


def test_a_hand_off_try_that_ran_unheard_is_aborted_when_the_request_moves(model_dirs, reference):
    """As above, on a pair with no stream open yet (no warm-up): the first try's copy decodes
    on the worker after the request moved, and no stream delivers its tokens to be noticed;
    it held its blocks until the orphan sweep (a minute) before the router aborted it."""
    from cluster.transport.fake_transport import FakeTransportHub
    from tests.test_handoff_workers import Pair

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), max_migrations=1).start()
        tries = _first_hand_off_of_r_unheard(pair)
        try:
            params = dataclasses.replace(GREEDY, max_tokens=100)      # the copy outlives the wait below
            outs = [out async for out in pair.backend.generate("r", PROMPTS[1], params)]
            await asyncio.gather(*tries, return_exceptions=True)
            await pair.wait_idle()
            return outs, pair.decode_pool.broadcast_aborts
        finally:
            await pair.shutdown()

    outs, broadcast = run(main())
    assert joined(outs).token_ids == reference("tiny").greedy(tuple(PROMPTS[1]), 100, ignore_eos=True)
    assert broadcast == ["r"]


def test_a_try_that_ran_unheard_and_took_the_kv_is_aborted_when_the_next_finds_it_gone():
    """The first try reached a replica and took the KV (the prefill side's hold ended), but the router
    heard only "actor unavailable"; the retry then finds the hold gone (KVHolderLost) and the request
    is prefilled again under a new id: the first try's copy must not decode for nobody."""
    from cluster.serving.messages import KVHolderLost, PrefillResult, TokenDelta

    class OnePrompt:
        async def prefill(self, request_id, prompt, params):
            return PrefillResult(request_id, TokenDelta(request_id, [7], "x", None), None, 1, ["p0"], 2, "P")

        def release(self, result):
            pass

    class UnheardThenGone:
        def __init__(self):
            self.tries, self.everywhere = 0, []

        async def generate(self, request, avoid_replica=None):
            self.tries += 1
            if self.tries == 1:
                raise BackendUnavailableError("the decode worker is unavailable: actor unavailable")
            raise KVHolderLost("the prefill worker P no longer holds the KV", "Y")

        def abort_everywhere(self, request_id):
            self.everywhere.append(request_id)

        async def abort(self, replica_id, request_id):
            pass

        async def stream(self, replica_id, subscriber):
            await asyncio.Event().wait()
            yield []

    async def main():
        decode = UnheardThenGone()
        backend = ServingBackend(ModelInfo("tiny", 128, 512), decode, OnePrompt(), subscriber="router-0",
                                 max_migrations=0)
        with pytest.raises(BackendUnavailableError, match="migration is off"):
            async for _ in backend.generate("r", [1, 2, 3], GREEDY):
                pass
        await backend.close()
        return decode.tries, decode.everywhere

    assert run(main()) == (2, ["r"])


def test_a_retry_under_the_routers_next_stream_leaves_the_running_first_try_alone(model_dirs):
    """A request the decode worker runs under a router's stream, and a retry of it (the router
    heard nothing back) under the router's next stream: the retry took over the first try's
    output, failed, aborted it, and left its id on the first stream for good (which then never
    went idle). Now the retry is refused before it touches the first try."""
    from cluster.serving.messages import DecodeRequest
    from cluster.transport.fake_transport import FakeTransportHub
    from engine.errors import RequestIdInUse
    from tests.test_handoff_workers import Pair

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub()).start()
        try:
            first = pair.decode.stream("router-a")
            got = asyncio.ensure_future(_drain(first))
            await pair.decode.generate(DecodeRequest("r", PROMPTS[1], params, "router-a"))
            with pytest.raises(RequestIdInUse):
                await pair.decode.generate(DecodeRequest("r", PROMPTS[1], params, "router-a/1"))
            assert "router-a/1" not in pair.decode._subscribers      # a refused request leaves no subscriber
            tokens, finish = await asyncio.wait_for(got, 30)
            left = {name: set(s.request_ids) for name, s in pair.decode._subscribers.items() if s.request_ids}
            return tokens, finish, left
        finally:
            await pair.shutdown()

    tokens, finish, left = run(main())
    assert (tokens, finish) == (24, "length")     # the first try ran to its end on its own stream
    assert left == {}


async def _drain(stream) -> tuple[int, str | None]:
    """Tokens streamed until request r finished, and how it finished."""
    count = 0
    async for batch in stream:
        for delta in batch:
            count += len(delta.token_ids)
            if delta.finished:
                await stream.aclose()
                return count, delta.finish_reason
    return count, None


def test_a_prefill_worker_that_dies_before_the_first_token(model_dirs, reference):
    """The prefill call fails (its replica died): the request is prefilled on a decode worker."""
    from cluster.transport.fake_transport import FakeTransportHub
    from tests.test_handoff_workers import Pair

    class DeadPrefillPool:
        calls = 0
        everywhere: list[str] = []

        async def prefill(self, request_id, prompt_token_ids, params):
            self.calls += 1
            raise BackendUnavailableError("the prefill worker is unavailable: the actor died")

        def release(self, result):
            raise AssertionError("nothing was prefilled, nothing to release")

        def abort_everywhere(self, request_id):
            self.everywhere.append(request_id)

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), max_migrations=1).start()
        dead = DeadPrefillPool()
        pair.backend._prefill = dead
        try:
            out = await pair.run("r", PROMPTS[2])
            phases = pair.backend.phase_timings("r")
            return out, dead.calls, pair.decode_pool.local, phases
        finally:
            await pair.shutdown()

    out, prefill_calls, local, phases = run(main())
    assert out.token_ids == reference("tiny").greedy(tuple(PROMPTS[2]), 10)     # Pair.run: 10 tokens
    # the prompt was prefilled on the decode worker: the failed prefill call counts for nothing
    assert (prefill_calls, local, phases.migrations, phases.prefilled_on) == (1, 1, 1, "decode")
    # no replica was named: the call may have run unheard and be holding its KV, so every prefill
    # replica drops it (before, the hold lasted until its lease ended)
    assert DeadPrefillPool.everywhere == ["r"]


def test_a_hand_off_whose_prefill_hold_is_lost_while_it_waits_is_prefilled_again(model_dirs, reference):
    """The decode replica waits for blocks to take the KV; the prefill replica
    holding it loses it (it died). The router does not retry the hand-off (no
    decode replica can take KV that is gone): it prefills prompt and first token
    on a decode replica, and the output is the undisturbed one."""
    from cluster.transport.fake_transport import FakeTransportHub
    from tests.test_handoff_workers import Pair

    async def main():
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), lease_s=0.3, max_migrations=1).start()
        pair.decode._engine.engine.reserve_prefilled = lambda *a, **kw: None   # full: the hand-off waits
        try:
            request = asyncio.ensure_future(pair.run("r", PROMPTS[2]))
            while pair.prefill.stats()["num_held"] == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            await pair.prefill.abort("r")                       # the hold is gone, as with its replica
            out = await asyncio.wait_for(request, 10)
            return out, pair.decode_pool.attempts, pair.decode_pool.local, pair.backend.phase_timings("r")
        finally:
            await pair.shutdown()

    out, handoffs, local, phases = run(main())
    assert out.token_ids == reference("tiny").greedy(tuple(PROMPTS[2]), 10)
    assert (handoffs, local, phases.migrations) == (1, 1, 1)


def test_a_prompt_waiting_on_a_prefill_pool_that_lost_every_replica_is_prefilled_locally(model_dirs, reference):
    """The only prefill replica died: the call would wait for a replacement. Once the
    router's stats show the pool empty, the prompt goes to a decode worker instead
    (not a migration: nothing was lost) and the waiting call is cancelled."""
    from cluster.transport.fake_transport import FakeTransportHub
    from router.disaggregation_policy import (
        DisaggregationPolicy,
        DisaggregationSettings,
    )
    from tests.test_handoff_workers import Pair

    class EmptyPrefillPool:
        cancelled = False

        async def prefill(self, request_id, prompt_token_ids, params):
            try:
                await asyncio.sleep(3600)       # Serve waits for a replica to route to
            except asyncio.CancelledError:
                self.cancelled = True
                raise

        def release(self, result):
            raise AssertionError("nothing was prefilled, nothing to release")

    async def main():
        policy = DisaggregationPolicy(DisaggregationSettings("always"))
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), policy=policy).start()
        empty = pair.backend._prefill = EmptyPrefillPool()
        try:
            request = asyncio.ensure_future(pair.run("r", PROMPTS[1]))
            await asyncio.sleep(0.6)
            waited = not request.done()
            policy.observe_workers("prefill", [])      # the stats refresh finds no prefill replica
            out = await asyncio.wait_for(request, 30)
            return waited, out, empty.cancelled, pair.backend.phase_timings("r"), pair.decode_pool.local
        finally:
            await pair.shutdown()

    waited, out, cancelled, phases, local = run(main())
    assert waited and cancelled and local == 1
    assert out.token_ids == reference("tiny").greedy(tuple(PROMPTS[1]), 10)
    assert (phases.migrations, phases.prefilled_on) == (0, "decode")


def test_a_prefill_result_that_arrives_as_the_request_is_cancelled_is_released(model_dirs):
    """The prefill replica answered (it holds the KV) in the same loop turn as the
    client left: the router never hands that KV off, so it releases it."""
    from cluster.transport.fake_transport import FakeTransportHub
    from router.disaggregation_policy import (
        DisaggregationPolicy,
        DisaggregationSettings,
    )
    from tests.test_handoff_workers import Pair

    class AnsweringPrefillPool:
        def __init__(self):
            self.answer: asyncio.Future = asyncio.get_running_loop().create_future()
            self.released: list[str] = []

        async def prefill(self, request_id, prompt_token_ids, params):
            return await self.answer

        def release(self, result):
            self.released.append(result)

    async def main():
        policy = DisaggregationPolicy(DisaggregationSettings("always"))
        pair = await Pair(model_dirs["tiny"], FakeTransportHub(), policy=policy).start()
        pool = pair.backend._prefill = AnsweringPrefillPool()
        try:
            request = asyncio.ensure_future(pair.run("r", PROMPTS[1]))
            while not pair.backend._policy._remote.tokens_in_flight:   # the prefill call is out
                await asyncio.sleep(0.01)
            pool.answer.set_result("the hold")
            await asyncio.sleep(0)      # the call finishes; the request has not resumed yet
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            return pool.released
        finally:
            await pair.shutdown()

    assert run(main()) == ["the hold"]


def test_a_worker_whose_engine_stopped_is_avoided_by_the_next_attempt(model_dirs, reference):
    """A's engine stopped but its process lives (Serve keeps routing to it until its
    health checks fail): its EngineStoppedError names it, and the request moves to B
    instead of going back to A on every attempt."""
    async def main():
        workers = await _started_workers(model_dirs)
        workers["A"].shutdown()                       # the engine stops; the "replica" still takes calls
        pool = TwoWorkerPool(workers)
        backend = ServingBackend(ModelInfo("tiny", 128, 512), pool, subscriber="router-0", max_migrations=1)
        try:
            return joined([out async for out in backend.generate("r", PROMPTS[0], GREEDY)]), pool.placed
        finally:
            await backend.close()
            workers["B"].shutdown()

    last, placed = run(main())
    assert placed == [("r", "A"), ("r~1", "B")]
    assert last.token_ids == reference("tiny").greedy(tuple(PROMPTS[0]), TOKENS)


def test_the_backend_reports_the_running_requests_output_so_far(model_dirs):
    # what the autoscaler reads to see outputs getting longer before any request ends
    async def main():
        workers = await _started_workers(model_dirs)
        backend = ServingBackend(ModelInfo("tiny", 128, 512), TwoWorkerPool(workers), subscriber="router-0")
        seen = []
        try:
            assert backend.mean_running_output_tokens() is None
            # long enough to outlast a stream interval or two: TOKENS can all come in the one message
            # that finishes the request (a fast machine, a busy consumer), and leave nothing to check
            long = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
            async for out in backend.generate("r", PROMPTS[0], long):
                if not out.finished:
                    seen.append((out.num_output_tokens, backend.mean_running_output_tokens()))
            return seen, backend.mean_running_output_tokens()
        finally:
            await backend.close()
            for w in workers.values():
                w.shutdown()

    seen, after = run(main())
    assert seen and all(mean == float(n) for n, mean in seen)
    assert after is None


async def _streamed_into(backend, request_id: str, prompt, streamed: list):
    """The request's whole output; each output is appended to `streamed` as it comes."""
    async for out in backend.generate(request_id, prompt, GREEDY):
        streamed.append(out)
    return joined(streamed)


async def _tokens_streamed(streamed: list, n: int) -> None:
    while sum(len(o.delta_token_ids) for o in streamed) < n:
        await asyncio.sleep(0.005)


class BreakableStreamPool(TwoWorkerPool):
    """TwoWorkerPool whose router-side streams can break while the replica lives
    (Serve cancels the call: the worker's generator is cancelled too), whose
    generate calls can be held on their way, and which records the aborts sent."""

    def __init__(self, workers: dict[str, DecodeWorker], cancel_lag_s: float = 0.0):
        """`cancel_lag_s`: how long after the router's side of a stream breaks the
        worker's generator is cancelled (Serve's cancel travels as a message)."""
        super().__init__(workers)
        self.cancel_lag_s = cancel_lag_s
        self._lagging: set[asyncio.Task] = set()
        self.gate: dict[str, asyncio.Event] = {}       # request id -> released when set
        self.aborts: list[tuple[str, str]] = []        # (replica, request id)
        self._breaks: dict[str, asyncio.Event] = {}

    async def generate(self, request, avoid_replica=None):
        if request.request_id in self.gate:
            await self.gate[request.request_id].wait()
        return await super().generate(request, avoid_replica)

    async def abort(self, replica_id, request_id):
        self.aborts.append((replica_id, request_id))
        await super().abort(replica_id, request_id)

    def break_stream(self, replica_id: str) -> None:
        self._breaks[replica_id].set()

    async def stream(self, replica_id, subscriber):
        broken = self._breaks[replica_id] = asyncio.Event()
        inner = self.workers[replica_id].stream(subscriber)
        batch = None
        try:
            while True:
                batch, breaking = asyncio.ensure_future(anext(inner)), asyncio.ensure_future(broken.wait())
                await asyncio.wait({batch, breaking}, return_when=asyncio.FIRST_COMPLETED)
                breaking.cancel()
                if not batch.done():
                    raise RuntimeError(f"the output stream of {replica_id} was cancelled")
                try:
                    yield batch.result()
                except StopAsyncIteration:
                    return
        finally:
            if self.cancel_lag_s:
                task = asyncio.get_running_loop().create_task(self._close_later(inner, batch))
                self._lagging.add(task)
            else:
                await self._close(inner, batch)

    async def _close_later(self, inner, batch) -> None:
        await asyncio.sleep(self.cancel_lag_s)
        await self._close(inner, batch)

    @staticmethod
    async def _close(inner, batch) -> None:
        if batch is not None and not batch.done():
            batch.cancel()
            await asyncio.gather(batch, return_exceptions=True)
        await inner.aclose()


def test_a_request_admitted_as_its_replicas_stream_broke_is_aborted_there(model_dirs, reference):
    """The router's stream from A breaks (A lives) while X's generate call is on
    its way to A, and A takes X under a new stream. The router cannot read that
    stream's past, so X moves to B; the copy A runs is aborted, not left decoding
    for nobody with its KV held."""
    async def main():
        workers = await _started_workers(model_dirs)
        pool = BreakableStreamPool(workers)
        backend = ServingBackend(ModelInfo("tiny", 128, 512), pool, subscriber="router-0")

        def one(rid, prompt, streamed):
            return _streamed_into(backend, rid, prompt, streamed)

        try:
            y_streamed = []
            pool.slow_down("A", 0.02)           # (Y's 24 tokens over ~0.5 s, however fast the machine)
            y = asyncio.create_task(one("Y", PROMPTS[0], y_streamed))     # keeps A's stream open
            await _tokens_streamed(y_streamed, 3)
            pool.gate["X"] = asyncio.Event()
            x = asyncio.create_task(one("X", PROMPTS[1], []))
            await asyncio.sleep(0.05)           # X's call is on its way
            pool.break_stream("A")
            await asyncio.sleep(0.2)            # A has closed that stream and aborted what it carried
            pool.gate["X"].set()
            outs = await asyncio.gather(y, x)
            assert ("A", "X") in pool.aborts and ("X", "A") in pool.placed and ("X~1", "B") in pool.placed
            deadline = asyncio.get_running_loop().time() + 5
            while workers["A"].stats()["num_running"] or workers["A"].stats()["kv_cache_usage"]:
                assert asyncio.get_running_loop().time() < deadline, workers["A"].stats()
                await asyncio.sleep(0.02)
            return outs
        finally:
            await backend.close()
            for w in workers.values():
                w.shutdown()

    for prompt, final in zip(PROMPTS, run(main())):
        assert final.token_ids == reference("tiny").greedy(tuple(prompt), TOKENS)


def test_a_request_sent_while_a_broken_stream_closes_on_its_replica_runs_there(model_dirs, reference):
    """The router's side of A's stream breaks; A's generator is cancelled only
    0.3 s later. Y, on that stream, moves to B. Z, sent to A meanwhile, must not
    join the stream A is closing (whose clean-up aborts what it carries, a delta
    nobody reads) nor be refused a new one while the old one lives: it runs on A,
    unmoved, and ends."""
    async def main():
        workers = await _started_workers(model_dirs)
        pool = BreakableStreamPool(workers, cancel_lag_s=0.3)
        backend = ServingBackend(ModelInfo("tiny", 128, 512), pool, subscriber="router-0")

        def one(rid, prompt, streamed):
            return _streamed_into(backend, rid, prompt, streamed)

        try:
            y_streamed = []
            # A steps slowly (24 tokens: ~0.5 s): Y is unfinished there when its stream breaks, where on a
            # fast machine A had generated all of Y's tokens by the time its first one was read
            pool.slow_down("A", 0.02)
            y = asyncio.create_task(one("Y", PROMPTS[0], y_streamed))
            await _tokens_streamed(y_streamed, 3)
            pool.break_stream("A")
            await asyncio.sleep(0.05)           # the router has heard; A's generator still runs
            z = asyncio.create_task(one("Z", PROMPTS[1], []))
            return await asyncio.wait_for(asyncio.gather(y, z), 30), pool.placed, pool.aborts
        finally:
            await backend.close()
            for w in workers.values():
                w.shutdown()

    outs, placed, aborts = run(main())
    # Y is aborted on A by the router too (a backstop: A aborts a failed stream's requests itself)
    assert ("Y~1", "B") in placed and ("A", "Y") in aborts
    assert [replica for rid, replica in placed if rid.startswith("Z")] == ["A"]
    for prompt, final in zip(PROMPTS, outs):
        assert final.token_ids == reference("tiny").greedy(tuple(prompt), TOKENS)


def test_a_request_aborted_under_a_subscriber_whose_stream_never_opens_leaves_nothing_behind(model_dirs):
    """The router moves a request whose subscriber's stream it saw fail, and aborts
    the copy the replica took: no stream will ever open for that subscriber to
    clean up after it, so the abort does."""
    from cluster.serving.messages import DecodeRequest

    async def main():
        worker = (await _started_workers(model_dirs))["A"]
        try:
            await worker.generate(DecodeRequest("q", PROMPTS[0], GREEDY, "router/3"))
            assert "router/3" in worker._subscribers
            await worker.abort("q")
            return dict(worker._subscribers), dict(worker._engine._sinks), worker.stats()["num_running"]
        finally:
            worker.shutdown()

    subscribers, sinks, running = run(main())
    assert subscribers == {} and "q" not in sinks and running == 0


def test_a_stream_failure_during_a_requests_prefill_elsewhere_does_not_move_it(model_dirs, reference):
    """X is expected, then prefilled on the prefill worker (slowly); A's stream breaks
    and reopens meanwhile. X's hand-off to A comes after all that: it cannot have
    crossed the failure, so it stays on A (it was aborted there and prefilled again
    on B, or failed outright with migration off)."""
    from cluster.transport.fake_transport import FakeTransportHub
    from prefill_workers.prefill_worker import PrefillWorker
    from tests.test_handoff_workers import LocalPrefillPeer, LocalPrefillPool

    class SlowPrefillPool(LocalPrefillPool):
        def __init__(self, worker):
            super().__init__(worker)
            self.gate: dict[str, asyncio.Event] = {}

        async def prefill(self, request_id, prompt_token_ids, params):
            result = await super().prefill(request_id, prompt_token_ids, params)
            if request_id in self.gate:
                await self.gate[request_id].wait()
            return result

    async def main():
        hub = FakeTransportHub()
        config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, block_size=8, dtype="float32",
                              num_kv_blocks=64)
        prefill = PrefillWorker(config, lambda rank, device: hub.sender(f"p{rank}"), lease_s=30, replica_id="P")
        workers = {name: DecodeWorker(config, lambda rank, device, name=name: hub.receiver(f"{name}{rank}"),
                                      LocalPrefillPeer(prefill), replica_id=name) for name in "AB"}
        await prefill.start()
        for w in workers.values():
            await w.start()
        pool, prefill_pool = BreakableStreamPool(workers), SlowPrefillPool(prefill)
        backend = ServingBackend(ModelInfo("tiny", 128, 512), pool, prefill_pool, subscriber="router-0",
                                 max_migrations=0)

        async def one(rid, prompt):
            return joined([out async for out in backend.generate(rid, prompt, GREEDY)])
        try:
            y = asyncio.create_task(one("Y", PROMPTS[0]))           # opens the router's stream from A
            while "A" not in pool._breaks:
                await asyncio.sleep(0.005)
            prefill_pool.gate["X"] = asyncio.Event()
            x = asyncio.create_task(one("X", PROMPTS[1]))           # expected now; its prefill is slow
            await asyncio.sleep(0.05)
            pool.break_stream("A")
            await asyncio.sleep(0.3)                                # the failure is over
            prefill_pool.gate["X"].set()
            outs = await asyncio.gather(y, x, return_exceptions=True)
            return outs, list(pool.placed), list(pool.aborts)
        finally:
            await backend.close()
            prefill.shutdown()
            for w in workers.values():
                w.shutdown()

    (y, x), placed, aborts = run(main())
    assert not isinstance(x, BaseException), x
    assert x.token_ids == reference("tiny").greedy(tuple(PROMPTS[1]), TOKENS)
    assert ("A", "X") not in aborts and not any(rid.startswith("X~") for rid, _ in placed)


def test_a_request_admitted_after_its_subscribers_stream_closed_streams_to_the_next_one(model_dirs, monkeypatch):
    """A seeded migrated request waits for its generator to be advanced (on a
    thread) before it joins the batch; the subscriber's stream closes meanwhile.
    The request joins the subscriber's next stream: it is not left running with
    no stream to read it."""
    import decode_workers.decode_worker as decode_worker_module
    from cluster.serving.messages import DecodeRequest
    from engine.outputs import ResumedOutput

    advance = decode_worker_module.advanced_generator_state

    def slow_advance(*args):
        time.sleep(0.5)
        return advance(*args)

    monkeypatch.setattr(decode_worker_module, "advanced_generator_state", slow_advance)
    seeded = SamplingParams(max_tokens=TOKENS, temperature=0.8, seed=3, ignore_eos=True)

    async def main():
        worker = _workers(model_dirs)["A"]
        await worker.start()
        try:
            first = worker.stream("router-0")
            reading = asyncio.create_task(anext(first))
            request = DecodeRequest("r~1", PROMPTS[0], seeded, "router-0",
                                    resume=ResumedOutput(token_ids=[7, 8, 9], num_sent_chars=0))
            admitting = asyncio.create_task(worker.generate(request))
            await asyncio.sleep(0.1)             # advancing the generator
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            await first.aclose()
            await admitting
            tokens = 0
            async for batch in worker.stream("router-0"):
                tokens += sum(len(d.token_ids) for d in batch if d.request_id == "r~1")
                if any(d.finished for d in batch if d.request_id == "r~1"):
                    break
            assert tokens == TOKENS - 3
            assert worker.stats()["queued_prefill_tokens"] == 0
        finally:
            worker.shutdown()
    run(main())


def test_a_resumed_requests_text_is_rebuilt_off_the_engine_thread(model_dirs, monkeypatch):
    """Two window decodes per resumed token held up every request decoding on the replica
    between two steps (seconds for many long requests moved at once): the replica rebuilds
    the text on a thread of its own, and the request continues as the undisturbed run."""
    import threading

    from cluster.serving.messages import DecodeRequest
    from engine import LLM, detokenizer
    from engine.outputs import ResumedOutput
    read = []           # (thread, detokenizer, token id) of every token detokenized
    add_token = detokenizer.IncrementalDetokenizer.add_token

    def spy(self, token_id):
        read.append((threading.current_thread().name, id(self), token_id))
        return add_token(self, token_id)
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(str(model_dirs["tiny"]), max_model_len=512, block_size=8)
    (whole,) = llm.generate([PROMPTS[0]], greedy)
    llm.shutdown()
    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "add_token", spy)

    async def main():
        worker = _workers(model_dirs)["A"]
        await worker.start()
        try:
            request = DecodeRequest("r~1", PROMPTS[0], greedy, "router-0",    # (its tokens are checked, not text)
                                    resume=ResumedOutput(token_ids=whole.token_ids[:10], num_sent_chars=0))
            read.clear()                         # (the worker's start ran throwaway prompts)
            await worker.generate(request)
            engine_thread = worker._engine._thread.name
            tokens = []
            async for batch in worker.stream("router-0"):
                tokens += [t for d in batch if d.request_id == "r~1" for t in d.token_ids]
                if any(d.finished for d in batch if d.request_id == "r~1"):
                    break
            return engine_thread, tokens
        finally:
            worker.shutdown()
    engine_thread, tokens = run(main())
    assert whole.token_ids[:10] + tokens == whole.token_ids
    # another thread read the resumed tokens; the engine's, with the same detokenizer, only those it sampled
    assert [t for name, _, t in read if name != engine_thread] == whole.token_ids[:10]
    ours = next(d for name, d, _ in read if name != engine_thread)
    assert [t for name, d, t in read if d == ours and name == engine_thread] == tokens


async def joined_output(outputs):
    return joined([out async for out in outputs])


def test_a_router_that_closes_does_not_move_its_requests_elsewhere(model_dirs):
    """Closing the backend (the router replica going away) ends the requests it
    streams with an error; they are not prefilled again on another replica."""
    async def main():
        workers = await _started_workers(model_dirs)
        admitted = asyncio.Event()

        class StallingPool(TwoWorkerPool):
            async def generate(self, request, avoid_replica=None):
                out = await super().generate(request, avoid_replica)
                workers["A"]._engine.submit(lambda engine: time.sleep(1.0))   # it stays running a while
                admitted.set()
                return out

        pool = StallingPool(workers)
        backend = ServingBackend(ModelInfo("tiny", 128, 512), pool, subscriber="router-0")
        try:
            long = SamplingParams(max_tokens=110, temperature=0.0, ignore_eos=True)
            task = asyncio.create_task(joined_output(backend.generate("r", PROMPTS[0], long)))
            await admitted.wait()
            await asyncio.sleep(0.05)
            await backend.close()
            with pytest.raises(BackendUnavailableError, match="stopped reading"):
                await asyncio.wait_for(task, 10)
            assert pool.placed == [("r", "A")]
        finally:
            for w in workers.values():
                w.shutdown()
    run(main())


def test_a_migration_does_not_wait_on_the_abort_of_an_unreachable_replica(model_dirs, reference, monkeypatch):
    """The failed replica's copy is aborted on the way out of the attempt; a replica
    that is unreachable but not yet declared dead never answers that abort, and the
    request must not wait for it to continue elsewhere."""
    from router import serving_backend
    monkeypatch.setattr(serving_backend, "ABORT_WAIT_S", 0.2)

    class UnreachablePool(TwoWorkerPool):
        async def abort(self, replica_id, request_id):
            if replica_id in self.dead:
                await asyncio.sleep(3600)         # no answer, no error
            await super().abort(replica_id, request_id)

    async def main():
        workers = await _started_workers(model_dirs)
        pool = UnreachablePool(workers)
        backend = ServingBackend(ModelInfo("tiny", 128, 512), pool, subscriber="router-0")
        outs = []
        try:
            async def stream():
                async for out in backend.generate("r", PROMPTS[0], GREEDY):
                    outs.append(out)
                    if out.num_output_tokens >= 4 and "A" not in pool.dead:
                        await asyncio.to_thread(pool.kill, "A")
            await asyncio.wait_for(stream(), 60)
            return outs, pool.placed
        finally:
            await backend.close()
            workers["B"].shutdown()

    outs, placed = run(main())
    assert [replica for _, replica in placed] == ["A", "B"]
    assert joined(outs).token_ids == reference("tiny").greedy(tuple(PROMPTS[0]), TOKENS)
