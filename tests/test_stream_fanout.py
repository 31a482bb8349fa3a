"""The router's end of the decode replicas' output streams (router/stream_fanout.py),
over fake streams: deltas reach their request, a failed stream fails its
requests, including one bound to the replica after the failure."""

from __future__ import annotations

import asyncio

import pytest

from cluster.serving.messages import TokenDelta
from router.backend import BackendUnavailableError
from router.stream_fanout import StreamFanout


class FakeReplicas:
    """Each opened stream yields what `send` puts for its replica and subscriber, and raises what `fail` puts."""

    def __init__(self):
        self.feeds: dict[tuple[str, str], asyncio.Queue] = {}
        self.opened: list[tuple[str, str]] = []          # (replica, subscriber)
        self.aborted: list[tuple[str, str]] = []

    async def open_stream(self, replica_id: str, subscriber: str):
        self.opened.append((replica_id, subscriber))
        feed = self.feeds.setdefault((replica_id, subscriber), asyncio.Queue())
        while True:
            item = await feed.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def send(self, replica_id: str, *deltas: TokenDelta, subscriber: str = "router") -> None:
        self.feeds.setdefault((replica_id, subscriber), asyncio.Queue()).put_nowait(list(deltas))

    def fail(self, replica_id: str, subscriber: str = "router") -> None:
        self.feeds.setdefault((replica_id, subscriber), asyncio.Queue()).put_nowait(ConnectionError("stream broke"))

    async def abort(self, replica_id: str, request_id: str) -> None:
        self.aborted.append((replica_id, request_id))


def _delta(request_id: str, token: int, finished: bool = False) -> TokenDelta:
    return TokenDelta(request_id, [token], "", None, finished=finished)


async def _next(queue: asyncio.Queue):
    return await asyncio.wait_for(queue.get(), 5)


def test_deltas_reach_their_request_and_an_orphan_is_aborted():
    async def run():
        replicas = FakeReplicas()
        fanout = StreamFanout(replicas.open_stream, replicas.abort)
        a, b = fanout.expect("a"), fanout.expect("b")
        fanout.bind("a", "R")
        fanout.bind("b", "R")
        replicas.send("R", _delta("a", 1), _delta("b", 2), _delta("gone", 3))
        assert (await _next(a)).token_ids == [1] and (await _next(b)).token_ids == [2]
        await asyncio.sleep(0.05)
        assert replicas.aborted == [("R", "gone")] and replicas.opened == [("R", "router")]
        await fanout.close()

    asyncio.run(run())


def test_a_request_its_caller_aborts_itself_is_not_aborted_again_by_the_backstop():
    # the step in flight when the client left still streams the request's delta: forgotten with
    # aborting_on, that delta is not answered with a second abort (the caller's own is under way)
    async def run():
        replicas = FakeReplicas()
        fanout = StreamFanout(replicas.open_stream, replicas.abort)
        fanout.expect("a")
        fanout.bind("a", "R")
        keep = fanout.expect("keep")
        fanout.bind("keep", "R")
        fanout.forget("a", aborting_on="R")
        replicas.send("R", _delta("a", 1), _delta("keep", 2))
        assert (await _next(keep)).token_ids == [2]
        await asyncio.sleep(0.05)
        assert replicas.aborted == []
        fanout.abort_done("R", "a")
        replicas.send("R", _delta("a", 3), _delta("keep", 4))       # after the caller's abort: the backstop again
        assert (await _next(keep)).token_ids == [4]
        await asyncio.sleep(0.05)
        assert replicas.aborted == [("R", "a")]
        await fanout.close()

    asyncio.run(run())


def test_a_copy_left_on_a_replica_the_request_moved_from_is_aborted_not_interleaved():
    # a hand-off retried on S after the router saw R's call fail, though R admitted it after all:
    # R's tokens for the request must not reach its client beside S's
    async def run():
        replicas = FakeReplicas()
        fanout = StreamFanout(replicas.open_stream, replicas.abort)
        other, moved = fanout.expect("other"), fanout.expect("h")
        fanout.bind("other", "R")
        fanout.bind("h", "S")
        replicas.send("R", _delta("h", 99), _delta("other", 1))
        replicas.send("S", _delta("h", 7))
        assert (await _next(other)).token_ids == [1]
        assert (await _next(moved)).token_ids == [7]
        await asyncio.sleep(0.05)
        assert moved.empty() and replicas.aborted == [("R", "h")]
        await fanout.close()
    asyncio.run(run())


def test_deltas_before_the_bind_go_to_the_request_from_its_replica_only():
    # R's and S's streams carry the request before either reply came back (a hand-off retried on S
    # after R's call failed, though R admitted it): S's tokens reach the client, in order; R's copy
    # is aborted
    async def run():
        replicas = FakeReplicas()
        fanout = StreamFanout(replicas.open_stream, replicas.abort)
        for replica in ("R", "S"):                 # both streams are open for other requests
            fanout.expect(f"other-{replica}")
            fanout.bind(f"other-{replica}", replica)
        handed = fanout.expect("h")
        replicas.send("R", _delta("h", 99))
        replicas.send("S", _delta("h", 7))
        replicas.send("S", _delta("h", 8))
        await asyncio.sleep(0.05)
        assert handed.empty()                      # unbound: which replica took it is not known yet
        fanout.bind("h", "S")
        replicas.send("S", _delta("h", 9, finished=True))
        assert [(await _next(handed)).token_ids[0] for _ in range(3)] == [7, 8, 9]
        await asyncio.sleep(0.05)
        assert handed.empty() and replicas.aborted == [("R", "h")]
        await fanout.close()
    asyncio.run(run())


def test_a_failed_stream_fails_its_requests_and_those_admitted_there_before_the_router_knew():
    async def run():
        replicas = FakeReplicas()
        fanout = StreamFanout(replicas.open_stream, replicas.abort)
        bound, in_flight = fanout.expect("bound"), fanout.expect("in-flight")
        fanout.bind("bound", "R")
        replicas.fail("R")
        with pytest.raises(BackendUnavailableError, match="stopped streaming"):
            raise await _next(bound)
        # R had admitted "in-flight" (and aborted it with its failed stream) before its reply came back
        fanout.bind("in-flight", "R")
        with pytest.raises(BackendUnavailableError, match="failed while the request was submitted there"):
            raise await _next(in_flight)
        # a request submitted after the failure joins a new subscriber there, and reads its stream
        later = fanout.expect("later")
        assert fanout.submitting("later") == "router/1"
        fanout.bind("later", "R")
        replicas.send("R", _delta("later", 7, finished=True), subscriber="router/1")
        assert (await _next(later)).token_ids == [7]
        assert replicas.opened == [("R", "router"), ("R", "router/1")]
        await fanout.close()

    asyncio.run(run())


def test_after_a_failure_new_requests_join_a_new_subscriber_and_the_old_streams_keep_theirs():
    """R's stream fails while S's is healthy: what is bound to S keeps reading S's
    stream; a request submitted afterwards goes under the next name, on S too,
    and a request submitted under the old name and bound to S is not failed."""
    async def run():
        replicas = FakeReplicas()
        fanout = StreamFanout(replicas.open_stream, replicas.abort, "router-x")
        on_r, on_s, to_s = fanout.expect("on-r"), fanout.expect("on-s"), fanout.expect("to-s")
        assert fanout.submitting("to-s") == "router-x"
        fanout.bind("on-r", "R")
        fanout.bind("on-s", "S")
        replicas.fail("R", "router-x")
        assert isinstance(await _next(on_r), BackendUnavailableError)
        fanout.bind("to-s", "S")            # submitted before R failed: S's stream under the old name
        new = fanout.expect("new")
        assert fanout.submitting("new") == "router-x/1"
        fanout.bind("new", "S")
        replicas.send("S", _delta("on-s", 1), _delta("to-s", 2), subscriber="router-x")
        replicas.send("S", _delta("new", 3), subscriber="router-x/1")
        assert (await _next(on_s)).token_ids == [1] and (await _next(to_s)).token_ids == [2]
        assert (await _next(new)).token_ids == [3]
        assert fanout.submitting("never-expected") == "router-x/1" and "never-expected" not in fanout._submitted_as
        assert sorted(replicas.opened) == [("R", "router-x"), ("S", "router-x"), ("S", "router-x/1")]
        assert replicas.aborted == []
        await fanout.close()

    asyncio.run(run())


def test_a_failed_stream_is_remembered_while_a_request_submitted_under_it_may_still_bind_and_no_longer():
    async def run():
        replicas = FakeReplicas()
        fanout = StreamFanout(replicas.open_stream, replicas.abort)
        first, pending = fanout.expect("first"), fanout.expect("pending")
        fanout.bind("first", "R")
        replicas.fail("R")
        assert isinstance(await _next(first), BackendUnavailableError)
        fanout.forget("first")
        second = fanout.expect("second")
        fanout.bind("second", "R")
        replicas.fail("R", "router/1")
        assert isinstance(await _next(second), BackendUnavailableError)
        fanout.forget("second")
        # "pending", submitted before the first failure, is bound after the second: it still hears the first
        fanout.bind("pending", "R")
        with pytest.raises(BackendUnavailableError, match="failed while the request was submitted there"):
            raise await _next(pending)
        fanout.forget("pending")
        third = fanout.expect("third")
        fanout.bind("third", "S")
        replicas.fail("S", "router/2")
        assert isinstance(await _next(third), BackendUnavailableError)
        assert fanout._failed == {("S", "router/2")}    # nobody submitted under the older names waits
        await fanout.close()

    asyncio.run(run())


def test_a_stream_cancelled_from_outside_fails_its_requests_and_readers_have_a_context_of_their_own():
    # Serve cancels the calls a request made when its client leaves: the shared stream must not be one
    # of them, and if a stream is cancelled anyway its requests hear it instead of waiting for ever
    import contextvars
    request_context = contextvars.ContextVar("request_context", default=None)
    seen = []

    async def run():
        replicas = FakeReplicas()
        opened = replicas.open_stream

        async def recording(replica_id, subscriber):
            seen.append(request_context.get())
            async for batch in opened(replica_id, subscriber):
                yield batch
        fanout = StreamFanout(recording, replicas.abort)
        a, b = fanout.expect("a"), fanout.expect("b")
        request_context.set("request a")           # the call that binds a carries its request's context
        fanout.bind("a", "R")
        fanout.bind("b", "R")
        replicas.feeds.setdefault(("R", "router"), asyncio.Queue()).put_nowait(asyncio.CancelledError())
        for queue in (a, b):
            assert isinstance(await _next(queue), BackendUnavailableError)
        await fanout.close()
    asyncio.run(run())
    assert seen == [None]


def test_closing_the_fanout_ends_the_requests_bound_to_its_streams():
    async def run():
        replicas = FakeReplicas()
        fanout = StreamFanout(replicas.open_stream, replicas.abort)
        queue = fanout.expect("a")
        fanout.bind("a", "R")
        await asyncio.sleep(0.01)            # R's stream is open, with nothing to read
        await fanout.close()
        error = await _next(queue)
        assert isinstance(error, BackendUnavailableError) and error.replica_id == "R"
        assert "stopped reading decode worker R's output stream" in str(error)

    asyncio.run(run())


def test_a_request_bound_after_the_fanout_closed_hears_so_and_opens_nothing():
    async def run():
        replicas = FakeReplicas()
        fanout = StreamFanout(replicas.open_stream, replicas.abort)
        await fanout.close()
        queue = fanout.expect("late")
        fanout.bind("late", "R")
        assert isinstance(await _next(queue), BackendUnavailableError) and fanout.closed
        await asyncio.sleep(0.01)
        assert replicas.opened == []

    asyncio.run(run())


def test_a_stream_failing_on_a_bug_here_is_logged_with_its_traceback_and_ray_s_errors_without(caplog):
    # a KeyError in the router's own reading code read as "the decode replica failed", with no traceback
    class RayLikeError(Exception):
        pass
    RayLikeError.__module__ = "ray.exceptions"

    async def run():
        replicas = FakeReplicas()
        fanout = StreamFanout(replicas.open_stream, replicas.abort)
        for replica, error in (("R", KeyError("a bug")), ("S", RayLikeError("actor died")),
                               ("T", BackendUnavailableError("the decode worker is unavailable: it died"))):
            queue = fanout.expect(replica)
            fanout.bind(replica, replica)
            replicas.feeds.setdefault((replica, fanout.subscriber), asyncio.Queue()).put_nowait(error)
            with pytest.raises(BackendUnavailableError, match="stopped streaming"):
                raise await _next(queue)
        await fanout.close()

    with caplog.at_level("WARNING", logger="router.stream_fanout"):
        asyncio.run(run())
    traced = {r.getMessage().split(" failed")[0][-1]: bool(r.exc_info) for r in caplog.records}
    assert traced == {"R": True, "S": False, "T": False}
