"""The router's end of the decode replicas' per-step output streams.

    decode replica R ── stream_outputs(subscriber) ──▶ reader task for R ─┐
                                                                           ├─▶ one queue per request
    decode replica S ── stream_outputs(subscriber) ──▶ reader task for S ─┘

One stream per replica this router has requests on, opened on first use and
kept open while it has requests; each message is one engine step's deltas (or
several steps', when the router reads slower than the replica steps) for all
of this router's requests there. The replica ends a stream that stays idle
(so a replica being scaled down can stop); requests bound to it meanwhile get
a new one. A stream that fails ends every request bound to its replica with
BackendUnavailableError, and every request bound to it later that was
expected before the failure: the replica aborts a failed stream's requests,
and one it had admitted while the router did not know yet would otherwise
wait for ever on a stream that never carries it. A delta of a request nobody
waits for any more (its client left before the router learnt its replica), or
one from a replica other than the one the request is bound to (a hand-off the
router retried elsewhere that the first replica admitted after all), is
answered with an abort there. A delta that arrives before the router knows
which replica took its request (a replica's stream can be faster than its
reply) is kept, per replica, until `bind` says: the bound replica's are
delivered in order, and a copy on any other (a hand-off retried elsewhere
that the first replica admitted after all) is aborted there.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from cluster.serving.messages import TokenDelta
from router.backend import BackendUnavailableError

log = logging.getLogger(__name__)

OpenStream = Callable[[str], AsyncIterator[list[TokenDelta]]]   # replica id -> its stream
Abort = Callable[[str, str], Awaitable[None]]                     # (replica id, request id)


class SubmittedDuringStreamFailure(BackendUnavailableError):
    """The replica's output stream failed between the request's submission and its
    admission there: the replica may have taken it under a new stream all the same."""


class StreamFanout:
    def __init__(self, open_stream: OpenStream, abort: Abort):
        self._open_stream = open_stream
        self._abort = abort
        self._queues: dict[str, asyncio.Queue] = {}
        self._replica_of: dict[str, str] = {}
        self._readers: dict[str, asyncio.Task] = {}
        self._aborting: set[tuple[str, str]] = set()   # (replica id, request id) aborts under way
        self._abort_tasks: set[asyncio.Task] = set()
        self.closed = False                          # close() ran: the router is going away
        self._num_failures = 0                      # stream failures so far, of any replica
        self._failure_of: dict[str, int] = {}       # replica id -> the count at its latest failure
        self._expected_at: dict[str, int] = {}      # request id -> the count when it was expected
        # request id -> replica id -> its deltas that came before the request was bound
        self._early: dict[str, dict[str, list[TokenDelta]]] = {}

    def expect(self, request_id: str) -> asyncio.Queue:
        """The queue that will receive the request's deltas (or an exception).
        Call before the request is submitted."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._expected_at[request_id] = self._num_failures
        return queue

    def submitting(self, request_id: str) -> None:
        """The request's call to a decode replica is about to go: a stream failure
        before now (during its prefill elsewhere, say) cannot have crossed it."""
        if request_id in self._expected_at:
            self._expected_at[request_id] = self._num_failures

    def bind(self, request_id: str, replica_id: str) -> None:
        """The request runs on `replica_id`: read that replica's stream (or, when
        that stream failed since the request was expected, hear the failure)."""
        self._replica_of[request_id] = replica_id
        if self.closed:
            self._queues[request_id].put_nowait(BackendUnavailableError(
                "the router stopped reading the decode workers' output streams", replica_id))
            return
        early = self._early.pop(request_id, {})
        for other, deltas in early.items():
            if other != replica_id and not deltas[-1].finished:
                self._abort_soon(other, request_id)
        if self._failure_of.get(replica_id, 0) > self._expected_at.get(request_id, self._num_failures):
            self._queues[request_id].put_nowait(SubmittedDuringStreamFailure(
                f"the decode worker {replica_id}'s output stream failed while the request was submitted there",
                replica_id))
            return
        for delta in early.get(replica_id, []):
            self._queues[request_id].put_nowait(delta)
        if replica_id not in self._readers:
            self._readers[replica_id] = _own_task(self._read(replica_id))

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._replica_of.pop(request_id, None)
        self._expected_at.pop(request_id, None)
        self._early.pop(request_id, None)

    async def close(self) -> None:
        """Stops every reader; the requests bound to one hear that their stream ended
        (and, with `closed` set, are not moved elsewhere)."""
        self.closed = True
        for task in list(self._readers.values()):
            task.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)
        for rid, replica_id in list(self._replica_of.items()):
            self._queues[rid].put_nowait(BackendUnavailableError(
                f"the router stopped reading decode worker {replica_id}'s output stream", replica_id))

    async def _read(self, replica_id: str) -> None:
        reason = None
        try:
            async for batch in self._open_stream(replica_id):
                for delta in batch:
                    rid = delta.request_id
                    queue = self._queues.get(rid)
                    bound_to = self._replica_of.get(rid)
                    if queue is not None and bound_to is None:   # which replica took it is not known yet
                        self._early.setdefault(rid, {}).setdefault(replica_id, []).append(delta)
                    elif queue is not None and bound_to == replica_id:
                        queue.put_nowait(delta)
                    elif not delta.finished:    # nobody waits, or a copy on a replica the request is not on
                        self._abort_soon(replica_id, rid)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or getattr(task, "cancelling", lambda: 1)():
                raise                 # close(): this reader itself is being cancelled
            reason = f"the stream was cancelled ({exc or 'by the replica or Serve'})"
            log.warning("the output stream of decode replica %s was cancelled", replica_id)
        except Exception as exc:  # noqa: BLE001 - every request on the replica hears it
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("the output stream of decode replica %s failed: %s", replica_id, reason)
        finally:
            del self._readers[replica_id]
        bound = [rid for rid, replica in self._replica_of.items() if replica == replica_id]
        if reason is None:
            # the replica ended an idle stream: whatever was bound since belongs to its next stream
            if bound:
                self._readers[replica_id] = _own_task(self._read(replica_id))
            return
        self._num_failures += 1
        self._failure_of[replica_id] = self._num_failures
        error = BackendUnavailableError(f"the decode worker {replica_id} stopped streaming ({reason})")
        for rid in bound:
            self._queues[rid].put_nowait(error)

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
