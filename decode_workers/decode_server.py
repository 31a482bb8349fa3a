"""DecodeServer: the Ray Serve deployment around a DecodeWorker (one replica =
one TP gang; its ranks sit in the replica's placement-group bundles). The same
class serves colocated mode (deployed as "ColocatedServer", with no KV
transport and no prefill pool: it prefills every request itself).

Remote operations (one definition each):
- generate(DecodeRequest) -> Admitted          routed by free KV blocks (`record_routing_stats`)
- stream_outputs(subscriber, min_interval_s) -> list[TokenDelta] per engine step, or per
  interval (stream batching)                                       (target_replica: this replica)
- abort(request_id)                                                (target_replica: this replica)
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import ray
from ray import exceptions as ray_exceptions
from ray import serve

from cluster.serving.handle_calls import cancel_call, replica_error
from cluster.serving.detached import detached
from cluster.serving.messages import Admitted, DecodeRequest, KVHolderLost, TokenDelta
from cluster.serving.replica_routing import TARGET_REPLICA, ReplicaGoneError
from cluster.serving.worker_deployment import WorkerDeployment
from cluster.transport.kv_transport import PeerAddress
from cluster.transport.transport_factory import TransportSettings, receiver_factory
from decode_workers.decode_worker import DecodeWorker
from engine.engine_config import EngineConfig
from engine.errors import EngineStoppedError

# a prefill replica that does not answer a send request in this long is gone (at least; see ServePrefillPeer)
SEND_CALL_TIMEOUT_S = 60.0
RENEW_CALL_TIMEOUT_S = 10.0
# what a call to a prefill replica raises when that replica is not running any more, or cannot serve
_GONE = (ReplicaGoneError, ray_exceptions.ActorDiedError, EngineStoppedError)


@serve.deployment(name="DecodeServer")
class DecodeServer(WorkerDeployment):
    async def __init__(self, engine_config: EngineConfig, transport: TransportSettings | None = None,
                       reserve_timeout_s: float = 120.0, prefill=None, staging_budget_bytes: int | None = None):
        """`transport` and `prefill` (the PrefillServer deployment's handle):
        both for disaggregated mode, neither for colocated mode.
        `staging_budget_bytes`: DecodeWorker's bound on receive buffers per rank."""
        engine_config = await self.join_gang(engine_config)
        name = f"decode-{self.replica_id}"
        make_receiver, peer = None, None
        if transport is not None:
            if transport.host is None:   # senders on other nodes reach this replica's receivers at the node's address
                transport = dataclasses.replace(transport, host=ray.util.get_node_ip_address())
            # the call outlasts the prefill side's wait for its staging budget (half the timeout) and more;
            # the transfer's own deadline cancels it sooner
            peer = ServePrefillPeer(prefill, call_timeout_s=max(SEND_CALL_TIMEOUT_S, 2 * transport.timeout_s))
            make_receiver = receiver_factory(transport, name)
        self.worker = DecodeWorker(engine_config, make_receiver, peer, reserve_timeout_s=reserve_timeout_s,
                                   transfer_timeout_s=transport.timeout_s if transport else 60.0,
                                   staging_budget_bytes=staging_budget_bytes, name=name,
                                   replica_id=self.replica_id)
        await self.worker.start()

    async def generate(self, request: DecodeRequest, *, avoid_replica: str | None = None) -> Admitted:
        """`avoid_replica` steers a retry away from a replica (cluster/serving/replica_routing.py)."""
        return await self.worker.generate(request)

    async def stream_outputs(self, subscriber: str, min_interval_s: float = 0.0, *,
                             target_replica: str) -> AsyncIterator[list[TokenDelta]]:
        async for batch in self.worker.stream(subscriber, min_interval_s):
            yield batch

    async def abort(self, request_id: str, *, target_replica: str) -> None:
        await self.worker.abort(request_id)


class ServePrefillPeer:
    """The prefill pool as a decode replica reaches it: the replica holding a
    request's KV, addressed by its id."""

    def __init__(self, handle, call_timeout_s: float = SEND_CALL_TIMEOUT_S):
        self._handle = handle
        self.call_timeout_s = call_timeout_s

    async def send_kv(self, replica_id: str, request_id: str, transfer_id: str,
                      receivers: list[PeerAddress]) -> int:
        call = self._handle.send_kv.remote(request_id, transfer_id, receivers, **{TARGET_REPLICA: replica_id})
        try:
            return await asyncio.wait_for(call, self.call_timeout_s)
        except BaseException as exc:
            cancel_call(call)   # awaiting a response does not cancel the remote call by itself
            cause = replica_error(exc)
            if isinstance(cause, _GONE):
                raise KVHolderLost(f"the prefill replica {replica_id} holding the KV of {request_id} is gone or "
                                   f"cannot serve: {cause}") from None
            if isinstance(cause, KeyError):     # the replica's answer for a request that holds nothing there
                raise KVHolderLost(f"the prefill replica {replica_id} holds no KV for {request_id} any more (its "
                                   "lease ran out)") from None
            raise

    def release(self, replica_id: str, request_id: str) -> None:
        # fire and forget: the lease frees the KV if this never lands
        detached(lambda: self._handle.release.remote(request_id, **{TARGET_REPLICA: replica_id}))

    async def renew(self, replica_id: str, request_id: str) -> bool | None:
        call = detached(lambda: self._handle.renew.remote(request_id, **{TARGET_REPLICA: replica_id}))
        try:
            return bool(await asyncio.wait_for(call, RENEW_CALL_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - else no answer in time (a busy engine): the next one asks again
            cancel_call(call)
            return False if isinstance(replica_error(exc), _GONE) else None
