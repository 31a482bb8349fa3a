"""Router: the Ray Serve ingress deployment. It serves the OpenAI API
(router/openai_api.py) over a DisaggregatedBackend (or ColocatedBackend) whose
pools are the worker deployments' handles, and keeps the per-worker gauges in
/metrics fresh by asking every worker replica for its stats once a second.
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from engine.tokenizer import load_tokenizer
from router.backend import ModelInfo
from router.disaggregated_backend import ColocatedBackend, DisaggregatedBackend
from router.metrics import ServingMetrics
from router.openai_api import build_openai_app
from router.serve_pools import ServeColocatedPool, ServeDecodePool, ServePrefillPool

log = logging.getLogger(__name__)

STATS_PERIOD_S = 1.0


@serve.deployment(name="Router")
@serve.ingress()
class Router:
    def __init__(self, info: ModelInfo, tokenizer_path: str, mode: str, *, prefill=None, decode=None,
                 colocated=None):
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.metrics = ServingMetrics()
        if mode == "colocated":
            self.backend = ColocatedBackend(info, ServeColocatedPool(colocated))
            self._workers = {"colocated": colocated}
        else:
            self.backend = DisaggregatedBackend(info, ServePrefillPool(prefill), ServeDecodePool(decode))
            self._workers = {"prefill": prefill, "decode": decode}
        self._stats_task = asyncio.get_event_loop().create_task(self._refresh_worker_stats())

    def __serve_build_asgi_app__(self):
        return build_openai_app(self.backend, self.tokenizer, self.metrics)

    async def _refresh_worker_stats(self) -> None:
        seen: set[str] = set()
        while True:
            current: set[str] = set()
            for role, handle in self._workers.items():
                try:
                    replies = await handle.broadcast("stats").results_async()
                except Exception as exc:  # noqa: BLE001 - metrics must never take the router down
                    log.debug("no %s stats: %s", role, exc)
                    continue
                for i, stats in enumerate(sorted(replies, key=lambda s: s.get("replica", ""))):
                    label = f"{role}-{i}"
                    current.add(label)
                    self.metrics.set_worker_stats(label, {k: v for k, v in stats.items() if k != "replica"})
            for gone in seen - current:
                self.metrics.remove_worker(gone)
            seen = current
            await asyncio.sleep(STATS_PERIOD_S)
