"""Prefill, decode and colocated pools over Ray Serve deployment handles (the
cluster side of router/disaggregated_backend.py's interfaces).

Errors raised inside a replica come back as Ray's wrapper; they are unwrapped
to the original exception (InvalidRequestError stays a 400, KVTransferFailed a
503) so the HTTP layer sees what the worker raised. A replica that died turns
into BackendUnavailableError.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import contextmanager

from ray import exceptions as ray_exceptions

from cluster.serving.handoff import DecodeRequest, PrefillResult
from cluster.transport.kv_transport import PeerAddress
from cluster.serving.replica_routing import AVOID_REPLICA, TARGET_REPLICA
from engine.sampling_params import SamplingParams
from router.backend import BackendUnavailableError

# a targeted call that waits this long for its replica means the replica is gone
TARGETED_CALL_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 5.0


async def check_replicas(handle, what: str) -> None:
    """Raises BackendUnavailableError unless at least one replica answers."""
    try:
        replies = await asyncio.wait_for(handle.broadcast("stats").results_async(), HEALTH_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure to answer means unavailable
        raise BackendUnavailableError(f"no {what} worker answered: {exc or type(exc).__name__}") from None
    if not replies:
        raise BackendUnavailableError(f"no {what} worker is running")


@contextmanager
def unwrapped_errors(what: str):
    try:
        yield
    except ray_exceptions.RayTaskError as exc:
        cause = exc.cause if exc.cause is not None else exc
        raise cause from None
    except (ray_exceptions.ActorDiedError, ray_exceptions.ActorUnavailableError) as exc:
        raise BackendUnavailableError(f"the {what} worker is unavailable: {exc}") from None


class ServePrefillPool:
    def __init__(self, handle):
        self._handle = handle

    async def check_health(self) -> None:
        await check_replicas(self._handle, "prefill")

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> PrefillResult:
        with unwrapped_errors("prefill"):
            return await self._handle.prefill.remote(request_id, prompt_token_ids, params)

    async def send_kv(self, result: PrefillResult, transfer_id: str, receivers: list[PeerAddress]) -> int:
        with unwrapped_errors("prefill"):
            call = self._handle.send_kv.remote(result.request_id, transfer_id, receivers,
                                               **{TARGET_REPLICA: result.replica_id})
            return await asyncio.wait_for(call, TARGETED_CALL_TIMEOUT_S)

    async def release(self, result: PrefillResult) -> None:
        # fire and forget: the lease frees the KV if this never lands
        self._handle.release.remote(result.request_id, **{TARGET_REPLICA: result.replica_id})


class ServeDecodePool:
    def __init__(self, handle):
        self._handle = handle.options(stream=True)
        self._plain = handle

    async def check_health(self) -> None:
        await check_replicas(self._plain, "decode")

    async def generate(self, request: DecodeRequest, avoid_replica: str | None = None) -> AsyncIterator:
        stream = self._handle.generate.remote(request, **{AVOID_REPLICA: avoid_replica})
        try:
            with unwrapped_errors("decode"):
                async for event in stream:
                    yield event
        finally:
            stream.cancel()


class ServeColocatedPool:
    def __init__(self, handle):
        self._handle = handle.options(stream=True)
        self._plain = handle

    async def check_health(self) -> None:
        await check_replicas(self._plain, "colocated")

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator:
        stream = self._handle.generate.remote(request_id, prompt_token_ids, params)
        try:
            with unwrapped_errors("colocated"):
                async for out in stream:
                    yield out
        finally:
            stream.cancel()
