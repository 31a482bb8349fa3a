"""Prometheus metrics of the serving path, in a registry each `ServingMetrics` owns.

Contracts:
- Every metric lives in `ServingMetrics.registry`, never in prometheus_client's
  global default registry, so several apps (or tests) in one process never
  collide and `render()` shows exactly this app's series.
- `observe_request` is called once per request that reached the backend, when it
  ends (finished, aborted by a client disconnect, or failed); `observe_error` once
  per error response.
- `set_worker_stats` overwrites the gauges of one worker (label e.g. "prefill-0",
  "decode-1") and the counters of its running counts (exported as counters, so
  that `rate()` and `increase()` read them right; a replaced worker's count
  starts again under its own label); `remove_worker` drops them when the worker
  goes away.
"""

from __future__ import annotations

import math

from collections.abc import Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.timings import RequestTimings

# Buckets span what LLM serving sees: tens of ms for a short prefill on a GPU up
# to tens of seconds under overload (TTFT); 1 ms (a small model on a GPU) to seconds per
# decode step (TPOT).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
               90.0, 120.0, 180.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
# A pair-group hand-off of a few MiB takes milliseconds; 1 GiB+ (long 70B prompts) seconds.
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TRANSFER_BYTES_BUCKETS = tuple(float(4 ** k) for k in range(8, 18))  # 64 KiB .. 16 GiB
# Tokens per request, 1-2-5 steps (as vLLM's request_prompt_tokens): 1 .. 1M.
TOKEN_COUNT_BUCKETS = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5))[:-2]

# Worker stats key (as the workers' stats() report them) -> the gauge it sets.
WORKER_GAUGES = (
    ("num_running", "pdserve_num_requests_running", "Requests a worker is running."),
    ("num_waiting", "pdserve_num_requests_waiting", "Requests queued on a worker."),
    ("kv_cache_usage", "pdserve_kv_cache_usage_ratio", "Fraction of a worker's KV cache blocks in use."),
    ("torch_threads", "pdserve_worker_torch_threads", "Torch threads each rank of a worker owns (its bundle's CPUs)."),
    ("cpu_cores_borrowed", "pdserve_worker_cpu_cores_borrowed",
     "CPU cores a worker borrows from idle engines on its machine for its current step."),
    ("num_held", "pdserve_worker_kv_holds", "Requests whose KV a prefill worker holds for a decode worker."),
    ("num_receiving", "pdserve_worker_kv_receiving", "Hand-offs whose KV a decode worker is receiving."),
    ("kv_staging_bytes", "pdserve_worker_kv_staging_bytes",
     "Bytes of KV hand-off buffers in flight per rank: receive buffers a decode worker posted, packed copies "
     "a prefill worker sends (kv_transfer.staging_mib)."),
    ("prefill_s_per_token", "pdserve_worker_prefill_seconds_per_token",
     "A worker's measured prefill cost per prompt token (its last 16 prefill steps' time over their tokens)."),
)


class ServingMetrics:
    """The router's request metrics and the workers' load gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._ttft = Histogram("pdserve_time_to_first_token_seconds",
                               "Arrival at the router to the first output token.",
                               buckets=TTFT_BUCKETS, registry=r)
        self._tpot = Histogram("pdserve_time_per_output_token_seconds",
                               "Mean time per output token after the first, per request.",
                               buckets=TPOT_BUCKETS, registry=r)
        self._e2e = Histogram("pdserve_e2e_request_latency_seconds",
                              "Arrival at the router to the last output token.",
                              buckets=E2E_BUCKETS, registry=r)
        self._queue = Histogram("pdserve_request_queue_time_seconds",
                                "Time waiting on the prefill side before being scheduled.",
                                buckets=QUEUE_BUCKETS, registry=r)
        self._prefill = Histogram("pdserve_request_prefill_time_seconds",
                                  "First scheduled to first token sampled, on the prefill side.",
                                  buckets=PREFILL_BUCKETS, registry=r)
        self._reserve = Histogram("pdserve_kv_reserve_time_seconds",
                                  "A decode worker's wait for free KV blocks before a hand-off's transfer.",
                                  buckets=QUEUE_BUCKETS, registry=r)
        self._transfer = Histogram("pdserve_kv_transfer_time_seconds",
                                   "KV cache hand-off from a prefill to a decode worker.",
                                   buckets=TRANSFER_BUCKETS, registry=r)
        self._transfer_bytes = Histogram("pdserve_kv_transfer_bytes",
                                         "KV cache bytes moved per hand-off.",
                                         buckets=TRANSFER_BYTES_BUCKETS, registry=r)
        self._prompt_lengths = Histogram("pdserve_request_prompt_tokens", "Prompt tokens per request that got "
                                         "its first token.", buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self._output_lengths = Histogram("pdserve_request_generation_tokens", "Output tokens per request that ran "
                                         "to completion (stop or length).", buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self._requests = Counter("pdserve_requests_total", "Requests that ended, by finish reason.",
                                 ["finish_reason"], registry=r)
        self._prompt_tokens = Counter("pdserve_prompt_tokens_total", "Prompt tokens of the requests that got "
                                      "their first token (counted when the request ends).", registry=r)
        self._generation_tokens = Counter("pdserve_generation_tokens_total",
                                          "Output tokens generated.", registry=r)
        self._prefills = Counter("pdserve_prefills_total", "Prompts prefilled, by the role of the worker "
                                 "that ran them (decode: conditional disaggregation or colocated).",
                                 ["worker_role"], registry=r)
        self._errors = Counter("pdserve_request_errors_total", "Error responses, by HTTP status.",
                               ["status"], registry=r)
        self._migrations = Counter("pdserve_request_migrations_total", "Times a request was continued on "
                                   "another worker after its worker failed.", registry=r)
        self._rejected = Counter("pdserve_requests_rejected_total", "Requests refused by admission control "
                                 "(HTTP 429), by reason: queue_requests, queue_tokens, ttft_slo, overload, tpot_slo.", ["reason"],
                                 registry=r)
        self._worker_gauges = {key: Gauge(name, doc, ["worker"], registry=r)
                               for key, name, doc in WORKER_GAUGES}
        self._worker_counts = _WorkerCounts()
        r.register(self._worker_counts)
        self._router_queue = _RouterQueue()
        r.register(self._router_queue)
        self._autoscaler_target = Gauge("pdserve_autoscaler_target_replicas",
                                        "Replicas the autoscaler asks for, per role.", ["role"], registry=r)
        self._autoscaler_current = Gauge("pdserve_autoscaler_current_replicas",
                                         "Replicas serving, per role, at the autoscaler's last decision.",
                                         ["role"], registry=r)
        self._autoscaler_latency = Gauge("pdserve_autoscaler_latency_seconds",
                                         "TTFT and TPOT the autoscaler predicted for its targets (mean) and "
                                         "observed over its last interval (p90).", ["metric", "source"],
                                         registry=r)
        self._listeners: list = []

    def add_listener(self, listener) -> None:
        """`listener.on_arrival(prompt_tokens, max_tokens)` for every request offered
        (taken by the backend, or refused by admission control: then prompt_tokens
        may be None), `listener.on_refusal(reason)` for every one admission control refuses,
        `listener.on_request(timings)` for every one that ends."""
        self._listeners.append(listener)

    def watch_admission(self, admission) -> None:
        """Exports the router's own queue from `admission` (router/admission.py's
        AdmissionControl, read at each scrape); without one (admission control off) the
        router keeps no queue counts and these series are absent."""
        self._router_queue.admission = admission

    def observe_arrival(self, prompt_tokens: int | None, max_tokens: int | None = None) -> None:
        """A request offered; `max_tokens`: the most it may generate (None: not known)."""
        for listener in self._listeners:
            listener.on_arrival(prompt_tokens, max_tokens)

    def set_autoscaler(self, targets: Mapping[str, int], current: Mapping[str, int],
                       latency: Mapping[tuple[str, str], float | None]) -> None:
        """The autoscaler's last decision; latency: (metric, source) -> seconds (None,
        or NaN: not known this interval, exported as NaN rather than an old value; inf: the
        targets cannot hold the load, exported as +Inf)."""
        for role, n in targets.items():
            self._autoscaler_target.labels(role=role).set(n)
        for role, n in current.items():
            self._autoscaler_current.labels(role=role).set(n)
        for (metric, source), value in latency.items():
            known = value is not None and not math.isnan(value)
            self._autoscaler_latency.labels(metric=metric, source=source).set(value if known else math.nan)

    def observe_request(self, timings: RequestTimings) -> None:
        """Record one ended request; phases it never reached are skipped, and
        TPOT and e2e latency only count requests that ran to completion (its
        TTFT went in at its first token: observe_first_token)."""
        for listener in self._listeners:
            listener.on_request(timings)
        self._requests.labels(finish_reason=timings.finish_reason or "error").inc()
        if timings.first_token_time is not None:     # (a 503, or a client gone while queued: no prompt ran)
            self._prompt_tokens.inc(timings.prompt_tokens)
            self._prompt_lengths.observe(timings.prompt_tokens)
        self._generation_tokens.inc(timings.generation_tokens)
        # An aborted or failed request's "end" is when it was cut off, not a latency.
        self._migrations.inc(timings.phases.migrations)
        if timings.phases.prefilled_on is not None:
            self._prefills.labels(worker_role=timings.phases.prefilled_on).inc()
        completed = timings.finish_reason in ("stop", "length")
        for histogram, value in (
            (self._tpot, timings.time_per_output_token if completed else None),
            (self._e2e, timings.e2e_latency if completed else None),
            (self._output_lengths, timings.generation_tokens if completed else None),
            (self._queue, timings.phases.queue_time),
            (self._prefill, timings.phases.prefill_time),
            (self._reserve, timings.phases.reserve_time),
            (self._transfer, timings.phases.transfer_time),
            (self._transfer_bytes, timings.phases.transfer_bytes),
        ):
            if value is not None:
                histogram.observe(value)

    def observe_first_token(self, seconds: float) -> None:
        """A request's time to first token, as its first token comes (not when it ends:
        a long stream's would show up a whole stream late)."""
        self._ttft.observe(seconds)

    def observe_rejection(self, reason: str, offered: bool = True) -> None:
        """A request refused for `reason`; a client's retry (`offered` False) counts in the
        metric but not for the listeners, which counted it when it was first offered."""
        self._rejected.labels(reason=reason).inc()
        if offered:
            for listener in self._listeners:
                listener.on_refusal(reason)

    def observe_error(self, status: int) -> None:
        self._errors.labels(status=str(status)).inc()

    def set_worker_stats(self, worker: str, stats: Mapping[str, float]) -> None:
        """Set `worker`'s gauges from a worker's stats() dict: the keys in WORKER_GAUGES
        set their gauge, a missing one keeps its value, other keys are not exported."""
        for key, gauge in self._worker_gauges.items():
            if key in stats:
                gauge.labels(worker=worker).set(stats[key])
        self._worker_counts.set(worker, stats)

    def remove_worker(self, worker: str) -> None:
        """Drop `worker`'s gauge and counter series (a removed worker must not report stale load)."""
        for gauge in self._worker_gauges.values():
            try:
                gauge.remove(worker)
            except KeyError:
                pass  # this worker never reported that stat
        self._worker_counts.remove(worker)

    def render(self) -> tuple[bytes, str]:
        """(payload, content type) in the Prometheus text exposition format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# Worker stats key holding a running count since the worker started -> the counter it is
# exported as (prometheus_client adds "_total").
WORKER_COUNTERS = (
    ("num_preemptions", "pdserve_worker_preemptions",
     "Sequences a worker's engine preempted (to recompute later) for lack of KV blocks, since it started."),
    ("cpu_borrowed_steps", "pdserve_worker_cpu_borrowed_steps",
     "Engine steps a worker has run with cores borrowed from idle engines, since it started."),
    ("prefix_cache_queried_tokens", "pdserve_worker_prefix_cache_queries",
     "Prompt tokens a worker looked up in its prefix cache (prompts it prefilled with prefix caching on), "
     "since it started."),
    ("prefix_cache_hit_tokens", "pdserve_worker_prefix_cache_hits",
     "Of the prompt tokens a worker looked up in its prefix cache, those it found there, since it started."),
)


class _WorkerCounts:
    """The workers' running counts, exported as counters with the values they report
    (a Counter object can only be incremented; these are counted in the workers)."""

    def __init__(self) -> None:
        self._values: dict[str, dict[str, float]] = {}   # stats key -> worker -> its count

    def set(self, worker: str, stats: Mapping[str, float]) -> None:
        for key, _, _ in WORKER_COUNTERS:
            if key in stats:
                self._values.setdefault(key, {})[worker] = float(stats[key])

    def remove(self, worker: str) -> None:
        for values in self._values.values():
            values.pop(worker, None)

    def collect(self):
        for key, name, doc in WORKER_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["worker"])
            for worker, value in sorted(self._values.get(key, {}).items()):
                family.add_metric([worker], value)
            yield family


# AdmissionControl attribute -> the gauge it is exported as, read at each scrape.
ROUTER_QUEUE_GAUGES = (
    ("waiting_requests", "pdserve_router_requests_waiting",
     "Requests the router admitted that wait for their first token."),
    ("waiting_tokens", "pdserve_router_prompt_tokens_waiting", "Prompt tokens of the requests waiting."),
    ("running", "pdserve_router_requests_running", "Requests the router admitted that have not ended."),
)


class _RouterQueue:
    """The router's admission counts as gauges, while admission control is on."""

    def __init__(self) -> None:
        self.admission = None

    def collect(self):
        if self.admission is None:
            return
        for attribute, name, doc in ROUTER_QUEUE_GAUGES:
            yield GaugeMetricFamily(name, doc, value=float(getattr(self.admission, attribute)))
