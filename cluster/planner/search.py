"""DistServe's placement search, on pdserve's simulator.

Candidates within the GPU budget, each replica sized by the memory planner:
- colocated: R replicas of TP t (R * t <= GPUs);
- disaggregated: P prefill replicas of TP tp and D decode replicas of TP td
  (P * tp + D * td <= GPUs).
For each, the highest request rate at which at least `attainment` of the
requests meet both SLOs is found by bisection on simulated runs of the
workload (Poisson arrivals, a fixed seed), and divided by the GPUs the
candidate uses: goodput per GPU. A candidate that does not fit memory is
never returned.

Two passes. Every candidate is screened on the workload's own number of
requests. A short run starts with empty queues and ends before a slowly
growing queue pushes TTFT past its SLO, so it overstates what a candidate
sustains, by more than the gap between close candidates: on Llama-3-70B chat
at 8 x H100, 500 requests put colocated 2 x TP4 at 12.2-12.3 req/s, 4,000 at
11.3-11.4. So the leaders of each mode are then refined: their rate found
again on 2x, 4x, ... the requests until three successive estimates agree
within a tolerance (`sustained_max_rate`), and a mode's best is always a
refined figure.
"""

from __future__ import annotations

import random
import signal
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import repeat
from typing import Callable

from cluster.perf_model.step_shape import StepTimeModel
from cluster.simulator.cluster_sim import ClusterSpec, ReplicaSpec, simulate
from cluster.simulator.from_config import NVLINK_KV_LATENCY_S, handoff_bandwidth


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    num_requests: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1 or self.num_requests < 1:
            raise ValueError("the input and output lengths and the number of requests must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")

    def bounds(self, n: int) -> tuple[int, int]:
        """The lengths drawn around `n` (inclusive)."""
        return max(1, int(n * (1 - self.range_ratio))), max(1, int(n * (1 + self.range_ratio)))

    @property
    def longest(self) -> int:
        """The most tokens (prompt + output) one request may have."""
        return self.bounds(self.input_len)[1] + self.bounds(self.output_len)[1]

    def lengths(self) -> list[tuple[int, int]]:
        rng = random.Random(self.seed)
        return [(rng.randint(*self.bounds(self.input_len)), rng.randint(*self.bounds(self.output_len)))
                for _ in range(self.num_requests)]


@dataclass(frozen=True)
class Candidate:
    mode: str                  # "colocated" | "disaggregated"
    prefill_replicas: int
    prefill_tp: int
    decode_replicas: int       # colocated: the replicas
    decode_tp: int

    @property
    def gpus(self) -> int:
        return self.prefill_replicas * self.prefill_tp + self.decode_replicas * self.decode_tp

    def describe(self) -> str:
        if self.mode == "colocated":
            return f"colocated {self.decode_replicas} x TP{self.decode_tp}"
        return (f"disaggregated {self.prefill_replicas} x TP{self.prefill_tp} prefill + "
                f"{self.decode_replicas} x TP{self.decode_tp} decode")


@dataclass(frozen=True)
class RateEstimate:
    """The highest rate meeting the attainment target on a run of `num_requests`."""
    num_requests: int
    rate: float                          # req/s
    attainment: float                    # at that rate


@dataclass
class Evaluated:
    candidate: Candidate
    max_rate: float                      # req/s at >= the attainment target
    attainment_at_max: float
    kv_blocks: dict[str, int]
    refined: list[RateEstimate] = field(default_factory=list)   # sustained_max_rate's estimates; [] if screened only
    settled: bool = False                # refined, and its last three estimates agree within the tolerance

    @property
    def goodput_per_gpu(self) -> float:
        return self.max_rate / self.candidate.gpus

    @property
    def num_requests(self) -> int | None:
        """Requests of the run the rate comes from (None: screened only)."""
        return self.refined[-1].num_requests if self.refined else None


@dataclass
class PlanResult:
    evaluated: list[Evaluated] = field(default_factory=list)
    skipped: list[tuple[Candidate, str]] = field(default_factory=list)   # and why

    def best(self, mode: str | None = None) -> Evaluated | None:
        pool = [e for e in self.evaluated if mode is None or e.candidate.mode == mode]
        return max(pool, key=lambda e: (e.goodput_per_gpu, -e.candidate.gpus), default=None)


def candidates(num_gpus: int, tps: list[int]) -> list[Candidate]:
    out = [Candidate("colocated", 0, 0, num_gpus // t, t) for t in tps if t <= num_gpus]
    for tp in tps:
        for td in tps:
            for p in range(1, num_gpus // tp + 1):
                for d in range(1, (num_gpus - p * tp) // td + 1):
                    out.append(Candidate("disaggregated", p, tp, d, td))
    return out


def attainment(spec: ClusterSpec, workload: Workload, lengths, rate: float, slos_s: dict[str, float]) -> float:
    """Fraction of the workload's requests meeting every SLO at Poisson `rate`."""
    from bench.loadtest.arrivals import arrival_offsets
    from bench.loadtest.metrics import meets_slos
    result = simulate(spec, lengths, arrival_offsets(len(lengths), rate, 1.0, workload.seed))
    slos_ms = {name: seconds * 1000.0 for name, seconds in slos_s.items()}
    return sum(meets_slos(record, slos_ms) for record in result.records()) / len(lengths)


RATE_CAP = 1e5   # requests/s past which the search stops doubling
RATE_FLOOR = 1e-4   # requests/s: a configuration that misses the SLOs even here serves nothing within them


def max_rate(spec: ClusterSpec, workload: Workload, slos_s: dict[str, float], target: float = 0.9,
             iterations: int = 7, near: float | None = None) -> tuple[float, float]:
    """(highest rate found with attainment >= target, its attainment); 0 when even a
    trickle misses the SLOs. `near`: a previous estimate to bracket first (from
    0.85x to 1.05x of it, widened while it does not hold the answer), which
    saves the doubling from a trickle."""
    lengths = workload.lengths()

    def holds(rate: float) -> tuple[bool, float]:
        att = attainment(spec, workload, lengths, rate, slos_s)
        return att >= target, att

    if near is not None and near > 0:
        return _bisect_near(holds, near, iterations)
    probe = 0.05
    ok, low_att = holds(probe)
    if not ok:      # a slow configuration (long contexts, few KV blocks), or one that serves nothing
        if not holds(RATE_FLOOR)[0]:
            return 0.0, 0.0
        while not ok:                            # halve until the SLOs hold, then narrow
            probe /= 2
            ok, low_att = holds(probe)
        return _bisect(holds, probe, low_att, 2 * probe, iterations)
    low, high = probe, 2 * probe
    while True:                                  # double until the SLOs break
        ok, att = holds(high)
        if not ok:
            break
        low, low_att = high, att
        high *= 2
        if high > RATE_CAP:
            return low, low_att                  # a lower bound: see unbounded()
    return _bisect(holds, low, low_att, high, iterations)


def unbounded(rate: float) -> bool:
    """Whether `rate` is where the search stopped doubling, not a rate the SLOs broke
    above: the workload never missed them (e.g. outputs of one token against a
    TPOT SLO), so the configuration sustains at least that much."""
    return rate > RATE_CAP / 2


def _bisect_near(holds, near: float, iterations: int) -> tuple[float, float]:
    """Brackets the answer around a previous estimate `near`, then narrows it."""
    low, high = 0.85 * near, 1.05 * near
    ok, low_att = holds(low)
    while not ok:                                # the answer is lower still
        high, low = low, low * 0.7
        if low < RATE_FLOOR:
            return 0.0, 0.0
        ok, low_att = holds(low)
    while high < RATE_CAP:                       # the answer may be higher still
        ok, att = holds(high)
        if not ok:
            break
        low, low_att, high = high, att, high * 1.3
    return _bisect(holds, low, low_att, high, iterations)


def _bisect(holds, low: float, low_att: float, high: float, iterations: int) -> tuple[float, float]:
    """Narrows [low (holds), high (does not)] `iterations` times."""
    for _ in range(iterations):
        mid = (low + high) / 2
        ok, att = holds(mid)
        if ok:
            low, low_att = mid, att
        else:
            high = mid
    return low, low_att


def sustained_max_rate(spec: ClusterSpec, workload: Workload, slos_s: dict[str, float], target: float = 0.9, *,
                       tolerance: float = 0.03, max_requests: int = 8000,
                       first: RateEstimate | None = None) -> list[RateEstimate]:
    """`max_rate` on the workload, then on 2x, 4x, ... its requests (the same
    lengths and arrivals, extended), until the last three estimates are within
    `tolerance` of each other (relative to the highest) or the next run would
    pass `max_requests`. Returns every estimate; the last is the answer.
    `first`: the estimate at the workload's own size, if already known."""
    if first is None:
        rate, att = max_rate(spec, workload, slos_s, target)
        first = RateEstimate(workload.num_requests, rate, att)
    estimates = [first]
    while estimates[-1].rate > 0 and not _agree(estimates[-3:], tolerance):
        n = estimates[-1].num_requests * 2
        if n > max_requests:
            break
        rate, att = max_rate(spec, replace(workload, num_requests=n), slos_s, target,
                             iterations=5, near=estimates[-1].rate)
        estimates.append(RateEstimate(n, rate, att))
    return estimates


def _agree(estimates: list[RateEstimate], tolerance: float) -> bool:
    rates = [e.rate for e in estimates]
    return len(rates) == 3 and max(rates) - min(rates) <= tolerance * max(rates)


def search(*, num_gpus: int, tps: list[int], workload: Workload, slos_s: dict[str, float],
           build_spec: Callable[[Candidate], tuple[ClusterSpec | None, str]], target: float = 0.9,
           refine_top: int = 2, tolerance: float = 0.03, max_requests: int = 8000, jobs: int = 1,
           progress: Callable[[str], None] | None = None) -> PlanResult:
    """Evaluates every candidate `build_spec` can place (it returns (None, why)
    for one that does not fit memory) on the workload, then refines the
    `refine_top` best of each mode with `sustained_max_rate`, and any other
    that a refinement leaves on top of its mode, so each mode's best is a
    refined figure (`refine_top` 0 or `max_requests` < 2x the workload's
    requests: screening only). `jobs` > 1 simulates that many candidates at
    once, in worker processes."""
    result = PlanResult()
    specs: dict[Candidate, ClusterSpec] = {}
    for cand in candidates(num_gpus, tps):
        spec, why = build_spec(cand)
        if spec is None:
            result.skipped.append((cand, why))
        else:
            specs[cand] = spec
    with _pool(jobs) as pool:
        screened = pool.map(max_rate, specs.values(), repeat(workload), repeat(slos_s), repeat(target))
        for (cand, spec), (rate, att) in zip(specs.items(), screened):
            blocks = {"decode": spec.decode.num_kv_blocks}
            if spec.prefill is not None:
                blocks["prefill"] = spec.prefill.num_kv_blocks
            result.evaluated.append(Evaluated(cand, rate, att, blocks))
            if progress:
                progress(f"{cand.describe()}: {rate:.2f} req/s ({rate / cand.gpus:.3f} per GPU)")
        if refine_top <= 0 or max_requests < 2 * workload.num_requests:
            return result

        def refine(batch: list[Evaluated]) -> None:
            runs = pool.map(partial(_refine_one, tolerance=tolerance, max_requests=max_requests),
                            [specs[e.candidate] for e in batch], repeat(workload), repeat(slos_s), repeat(target),
                            [RateEstimate(workload.num_requests, e.max_rate, e.attainment_at_max) for e in batch])
            for e, estimates in zip(batch, runs):
                e.refined, e.settled = estimates, _agree(estimates[-3:], tolerance)
                e.max_rate, e.attainment_at_max = estimates[-1].rate, estimates[-1].attainment
                if progress:
                    steps = ", ".join(f"{r.rate:.2f} at {r.num_requests}" for r in estimates)
                    progress(f"{e.candidate.describe()} refined: {steps} requests")

        leaders = []
        for mode in ("colocated", "disaggregated"):
            ranked = sorted((e for e in result.evaluated if e.candidate.mode == mode and e.max_rate > 0),
                            key=lambda e: -e.goodput_per_gpu)
            leaders += ranked[:refine_top]      # a candidate that meets the SLOs at no rate stays as screened
        if progress and leaders:
            progress(f"refining {len(leaders)} leaders on 2x, 4x, ... the requests (at most {max_requests} each)")
        refine(leaders)
        while overtaken := [b for mode in ("colocated", "disaggregated")
                            if (b := result.best(mode)) is not None and not b.refined and b.max_rate > 0]:
            refine(overtaken)
    return result


def _refine_one(spec: ClusterSpec, workload: Workload, slos_s: dict[str, float], target: float,
                first: RateEstimate, *, tolerance: float, max_requests: int) -> list[RateEstimate]:
    """sustained_max_rate with `first` by position (for a pool's map)."""
    return sustained_max_rate(spec, workload, slos_s, target, tolerance=tolerance, max_requests=max_requests,
                              first=first)


class _InProcess:
    """`map` in this process (jobs == 1: no worker start-up, and tests can patch the functions)."""

    def __enter__(self) -> "_InProcess":
        return self

    def __exit__(self, *exc) -> None:
        return None

    @staticmethod
    def map(fn, *iterables):
        return list(map(fn, *iterables))


def ignore_interrupts() -> None:
    """A pool worker's initializer: Ctrl-C is the parent's to act on (it stops the
    search); a worker that took it too printed a KeyboardInterrupt traceback each."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Pool(ProcessPoolExecutor):
    def __exit__(self, exc_type, *rest) -> bool:
        # interrupted or failed: the candidates still queued are dropped, not simulated first
        self.shutdown(wait=exc_type is None, cancel_futures=exc_type is not None)
        return False


def _pool(jobs: int):
    return _Pool(max_workers=jobs, initializer=ignore_interrupts) if jobs > 1 else _InProcess()


def roofline_spec_builder(model_config, *, gpu: str, dtype: str, max_model_len: int, block_size: int = 16,
                          max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                          gpu_memory_utilization: float = 0.9, policy: str = "always",
                          kv_latency_s: float = NVLINK_KV_LATENCY_S,
                          models: dict[int, StepTimeModel] | None = None, gpu_memory_gib: float | None = None,
                          overhead_gib: float = 1.0, kv_transfer_staging_gib: float = 1.0,
                          admission=None) -> Callable[[Candidate], tuple[ClusterSpec | None, str]]:
    """Builds ClusterSpecs for candidates: KV capacity from the memory planner
    (GPUs of `gpu_memory_gib`, default the GPU type's; prefill and decode
    replicas leave `kv_transfer_staging_gib` more free for hand-off buffers,
    as the engines do: kv_transfer.staging_mib), step times from
    `models[tp]` when given (a profile), else the roofline; hand-offs over
    NVLink (the network between nodes, where a prefill and a decode replica
    cannot share one) as `pdserve simulate` prices them
    (simulator.from_config.handoff_bandwidth);
    the router's 400 past `max_model_len`, and its admission control as
    `admission` (router.admission.AdmissionSettings; None: every request admitted)."""
    from cluster.perf_model.roofline import GPU_SPECS, RooflineStepModel
    from engine.memory_planner import kv_bytes_per_token, plan

    gpu_spec = GPU_SPECS[gpu]
    cache: dict[tuple[int, bool], tuple[ReplicaSpec | None, str]] = {}

    def replica(tp: int, hands_off: bool) -> tuple[ReplicaSpec | None, str]:
        key = (tp, hands_off)
        if key not in cache:
            memory_gib = gpu_spec.memory_gib if gpu_memory_gib is None else gpu_memory_gib
            p = plan(model_config, tp=tp, gpu_memory_gib=memory_gib,
                     gpu_memory_utilization=gpu_memory_utilization, dtype=dtype, max_model_len=max_model_len,
                     gpu_type=gpu, block_size=block_size, overhead_gib=overhead_gib,
                     kv_transfer_staging_gib=kv_transfer_staging_gib if hands_off else 0.0)
            if not p.fits:
                cache[key] = (None, "; ".join(p.problems) or "does not fit")
            elif models is not None and tp not in models:
                cache[key] = (None, f"the profile has no TP {tp}")
            else:
                model = models[tp] if models is not None else RooflineStepModel.for_model(
                    model_config, gpu=gpu, tp=tp, dtype=dtype)
                cache[key] = (ReplicaSpec(model, p.kv_tokens_capacity // block_size, block_size, max_num_seqs,
                                          max_num_batched_tokens), "")
        return cache[key]

    kv_per_token = kv_bytes_per_token(model_config, 1, dtype)

    def build(cand: Candidate) -> tuple[ClusterSpec | None, str]:
        hands_off = cand.mode != "colocated"
        decode, why = replica(cand.decode_tp, hands_off)
        if decode is None:
            return None, f"TP {cand.decode_tp}: {why}"
        if cand.mode == "colocated":
            return ClusterSpec("colocated", decode=decode, decode_replicas=cand.decode_replicas,
                               max_model_len=max_model_len, admission=admission), ""
        prefill, why = replica(cand.prefill_tp, True)
        if prefill is None:
            return None, f"TP {cand.prefill_tp}: {why}"
        return ClusterSpec("disaggregated", prefill=prefill, decode=decode, prefill_replicas=cand.prefill_replicas,
                           decode_replicas=cand.decode_replicas, policy=policy, kv_bytes_per_token=kv_per_token,
                           kv_bandwidth_bytes_per_s=handoff_bandwidth(gpu, cand.prefill_tp, cand.decode_tp),
                           kv_latency_s=kv_latency_s, max_model_len=max_model_len, admission=admission), ""
    return build
