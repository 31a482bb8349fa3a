"""The prefill and decode pools over Ray Serve deployment handles (the cluster
side of router/serving_backend.py's interfaces).

Errors raised inside a replica come back as Ray's wrapper; they are unwrapped
to the original exception (InvalidRequestError stays a 400, KVTransferFailed a
503) so the HTTP layer sees what the worker raised. A replica that died, or
whose engine stopped, turns into BackendUnavailableError (its requests move
on). A call whose caller is cancelled (the client left) is cancelled on the
replica too, and a cancelled prefill or decode admission is also aborted on
every replica of the pool: the one that took it may have answered first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from typing import NamedTuple

import grpc
from ray import exceptions as ray_exceptions
from ray.serve.exceptions import RayServeException, RequestCancelledError

from cluster.serving.handle_calls import cancel_call, replica_error
from cluster.serving.detached import detached
from cluster.serving.messages import Admitted, DecodeRequest, PrefillResult, TokenDelta
from cluster.serving.replica_routing import (
    AVOID_REPLICA,
    TARGET_REPLICA,
    ReplicaGoneError,
)
from engine.errors import EngineStoppedError
from engine.sampling_params import SamplingParams
from router.backend import BackendUnavailableError
from router.errors import SpacedLog

log = logging.getLogger(__name__)
# a failing health check's cause (INFO: probes fail while a deployment starts), each probe's (a load
# balancer's, every few seconds) left out for a minute
_HEALTH_FAILURE_LOG = SpacedLog(log, every_s=60.0, level=logging.INFO)

HEALTH_TIMEOUT_S = 5.0
# how long a background abort broadcast is awaited: a replica whose loop hangs must not keep one
# task per client that left alive here (the replica is failed by its health check meanwhile)
ABORT_BROADCAST_TIMEOUT_S = 30.0


class NoReplicaAnswered(Exception):
    """A broadcast reached replicas and not one of them answered in time: what the
    pool holds is unknown, which is not the same as a pool with no replica."""


class ReplicaAnswers(NamedTuple):
    """What a broadcast got back: the answers, and how many replicas it reached that
    gave none in time (alive but slow, their loops blocked) or whose call failed
    (dead, or being replaced)."""
    answers: list
    slow: int
    failed: int

    def some(self, method: str) -> "ReplicaAnswers":
        """These answers; NoReplicaAnswered when replicas were reached and not one answered."""
        if not self.answers and self.slow + self.failed:
            raise NoReplicaAnswered(f"none of {self.slow + self.failed} replicas answered {method} ({self.slow} "
                                    f"not in time, {self.failed} failed)")
        return self


async def replica_answers(handle, method: str, timeout_s: float) -> ReplicaAnswers:
    """Each running replica's answer to `method` (a Serve broadcast), within
    `timeout_s` in all: one replica that fails or does not answer in time is
    counted apart, not the others with it. Raises what the broadcast itself
    raises (TimeoutError before any replica was reached, no replica running)."""
    response = handle.broadcast(method)
    started = time.monotonic()
    fetch = getattr(response, "_fetch_replica_results_async", None)   # Serve's per-replica results
    if fetch is None:      # (another Serve version: one timeout for all of them)
        replies = await asyncio.wait_for(response.results_async(return_exceptions=True), timeout_s)
    else:
        results = await asyncio.wait_for(fetch(), timeout_s)
        left = max(0.0, timeout_s - (time.monotonic() - started))
        replies = await asyncio.gather(*(asyncio.wait_for(r.get_async(), left) for r in results),
                                       return_exceptions=True)
    errors = [r for r in replies if isinstance(r, BaseException)]
    if errors:
        log.debug("%d of %d replicas did not answer %s: %s", len(errors), len(replies), method, errors[0])
    slow = sum(isinstance(e, (TimeoutError, asyncio.TimeoutError)) for e in errors)
    return ReplicaAnswers([r for r in replies if not isinstance(r, BaseException)], slow, len(errors) - slow)


async def replica_replies(handle, method: str, timeout_s: float) -> list:
    """The answers of replica_answers; raises NoReplicaAnswered when replicas were
    reached and not one answered, and what the broadcast itself raises."""
    return (await replica_answers(handle, method, timeout_s)).some(method).answers


async def check_replicas(handle, what: str) -> None:
    """Raises BackendUnavailableError unless at least one replica answers."""
    try:
        replies = await replica_replies(handle, "stats", HEALTH_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure to answer means unavailable
        # why, in the log only: Ray's errors name actors, nodes and processes, and /health is open to anyone
        _HEALTH_FAILURE_LOG.log("health check: no %s worker answered: %r", what, exc)
        raise BackendUnavailableError(f"no {what} worker answered") from None
    if not replies:
        raise BackendUnavailableError(f"no {what} worker answered")


@contextmanager
def unwrapped_errors(what: str):
    try:
        yield
    except ray_exceptions.RayTaskError as exc:
        cause = replica_error(exc)
        if isinstance(cause, EngineStoppedError):   # alive, but it cannot serve: as if it had died
            raise BackendUnavailableError(f"the {what} worker is unavailable: {cause}", cause.replica_id) from None
        raise cause from None
    except (ray_exceptions.ActorDiedError, ray_exceptions.ActorUnavailableError, ReplicaGoneError) as exc:
        raise BackendUnavailableError(f"the {what} worker is unavailable: {exc}") from None
    except RayServeException as exc:
        if isinstance(exc, RequestCancelledError):
            raise
        # the deployment is being deleted, or a rolling update failed: not the request's fault
        raise BackendUnavailableError(f"the {what} deployment is unavailable: {exc}") from None
    except grpc.aio.AioRpcError as exc:
        # Serve's gRPC transport between deployments (local clusters use it) says UNAVAILABLE as
        # ActorUnavailableError; any other failure of the call (a stream cut by a dying replica) is
        # the replica's too
        raise BackendUnavailableError(f"the call to the {what} worker failed: {exc.code().name} "
                                      f"{exc.details()}") from None


async def _call(response, what: str, on_cancel: Callable[[], None] | None = None,
                cleanup_on_any_cancel: bool = False):
    """Awaits a Serve call; cancels it on the replica when the caller is
    cancelled, then runs `on_cancel` (for what the replica may have made before
    the cancel reached it). A cancel that is not the caller's (the replica ended
    its side, or Serve's own: it cancels the calls of a request whose client left
    before it cancels the request's task) is the replica's failure:
    BackendUnavailableError, which a request survives by moving; `on_cancel` runs
    then too only with `cleanup_on_any_cancel`, for calls whose request id no retry
    reuses (the clean-up would end the retry)."""
    try:
        with unwrapped_errors(what):
            return await response
    except asyncio.CancelledError:
        cancel_call(response)
        own = _cancelling_this_task()
        if on_cancel is not None and (own or cleanup_on_any_cancel):
            on_cancel()
        if not own:
            raise BackendUnavailableError(f"the {what} worker cancelled the call") from None
        raise


def _cancelling_this_task() -> bool:
    """Whether the running task is being cancelled (its own cancel, not one a callee raised)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _forget_cleanup(tasks: set[asyncio.Task]) -> Callable[[asyncio.Task], None]:
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("a background abort failed: %s", task.exception())
    return done


class _AbortEverywhere:
    """For a call cut off while a replica may already have taken the request (the
    client left): the reply naming the replica is lost, so every replica drops the
    request id (unknown ids are a no-op). Only cut-off calls pay for the broadcast."""

    def __init__(self, handle):
        self._handle = handle
        self._cleanups: set[asyncio.Task] = set()   # background aborts, kept alive until done

    def __call__(self, request_id: str) -> Callable[[], None]:
        def abort() -> None:
            broadcast = detached(lambda: self._handle.broadcast("abort", request_id, **{TARGET_REPLICA: ""}))
            # a broadcast is sent once awaited
            task = asyncio.ensure_future(asyncio.wait_for(broadcast.results_async(), ABORT_BROADCAST_TIMEOUT_S))
            self._cleanups.add(task)
            task.add_done_callback(_forget_cleanup(self._cleanups))
        return abort


class ServePrefillPool:
    def __init__(self, handle):
        self._handle = handle
        self._abort_everywhere = _AbortEverywhere(handle)   # a finished prefill holds the KV

    async def check_health(self) -> None:
        await check_replicas(self._handle, "prefill")

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> PrefillResult:
        # its reply, KV held, may be on its way when Serve cuts the call off for a client that left:
        # dropped however the call was cancelled (a prefill is never retried under its id)
        return await _call(self._handle.prefill.remote(request_id, prompt_token_ids, params), "prefill",
                           on_cancel=self._abort_everywhere(request_id), cleanup_on_any_cancel=True)

    def release(self, result: PrefillResult) -> None:
        # fire and forget: the lease frees the KV if this never lands
        detached(lambda: self._handle.release.remote(result.request_id, **{TARGET_REPLICA: result.replica_id}))

    def abort_everywhere(self, request_id: str) -> None:
        self._abort_everywhere(request_id)()


class ServeDecodePool:
    """Decode replicas (or colocated ones: the same deployment class)."""

    def __init__(self, handle, what: str = "decode", stream_interval_s: float = 0.0):
        """`stream_interval_s`: the replicas batch this router's mid-stream tokens
        over at least this long (decode_workers/delta_outbox.py)."""
        self._handle = handle
        self._streams = handle.options(stream=True)
        self._what = what
        self._stream_interval_s = stream_interval_s
        self._abort_everywhere = _AbortEverywhere(handle)   # an admitted request would decode unheard

    async def check_health(self) -> None:
        await check_replicas(self._handle, self._what)

    async def generate(self, request: DecodeRequest, avoid_replica: str | None = None) -> Admitted:
        return await _call(self._handle.generate.remote(request, **{AVOID_REPLICA: avoid_replica}), self._what,
                           on_cancel=self._abort_everywhere(request.request_id))

    async def abort(self, replica_id: str, request_id: str) -> None:
        await _call(detached(lambda: self._handle.abort.remote(request_id, **{TARGET_REPLICA: replica_id})),
                    self._what)

    def abort_everywhere(self, request_id: str) -> None:
        self._abort_everywhere(request_id)()

    async def stream(self, replica_id: str, subscriber: str) -> AsyncIterator[list[TokenDelta]]:
        # detached: the stream carries every request of this router on the replica, so it must not be
        # a child of the one request whose client happened to open it (Serve cancels those with it)
        stream = detached(lambda: self._streams.stream_outputs.remote(subscriber, self._stream_interval_s,
                                                                       **{TARGET_REPLICA: replica_id}))
        try:
            with unwrapped_errors(self._what):
                async for batch in stream:
                    yield batch
        finally:
            cancel_call(stream)
