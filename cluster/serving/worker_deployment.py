"""What every worker deployment (prefill, decode, colocated) exposes to Ray
Serve besides its own methods: load figures for the router's replica choice
(`record_routing_stats`, polled by Serve) and for /metrics (`stats`), a health
probe that reaches the engine loop, and stopping the engine with the replica.
Subclasses call `join_gang` first in their constructor, then set `self.worker`
(a PrefillWorker or DecodeWorker) on the engine options it returns.
"""

from __future__ import annotations

import dataclasses
import secrets
import sys

from ray import serve

from cluster.serving.gang_devices import claim_gang_gpus
from cluster.serving.process_priority import normal_priority
from cluster.serving.replica_logging import use_serve_handlers
from engine.engine_config import EngineConfig

GIL_SWITCH_INTERVAL_S = 0.0005


class WorkerDeployment:
    worker = None
    replica_id = ""

    async def join_gang(self, engine_config: EngineConfig) -> EngineConfig:
        """Sets this replica's id; on CUDA, gives the gang its GPUs
        (cluster/serving/gang_devices.py). Returns the engine options this replica
        runs with: the deployment's, with a seed of its own for unseeded sampling
        (replicas drawing the same noise would give the choices of an `n` request,
        spread over them, the same text)."""
        use_serve_handlers()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        normal_priority()   # before the engine thread and any rank process start: they inherit it
        # the engine thread takes the GIL back after every torch op; with Python's default 5 ms
        # switch interval it can wait that long behind the replica's event loop on each op
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        if engine_config.device == "cuda":
            await claim_gang_gpus(engine_config.tensor_parallel_size)
        return dataclasses.replace(engine_config, seed=secrets.randbits(63))

    def stats(self) -> dict:
        """The worker's figures; raises EngineStoppedError where its engine stopped, so
        that the router's health check and figures leave it out (its last figures
        are no replica serving) until Serve's health probe replaces it."""
        self.worker.check_health()
        return {"replica": self.replica_id, **self.worker.stats()}

    def step_samples(self) -> dict:
        """This replica's engine steps since the last call (for the autoscaler); raises
        EngineStoppedError where its engine stopped, as `stats` does, so that the
        autoscaler does not count it as a replica serving."""
        self.worker.check_health()
        return {"replica": self.replica_id, "steps": self.worker.step_samples()}

    def record_routing_stats(self) -> dict[str, float]:
        """The worker's load; a worker whose engine stopped reports none to give (no
        free block, an endless prompt queue), so that no request is routed to it
        while Serve's health checks take their time to replace it."""
        try:
            self.worker.check_health()
        except Exception:  # noqa: BLE001 - stopped, for whatever reason
            return {"free_kv_blocks": 0.0, "queued_prefill_tokens": 1e18, "engine_stopped": 1.0}
        return self.worker.stats()

    def check_health(self) -> None:
        """Serve's health probe: a replica whose engine stopped is replaced."""
        self.worker.check_health()

    def __del__(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
