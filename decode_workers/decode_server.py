"""DecodeServer and ColocatedServer: the Ray Serve deployments around a
DecodeWorker and a ColocatedWorker (one replica = one TP gang; its ranks sit
in the replica's placement-group bundles). `record_routing_stats` reports the
free KV blocks that new requests are routed by.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import ray
from ray import serve

from cluster.serving.handoff import DecodeRequest, ReadyToReceive
from cluster.transport.transport_factory import TransportSettings, receiver_factory
from cluster.serving.worker_deployment import WorkerDeployment
from decode_workers.colocated_worker import ColocatedWorker
from decode_workers.decode_worker import DecodeWorker
from engine.engine_config import EngineConfig
from engine.sampling_params import SamplingParams


@serve.deployment(name="DecodeServer")
class DecodeServer(WorkerDeployment):
    async def __init__(self, engine_config: EngineConfig, transport: TransportSettings, reserve_timeout_s: float):
        await self.join_gang(engine_config)
        name = f"decode-{self.replica_id}"
        # senders on other nodes reach this replica's receivers at the node's address
        transport = dataclasses.replace(transport, host=ray.util.get_node_ip_address())
        self.worker = DecodeWorker(engine_config, receiver_factory(transport, name),
                                   reserve_timeout_s=reserve_timeout_s, transfer_timeout_s=transport.timeout_s,
                                   name=name)
        await self.worker.start()

    async def generate(self, request: DecodeRequest, *, avoid_replica: str | None = None) -> AsyncIterator:
        """`avoid_replica` steers a retry away from a replica (cluster/serving/replica_routing.py)."""
        async for event in self.worker.generate(request):
            if isinstance(event, ReadyToReceive):
                event = dataclasses.replace(event, replica_id=self.replica_id)
            yield event


@serve.deployment(name="ColocatedServer")
class ColocatedServer(WorkerDeployment):
    async def __init__(self, engine_config: EngineConfig):
        await self.join_gang(engine_config)
        self.worker = ColocatedWorker(engine_config, name=f"colocated-{self.replica_id}")
        await self.worker.start()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator:
        async for out in self.worker.generate(request_id, prompt_token_ids, params):
            yield out


