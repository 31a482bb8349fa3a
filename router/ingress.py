"""Router: the Ray Serve ingress deployment. It serves the OpenAI API
(router/openai_api.py) over a ServingBackend whose pools are the worker
deployments' handles, and once a second asks every worker replica for its
stats: they feed /metrics and the disaggregation policy's cost estimates.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError

from cluster.autoscaler.capacity import ReplicaLimits
from cluster.autoscaler.policy import AutoscaleSettings
from cluster.perf_model.step_shape import load_step_model
from cluster.serving.process_priority import normal_priority
from cluster.serving.replica_logging import use_serve_handlers
from engine.tiny_model import ensure_built_in_checkpoint
from engine.tokenizer import load_tokenizer
from router.admission import AdmissionSettings, admission_for
from router.autoscale_loop import AutoscaleLoop
from router.backend import ModelInfo
from router.cors import CorsSettings
from router.disaggregation_policy import DisaggregationPolicy, DisaggregationSettings
from router.metrics import ServingMetrics
from router.openai_api import RequestLimits, build_openai_app
from router.serve_pools import ServeDecodePool, ServePrefillPool, replica_answers
from router.serving_backend import ServingBackend

log = logging.getLogger(__name__)

STATS_PERIOD_S = 1.0
STATS_TIMEOUT_S = 5.0


@serve.deployment(name="Router")
@serve.ingress()
class Router:
    def __init__(self, info: ModelInfo, tokenizer_path: str, mode: str, *, prefill=None, decode=None,
                 colocated=None, disaggregation: DisaggregationSettings | None = None,
                 autoscaling: AutoscaleSettings | None = None, autoscaling_profile: dict | None = None,
                 autoscaling_deployed: dict[str, int] | None = None,
                 autoscaling_limits: ReplicaLimits = ReplicaLimits(),
                 limits: RequestLimits = RequestLimits(), api_key_sha256: str | None = None,
                 protect_metrics: bool = True, admission: AdmissionSettings | None = None,
                 max_migrations: int = 3, stream_interval_s: float = 0.0, cors: CorsSettings | None = None):
        use_serve_handlers()
        normal_priority()
        ensure_built_in_checkpoint(tokenizer_path)    # a built-in model resolved on another node
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.metrics = ServingMetrics()
        replica = serve.get_replica_context().replica_id.unique_id
        subscriber = f"router-{replica}-{uuid.uuid4().hex[:8]}"
        self.policy = None
        if mode == "colocated":
            self.backend = ServingBackend(info, ServeDecodePool(colocated, "colocated", stream_interval_s),
                                          subscriber=subscriber, max_migrations=max_migrations)
            self._workers = {"colocated": colocated}
        else:
            self.policy = DisaggregationPolicy(disaggregation or DisaggregationSettings())
            self.backend = ServingBackend(info, ServeDecodePool(decode, "decode", stream_interval_s),
                                          ServePrefillPool(prefill), self.policy,
                                          subscriber=subscriber, max_migrations=max_migrations)
            self._workers = {"prefill": prefill, "decode": decode}
        self.admission = admission_for(admission, mode, self.policy)
        self._http = {"limits": limits, "api_key_sha256": api_key_sha256, "protect_metrics": protect_metrics,
                      "admission": self.admission, "cors": cors}
        self.autoscaler = None
        if autoscaling is not None:
            profile = load_step_model(autoscaling_profile) if autoscaling_profile else None
            self.autoscaler = AutoscaleLoop(autoscaling, self._workers, self.metrics, profile=profile,
                                            deployed=autoscaling_deployed, limits=autoscaling_limits,
                                            running_output_tokens=self.backend.mean_running_output_tokens)
            self._autoscale_task = asyncio.get_event_loop().create_task(self.autoscaler.run())
        self._failed_passes: dict[str, int] = {}    # role -> stats passes in a row where every call failed
        self._stats_failing: set[str] = set()       # roles whose last stats pass raised
        self._running: dict[str, int] = {}          # role -> replicas serving at the last stats pass
        self._said_empty: set[str] = set()          # roles logged as having no worker serving
        self._stats_task = asyncio.get_event_loop().create_task(self._refresh_worker_stats())

    def record_autoscaling_stats(self) -> dict[str, float]:
        """For Serve's application autoscaling policy (cluster/autoscaler/serve_policy.py)."""
        return self.autoscaler.serve_targets() if self.autoscaler is not None else {}

    async def __del__(self):
        """Serve calls this when the replica stops: closing the output streams
        ends them on the decode replicas too, which would otherwise wait out their
        graceful-shutdown timeout for a subscriber that is gone."""
        if hasattr(self, "backend"):   # absent when __init__ failed
            self._stats_task.cancel()
            if getattr(self, "_autoscale_task", None) is not None:
                self._autoscale_task.cancel()
            await self.backend.close()

    def __serve_build_asgi_app__(self):
        return build_openai_app(self.backend, self.tokenizer, self.metrics, **self._http)

    async def _refresh_worker_stats(self) -> None:
        seen: set[str] = set()
        while True:
            try:
                seen = await self._refresh_worker_stats_once(seen)
            except Exception:  # noqa: BLE001 - one bad pass must not freeze every figure for good
                log.exception("refreshing the workers' stats failed; trying again")
            await asyncio.sleep(STATS_PERIOD_S)

    async def _refresh_role(self, role: str, handle, previous: set[str], current: set[str]) -> None:
        """One role's part of a stats pass: adds the series it keeps to `current` (`previous`: the
        role's series before)."""
        try:
            # bounded: one replica that does not answer must not stop every figure the router keeps
            replies, slow, failed = await replica_answers(handle, "stats", STATS_TIMEOUT_S)
        except DeploymentUnavailableError:   # not one replica runs (they died; none replaced yet)
            replies, slow, failed = [], 0, 0
        except Exception as exc:  # noqa: BLE001 - metrics must never take the router down
            # said once a run of failures: routing, admission and the autoscaler go on with old figures
            (log.debug if role in self._stats_failing else log.warning)(
                "no %s stats (routing, admission and autoscaling keep the last ones): %r", role, exc)
            self._stats_failing.add(role)
            current |= previous   # kept as they were
            return
        if role in self._stats_failing:
            self._stats_failing.discard(role)
            log.warning("%s stats come again", role)
        all_failed = not replies and not slow and failed
        self._failed_passes[role] = self._failed_passes.get(role, 0) + 1 if all_failed else 0
        if not replies and (slow or self._failed_passes[role] == 1):
            # none answered: replicas slow to answer, or failing once (Ray's "actor unavailable" on a
            # healthy one), are not a pool of none, which would send every waiting prompt elsewhere and
            # refuse new ones; their series are kept as they were. Replicas whose calls fail twice in a
            # row (their engines stopped) are a pool of none: their series go.
            current |= previous
            return
        replies = sorted(replies, key=lambda s: s.get("replica", ""))
        running = len(replies) + slow      # a replica too slow to answer this time still runs
        if not running and self._running.get(role):     # (none yet while the deployment starts: not news)
            log.warning("no %s worker serves: none answers its stats (routed around, or refused, until one does)",
                        role)
            self._said_empty.add(role)
        elif running and role in self._said_empty:
            log.warning("%s workers serving again: %d", role, running)
            self._said_empty.discard(role)
        self._running[role] = running
        if self.policy is not None:
            self.policy.observe_workers(role, replies, running)
        if self.admission is not None:
            self.admission.observe_workers(role, replies, running)
        if self.autoscaler is not None:
            self.autoscaler.observe_workers(role, replies)
        if slow:   # which replicas were slow is not known: none of the role's series is dropped
            current |= previous
        for i, stats in enumerate(replies):
            label = f"{role}-{stats.get('replica') or i}"     # the replica's own series, not a position
            current.add(label)
            self.metrics.set_worker_stats(label, {k: v for k, v in stats.items() if k != "replica"})

    async def _refresh_worker_stats_once(self, seen: set[str]) -> set[str]:
        """Asks every worker replica for its stats and hands them to /metrics, the policy, admission
        and the autoscaler. `seen`: the replica series /metrics kept before; returns those it keeps now
        (a replica that did not answer in time keeps its series as it was; one gone loses it)."""
        current: set[str] = set()
        for role, handle in self._workers.items():
            previous = {label for label in seen if label.startswith(f"{role}-")}
            try:
                await self._refresh_role(role, handle, previous, current)
            except Exception:  # noqa: BLE001 - one role's bad figure must not stop the others'
                log.exception("refreshing the %s workers' stats failed", role)
                current |= previous
        for gone in seen - current:
            self.metrics.remove_worker(gone)
        return current
