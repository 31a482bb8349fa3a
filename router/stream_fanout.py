"""The router's end of the decode replicas' per-step output streams.

    decode replica R ── stream_outputs(subscriber) ──▶ reader task for (R, subscriber) ─┐
                                                                                        ├─▶ one queue per request
    decode replica S ── stream_outputs(subscriber) ──▶ reader task for (S, subscriber) ─┘

A request joins, on the replica that takes it, the subscriber it was
submitted under: this router's name plus a generation that moves on whenever
one of its streams fails. One stream per (replica, subscriber) this router has
requests on, opened on first use and kept open while it has requests; each
message is one engine step's deltas (or several steps', when the router reads
slower than the replica steps) for all of the subscriber's requests there.
The replica ends a stream that stays idle (so a replica being scaled down can
stop); requests bound to it meanwhile get a new one.

A stream that fails ends every request bound to it with
BackendUnavailableError, and every request submitted under its subscriber
that the replica admits later: the replica aborts a failed stream's requests,
and one it had admitted while the router did not know yet would otherwise
wait for ever on a stream that never carries it. Requests submitted after the
failure go under the next generation's name, so they never join the failed
subscriber while the replica is still closing it (Serve's cancel arrives
later than the router hears of the failure), and the replica never sees a
second stream opened for a subscriber whose first one it still runs.

A delta of a request nobody waits for any more (its client left before the
router learnt its replica), or one from a replica other than the one the
request is bound to (a hand-off the router retried elsewhere that the first
replica admitted after all), is answered with an abort there. A delta that
arrives before the router knows which replica took its request (a replica's
stream can be faster than its reply) is kept, per stream, until `bind` says:
the bound stream's are delivered in order, and a copy on any other replica is
aborted there.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from cluster.serving.messages import TokenDelta
from router.backend import BackendUnavailableError

log = logging.getLogger(__name__)

OpenStream = Callable[[str, str], AsyncIterator[list[TokenDelta]]]   # (replica id, subscriber) -> its stream
Abort = Callable[[str, str], Awaitable[None]]                          # (replica id, request id)
StreamKey = tuple[str, str]                                            # (replica id, subscriber)


class SubmittedDuringStreamFailure(BackendUnavailableError):
    """The replica's output stream for the request's subscriber failed before the
    request was bound there: the replica may have taken it all the same."""


class StreamFanout:
    def __init__(self, open_stream: OpenStream, abort: Abort, subscriber: str = "router"):
        """`subscriber`: this router's name on the replicas (unique per router)."""
        self._open_stream = open_stream
        self._abort = abort
        self._name = subscriber
        self._generation = 0                         # moves on at every stream failure
        self._queues: dict[str, asyncio.Queue] = {}
        self._submitted_as: dict[str, str] = {}     # request id -> the subscriber it was last submitted under
        self._bound_to: dict[str, StreamKey] = {}
        self._readers: dict[StreamKey, asyncio.Task] = {}
        self._failed: set[StreamKey] = set()
        self._aborting: set[tuple[str, str]] = set()   # (replica id, request id) aborts under way
        self._abort_tasks: set[asyncio.Task] = set()
        self.closed = False                          # close() ran: the router is going away
        # request id -> stream -> its deltas that came before the request was bound
        self._early: dict[str, dict[StreamKey, list[TokenDelta]]] = {}

    @property
    def subscriber(self) -> str:
        """The name requests submitted now join on a replica."""
        return self._name if self._generation == 0 else f"{self._name}/{self._generation}"

    def expect(self, request_id: str) -> asyncio.Queue:
        """The queue that will receive the request's deltas (or an exception).
        Call before the request is submitted."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._submitted_as[request_id] = self.subscriber
        return queue

    def submitting(self, request_id: str) -> str:
        """The request's call to a decode replica is about to go: the subscriber
        to name in it (a stream failure before now cannot have crossed it).
        Recorded only for a request `expect` knows (`forget` clears it)."""
        if request_id in self._queues:
            self._submitted_as[request_id] = self.subscriber
        return self.subscriber

    def bind(self, request_id: str, replica_id: str) -> None:
        """The request runs on `replica_id`: read its subscriber's stream there (or,
        when that stream failed since the request was submitted, hear the failure)."""
        key = (replica_id, self._submitted_as.get(request_id, self.subscriber))
        self._bound_to[request_id] = key
        if self.closed:
            self._queues[request_id].put_nowait(BackendUnavailableError(
                "the router stopped reading the decode workers' output streams", replica_id))
            return
        early = self._early.pop(request_id, {})
        for (other, _), deltas in early.items():
            if other != replica_id and not deltas[-1].finished:
                self._abort_soon(other, request_id)
        if key in self._failed:
            self._queues[request_id].put_nowait(SubmittedDuringStreamFailure(
                f"the decode worker {replica_id}'s output stream failed while the request was submitted there",
                replica_id))
            return
        for delta in early.get(key, []):
            self._queues[request_id].put_nowait(delta)
        if key not in self._readers:
            self._readers[key] = _own_task(self._read(key))

    def forget(self, request_id: str, *, aborting_on: str | None = None) -> None:
        """Stops routing `request_id`'s deltas. `aborting_on`: the caller aborts it on
        that replica itself (then `abort_done`), so the deltas of the step in flight
        there are not answered with an abort of their own."""
        self._queues.pop(request_id, None)
        self._bound_to.pop(request_id, None)
        self._submitted_as.pop(request_id, None)
        self._early.pop(request_id, None)
        if aborting_on is not None:
            self._aborting.add((aborting_on, request_id))

    def abort_done(self, replica_id: str, request_id: str) -> None:
        """The caller's own abort of a forgotten request (forget's `aborting_on`) ended."""
        self._aborting.discard((replica_id, request_id))

    async def close(self) -> None:
        """Stops every reader; the requests bound to one hear that their stream ended
        (and, with `closed` set, are not moved elsewhere)."""
        self.closed = True
        for task in list(self._readers.values()):
            task.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)
        for rid, (replica_id, _) in list(self._bound_to.items()):
            self._queues[rid].put_nowait(BackendUnavailableError(
                f"the router stopped reading decode worker {replica_id}'s output stream", replica_id))

    async def _read(self, key: StreamKey) -> None:
        replica_id, subscriber = key
        reason = None
        try:
            async for batch in self._open_stream(replica_id, subscriber):
                for delta in batch:
                    rid = delta.request_id
                    queue = self._queues.get(rid)
                    bound_to = self._bound_to.get(rid)
                    if queue is not None and bound_to is None:   # which replica took it is not known yet
                        self._early.setdefault(rid, {}).setdefault(key, []).append(delta)
                    elif queue is not None and bound_to == key:
                        queue.put_nowait(delta)
                    elif not delta.finished and (bound_to is None or bound_to[0] != replica_id):
                        # nobody waits, or a copy on a replica the request is not on
                        self._abort_soon(replica_id, rid)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise                 # close(): this reader itself is being cancelled
            reason = f"the stream was cancelled ({exc or 'by the replica or Serve'})"
            log.warning("the output stream of decode replica %s was cancelled", replica_id)
        except Exception as exc:  # noqa: BLE001 - every request on the replica hears it
            reason = f"{type(exc).__name__}: {exc}"
            # Ray's and Serve's errors (the pools' BackendUnavailableError wraps them) say what happened;
            # anything else is a bug here, whose traceback finds it
            log.warning("the output stream of decode replica %s failed: %s", replica_id, reason,
                        exc_info=not (type(exc).__module__.startswith("ray.")
                                      or isinstance(exc, BackendUnavailableError)))
        finally:
            del self._readers[key]
        bound = [rid for rid, stream in self._bound_to.items() if stream == key]
        if reason is None:
            # the replica ended an idle stream: whatever was bound since belongs to its next stream
            if bound:
                self._readers[key] = _own_task(self._read(key))
            return
        self._forget_failures_nobody_can_bind()
        self._failed.add(key)
        if subscriber == self.subscriber:
            self._generation += 1
        error = BackendUnavailableError(f"the decode worker {replica_id} stopped streaming ({reason})")
        for rid in bound:
            self._queues[rid].put_nowait(error)

    def _forget_failures_nobody_can_bind(self) -> None:
        """A failed stream matters while a request submitted under its subscriber
        may still be bound to it; no request is submitted under an old generation."""
        waiting_under = set(self._submitted_as.values())
        self._failed = {key for key in self._failed if key[1] in waiting_under}

    def _abort_soon(self, replica_id: str, request_id: str) -> None:
        if (replica_id, request_id) not in self._aborting:
            self._aborting.add((replica_id, request_id))
            task = asyncio.get_running_loop().create_task(self._abort_orphan(replica_id, request_id))
            self._abort_tasks.add(task)    # the loop holds tasks weakly: one not held could vanish
            task.add_done_callback(self._abort_tasks.discard)

    async def _abort_orphan(self, replica_id: str, request_id: str) -> None:
        try:
            await self._abort(replica_id, request_id)
        except Exception as exc:  # noqa: BLE001 - best effort: it finishes on its own otherwise
            log.debug("abort of orphaned request %s failed: %s", request_id, exc)
        finally:
            self._aborting.discard((replica_id, request_id))


def _own_task(coro) -> asyncio.Task:
    """A task in a context of its own: a reader serves every request bound to its
    replica, not the request whose call happened to start it (whose context, and
    Serve's cancellation with it, a task would otherwise inherit)."""
    return contextvars.Context().run(asyncio.get_running_loop().create_task, coro)
