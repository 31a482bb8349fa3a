"""What the router makes of a worker's errors (router/serve_pools.py): the
worker's own errors come back as raised; a worker that cannot serve any more,
dead or with its engine stopped, is unavailable, so the request moves on."""

from __future__ import annotations

import pytest
from ray.exceptions import RayTaskError

from engine.errors import EngineStoppedError, InvalidRequestError
from router.backend import BackendUnavailableError
from router.serve_pools import unwrapped_errors


def _raised_in_replica(exc: Exception) -> RayTaskError:
    return RayTaskError("DecodeServer.generate", "Traceback (most recent call last): ...", exc)


def test_a_workers_own_error_comes_back_as_raised():
    with pytest.raises(InvalidRequestError, match="max_tokens must be") as info:
        with unwrapped_errors("decode"):
            raise _raised_in_replica(InvalidRequestError("max_tokens must be >= 1", "max_tokens"))
    assert info.value.param == "max_tokens"


def test_a_worker_whose_engine_stopped_is_unavailable():
    with pytest.raises(BackendUnavailableError, match="the decode worker is unavailable: the engine is not running"):
        with unwrapped_errors("decode"):
            raise _raised_in_replica(EngineStoppedError("the engine is not running: a step failed"))


def test_a_grpc_call_that_fails_is_the_worker_unavailable():
    # local clusters call the workers over Serve's gRPC transport: a stream cut by a dying replica
    # fails with gRPC's own error (UNAVAILABLE alone comes as Ray's ActorUnavailableError)
    import grpc

    cut = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details="Received RST_STREAM with error code 2")
    with pytest.raises(BackendUnavailableError, match="the call to the decode worker failed: INTERNAL Received "
                                                      "RST_STREAM"):
        with unwrapped_errors("decode"):
            raise cut


def test_a_call_queued_as_the_engine_stops_is_answered(model_dirs):
    """The engine thread stops (here: shut down from another thread) between a
    call's liveness check and its queueing: the call is still answered, with
    EngineStoppedError, instead of waiting for ever."""
    import asyncio
    import queue
    import threading

    from engine import EngineConfig, LLMEngine
    from engine.async_engine import AsyncEngine

    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=64, cpu_threads=1)
    stopping, stoppers = threading.Event(), []

    class StoppingQueue(queue.SimpleQueue):
        def put(self, item, *args):
            # past the call's liveness check: the engine thread stops (has left its loop) before the put
            stoppers[0].start()
            assert stopping.wait(10), "the engine thread did not stop"
            super().put(item, *args)

    async def main():
        engine = AsyncEngine(lambda: LLMEngine(config), name="stopping-test")
        await engine.ready()
        fail_everything = engine._fail_everything

        def noted_fail_everything(exc):
            stopping.set()           # (the engine thread, done taking calls, as it ends)
            fail_everything(exc)
        engine._fail_everything = noted_fail_everything
        stoppers.append(threading.Thread(target=engine.shutdown))
        engine._calls = StoppingQueue()
        try:
            await asyncio.wait_for(engine.call(lambda e: "ran"), 10)
        finally:
            if stoppers[0].is_alive():
                await asyncio.to_thread(stoppers[0].join, 30)

    with pytest.raises(EngineStoppedError):
        asyncio.run(main())


def test_a_ticker_that_keeps_failing_is_logged_once_and_counted_until_it_works(model_dirs, caplog):
    """Tickers are polled every few milliseconds while there is work: one that kept failing
    logged a traceback each time, hundreds a second."""
    import asyncio

    from engine import EngineConfig, LLMEngine
    from engine.async_engine import AsyncEngine

    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=64, cpu_threads=1)
    calls = []

    def flaky(engine):
        calls.append(1)
        if len(calls) <= 50:
            raise RuntimeError(f"the store does not answer (try {len(calls)})")    # a text that changes
        return False

    async def main():
        engine = AsyncEngine(lambda: LLMEngine(config), name="flaky-ticker")
        await engine.ready()
        try:
            engine.add_ticker(flaky)
            while len(calls) <= 50:
                await asyncio.sleep(0.01)
            await engine.call(lambda e: None)     # a pass after the one that worked has ended
        finally:
            engine.shutdown()

    with caplog.at_level("WARNING", logger="engine.async_engine"):
        asyncio.run(asyncio.wait_for(main(), 60))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["ticker test_a_ticker_that_keeps_failing_is_logged_once_and_counted_until_it_works.<locals>"
                     ".flaky failed",
                     "ticker test_a_ticker_that_keeps_failing_is_logged_once_and_counted_until_it_works.<locals>"
                     ".flaky works again (49 failures since the last logged)"]


def test_a_ticker_failing_on_a_dead_rank_stops_the_engine_and_fails_its_waiters(model_dirs):
    """Between steps only tickers reach the TP ranks (a decode worker with nothing but
    hand-offs in flight): when a rank is gone and a ticker fails on it, the loop ends
    and its stop hooks fail what waits, as a failed step would. Before, the loop polled
    and logged the failure every few milliseconds while the hand-offs waited on."""
    import asyncio

    from engine import EngineConfig, LLMEngine
    from engine.async_engine import AsyncEngine

    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=64, cpu_threads=1)
    stopped: list[BaseException] = []
    calls = []

    def ticker(engine):
        calls.append(1)
        engine._broken = "rank 1 exited (code -9)"          # as LLMEngine marks a dead rank
        raise RuntimeError(engine._broken)

    async def main():
        engine = AsyncEngine(lambda: LLMEngine(config), name="dead-rank-test")
        await engine.ready()
        engine.add_stop_hook(stopped.append)
        engine.add_ticker(ticker)
        for _ in range(200):
            if stopped:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineStoppedError, match="rank 1 exited"):
            engine.check_alive()
        engine.shutdown()

    asyncio.run(main())
    assert len(stopped) == 1 and "rank 1 exited" in str(stopped[0])
    assert len(calls) == 1                                    # the loop ended at the first failure


def test_a_call_or_a_poll_that_hangs_reads_as_a_stuck_engine(model_dirs, monkeypatch):
    """Calls and tickers run on the engine thread between steps, and run collectives
    and transport calls too: one that hangs holds the engine as a hung step does, and
    the health check says so (it only watched steps: the replica kept reporting healthy)."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from engine import EngineConfig, LLMEngine, async_engine
    from engine.async_engine import AsyncEngine

    now = [1000.0]     # the stuck check's clock, the test's: only its moves count, never the machine's load
    monkeypatch.setattr(async_engine, "time", SimpleNamespace(monotonic=lambda: now[0]))

    async def main():
        config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128)
        engine = AsyncEngine(lambda: LLMEngine(config), name="stuck-call", cost_warmup_steps=0, stuck_step_s=2.0)
        await engine.ready()
        entered, gate = threading.Event(), threading.Event()
        try:
            def hang_for_a_while(e):
                entered.set()
                gate.wait(30)
            engine.submit(hang_for_a_while)
            while not entered.is_set():
                await asyncio.sleep(0.01)
            engine.check_alive()                       # at work, not yet for long
            now[0] += 2.5                              # past stuck_step_s, before the call returns
            with pytest.raises(EngineStoppedError, match="stuck: its current call .*hang_for_a_while has run"):
                engine.check_alive()
            gate.set()
            deadline = asyncio.get_running_loop().time() + 30
            while True:                                # it returns: the engine serves again
                try:
                    engine.check_alive()
                    break
                except EngineStoppedError:
                    assert asyncio.get_running_loop().time() < deadline, "still stuck after the call returned"
                    await asyncio.sleep(0.01)
            assert await engine.call(lambda e: "ran") == "ran"
        finally:
            gate.set()
            engine.shutdown()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_clean_up_queued_while_the_engine_looks_stuck_runs_once_it_is_free(model_dirs):
    # refused as "stopped", the clean-up (an abort, a hold's release) was dropped: the cancelled request
    # decoded on to max_tokens, or its KV stayed held, once the long step ended
    import asyncio
    import threading

    from engine import EngineConfig, LLMEngine
    from engine.async_engine import AsyncEngine

    async def main():
        config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128)
        engine = AsyncEngine(lambda: LLMEngine(config), name="stuck-cleanup", stuck_step_s=0.2)
        await engine.ready()
        release, cleaned = threading.Event(), []
        try:
            engine.submit(lambda e: release.wait(10))
            await asyncio.sleep(0.4)
            with pytest.raises(EngineStoppedError, match="stuck"):
                engine.check_alive()
            # queued, and not waited on: a stuck engine may never take it (its caller must not hang)
            await asyncio.wait_for(engine.call_for_cleanup(lambda e: cleaned.append("freed")), 1)
            assert cleaned == []
            release.set()                                   # the long step ends: the clean-up runs
            for _ in range(100):
                if cleaned:
                    break
                await asyncio.sleep(0.05)
        finally:
            release.set()
            engine.shutdown()
        return cleaned
    assert asyncio.run(asyncio.wait_for(main(), 60)) == ["freed"]


def test_a_shutdown_that_outlives_a_stuck_engine_thread_answers_its_waiters(model_dirs):
    # the waiters were failed only by the engine thread as it ended: one stuck for good (a kernel, an NCCL
    # peer killed under it) left every queued call and stream waiting with it
    import asyncio
    import threading

    from engine import EngineConfig, LLMEngine
    from engine.async_engine import AsyncEngine

    async def main():
        config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128)
        engine = AsyncEngine(lambda: LLMEngine(config), name="stuck-shutdown")
        await engine.ready()
        release = threading.Event()
        try:
            stuck = asyncio.ensure_future(engine.call(lambda e: release.wait(30)))     # the call it runs
            await asyncio.sleep(0.1)
            queued = asyncio.ensure_future(engine.call(lambda e: "ran"))              # and one behind it
            await asyncio.sleep(0.1)
            await asyncio.to_thread(engine.shutdown, 0.3)
            for waiter in (stuck, queued):
                with pytest.raises(EngineStoppedError, match="did not stop within 0.3 s"):
                    await asyncio.wait_for(waiter, 5)
        finally:
            release.set()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_settling_a_future_whose_loop_closed_is_a_no_op():
    # the engine thread fails its waiters as it ends; a waiter's loop may be closed by then (a worker
    # shut down after its loop), which raised and skipped the rest of the engine's clean-up
    import asyncio

    from engine.async_engine import settle_from_thread
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    loop.close()
    settle_from_thread(future, exc=EngineStoppedError("gone"))
    assert not future.done()


class _FakeResponse:
    """A Serve call's response: awaiting it runs `outcome` (a coroutine function)."""

    def __init__(self, outcome):
        self._outcome = outcome
        self.cancelled = False

    def __await__(self):
        return self._outcome().__await__()

    def cancel(self):
        self.cancelled = True


def test_a_call_its_replica_cancelled_is_the_replicas_failure_not_the_callers_cancel():
    # Serve raises CancelledError for a call its replica cancelled: read as the caller's own cancel, a
    # request of n choices waited for ever and a stream ended without an error or [DONE]
    import asyncio

    from router.serve_pools import _call

    async def replica_cancels():
        raise asyncio.CancelledError()

    cleanups = []

    async def main():
        response = _FakeResponse(replica_cancels)
        with pytest.raises(BackendUnavailableError, match="the decode worker cancelled the call"):
            await _call(response, "decode", on_cancel=lambda: cleanups.append("decode: abort everywhere"))
        # a prefill call is cleaned up all the same: Serve raises the same CancelledError into the calls of a
        # request whose client left (before it cancels the request's own task), and the call's reply, a held
        # KV, may be on its way (abandoned streams left prefill holds until their lease ran out)
        with pytest.raises(BackendUnavailableError, match="the prefill worker cancelled the call"):
            await _call(_FakeResponse(replica_cancels), "prefill",
                        on_cancel=lambda: cleanups.append("prefill: abort everywhere"), cleanup_on_any_cancel=True)
        return response.cancelled

    assert asyncio.run(main()) is True
    # not for the decode call: the hand-off retries under its request id, which a late abort would end
    assert cleanups == ["prefill: abort everywhere"]


def test_a_caller_that_is_cancelled_cancels_the_call_and_cleans_up():
    import asyncio

    from router.serve_pools import _call

    cleanups = []

    async def main():
        response = _FakeResponse(lambda: asyncio.sleep(3600))
        call = asyncio.ensure_future(_call(response, "decode", on_cancel=lambda: cleanups.append("abort")))
        await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        return response.cancelled

    assert asyncio.run(main()) is True
    assert cleanups == ["abort"]
