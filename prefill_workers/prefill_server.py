"""PrefillServer: the Ray Serve deployment around a PrefillWorker (one replica =
one TP gang; its ranks sit in the replica's placement-group bundles).

Calls that concern a request whose KV this replica holds (`send_kv` and
`renew` from a decode replica, `release`, `abort`) carry `target_replica`, which
cluster/serving/replica_routing.py uses to route them here;
`record_routing_stats` reports the queued prefill tokens that new prompts are
routed by.
"""

from __future__ import annotations

from ray import serve

from cluster.serving.messages import PrefillResult
from cluster.serving.worker_deployment import WorkerDeployment
from cluster.transport.kv_transport import PeerAddress
from cluster.transport.transport_factory import TransportSettings, sender_factory
from engine.engine_config import EngineConfig
from engine.sampling_params import SamplingParams
from prefill_workers.prefill_worker import PrefillWorker


@serve.deployment(name="PrefillServer")
class PrefillServer(WorkerDeployment):
    async def __init__(self, engine_config: EngineConfig, transport: TransportSettings, lease_s: float = 60.0,
                       staging_budget_bytes: int | None = None):
        """`staging_budget_bytes`: PrefillWorker's bound on packed send copies per rank."""
        engine_config = await self.join_gang(engine_config)
        name = f"prefill-{self.replica_id}"
        # a send waiting for room must start well within the receiver's transfer timeout
        self.worker = PrefillWorker(engine_config, sender_factory(transport, name), lease_s=lease_s,
                                    staging_budget_bytes=staging_budget_bytes, send_wait_s=transport.timeout_s / 2,
                                    name=name, replica_id=self.replica_id)
        await self.worker.start()

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> PrefillResult:
        return await self.worker.prefill(request_id, prompt_token_ids, params)

    async def send_kv(self, request_id: str, transfer_id: str, receivers: list[PeerAddress], *,
                      target_replica: str) -> int:
        return await self.worker.send_kv(request_id, transfer_id, receivers)

    async def renew(self, request_id: str, *, target_replica: str) -> bool:
        return await self.worker.renew(request_id)

    async def release(self, request_id: str, *, target_replica: str) -> bool:
        return await self.worker.release(request_id)

    async def abort(self, request_id: str, *, target_replica: str) -> None:
        await self.worker.abort(request_id)
