"""The simulator against the live system, side by side, in one run.

For each deployment (colocated; 1 prefill + 1 decode; 1 prefill + 2 decode)
on the `bench` checkpoint, CPU:
1. profile the engine with the torch threads each of that deployment's ranks
   gets (`pdserve profile`'s code, in process);
2. start `pdserve serve --config` on a local cluster of this machine's size
   and correct the model online (cluster/perf_model/online.py) from two
   calibration loads, a trickle (1 req/s) and a busy one (0.7x the profile's
   simulated capacity on the machine's shared cores):
   - the live replicas' own engine steps (shapes and wall times, fetched from
     the workers) give, per role and load, how much slower a served step is
     than the profiled one (the mean ratio). It grows with load: the replicas share the
     machine's cores with each other, the router, the HTTP path and the load
     generator. The simulator's shared-cores model (cluster/simulator) is
     fitted to both: the cores the serving path takes per request streaming,
     and a per-role factor for the rest;
   - the busy load's KV hand-offs (the server's /metrics) give the link's
     latency: their mean time less the bytes at the modelled bandwidth;
   - from the trickle, the measured TPOT minus the simulated one is the
     serving path's cost between steps, added to every step; the TTFT left
     over after that is the cost per request (router, HTTP, the hand-off's
     messages), added to its token times;
3. find the corrected model's simulated capacity (the highest rate at >= 90%
   SLO attainment, sustained over 600 simulated requests) and pick three
   loads from it: light (0.3x), near capacity
   (0.9x), overloaded (1.5x);
4. run each load through the load generator (`pdserve loadtest`'s code) and
   simulate the same requests (same lengths, same arrival times),
   twice: with the model as calibrated before the loads, and online-corrected,
   the per-role factor refitted to the engine steps the live workers ran in
   that same load (what the autoscaler's online model sees while serving): the
   second separates the simulator's queueing, batching and hand-off model
   from the drift of the machine's speed between calibration and load;
5. print goodput, TTFT p50/p90 and TPOT p50/p90, simulated / measured, with
   the uncorrected (engine-only profile) prediction alongside, and how many
   figures each prediction has within the target.

    python bench/simulator_accuracy.py [--num-prompts 60] [--out bench/results/simulator_accuracy.json]

Target: each simulated figure within +-20% of the measured one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadtest.arrivals import arrival_offsets  # noqa: E402
from bench.loadtest.client import scrape_metrics  # noqa: E402
from bench.loadtest.datasets import random_dataset  # noqa: E402
from bench.loadtest.metrics import summarize  # noqa: E402
from bench.loadtest.report import build_result  # noqa: E402
from bench.loadtest.runner import RunConfig, RunResult, run_benchmark  # noqa: E402
from bench.serving_overhead import ServerFailed, served, served_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SLOS_MS = {"ttft": 1000.0, "tpot": 100.0}
DEPLOYMENTS = {
    "colocated": {"mode": "colocated", "colocated": {"replicas": 1}},
    "1P+1D": {"mode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 1},
              "disaggregation": {"policy": "always"}},
    "1P+2D": {"mode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 2},
              "disaggregation": {"policy": "always"}},
}
LOAD_FACTORS = {"light": 0.3, "near capacity": 0.9, "overloaded": 1.5}
REPEATED_LOAD = "near capacity"    # measured twice, with other prompts: how far the live system moves by itself
TOLERANCE = 0.2              # the target: each simulated figure within 20% of the measured one
FIGURES = ("request_goodput", "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms")
BUSY_CALIBRATION_LOAD = 0.7   # x the profile's simulated capacity: busy enough that the engine and the serving path contend for the cores
# Cores per request streaming tried by the fit. The router, HTTP proxy, Serve controller and Ray's
# daemons measured ~0.2 cores together (from /proc) at 2-8 req/s of this load, the client less:
# a few hundredths per stream, so 0.3 bounds it well above.
SERVING_CORES_GRID = [i * 0.01 for i in range(31)]
SUSTAINED_REQUESTS = 600      # requests a capacity search simulates (module doc: capacity)
TRICKLE_RATE = 1.0            # req/s: requests rarely overlap, so each one's times are its own steps'


def ranks(deployment: dict) -> int:
    return sum(deployment[role]["replicas"] for role in roles_of(deployment))


def profile_for(model_dir: str, threads: int, profiles: dict) -> None:
    """Profile the engine at `threads` torch threads (`pdserve profile`'s code, in
    process) into profiles[str(threads)], unless it is there."""
    from cluster.perf_model.profiler import ProfileGrid, run_profile
    if str(threads) in profiles:
        return
    started = time.monotonic()
    grid = ProfileGrid(prompt_lens=(16, 64, 256, 512), batch_sizes=(1, 4, 16), contexts=(64, 300),
                       chunk_len=64, decode_steps=4)
    data = run_profile(model_dir, device="cpu", grid=grid, engine_options={"cpu_threads": threads})
    profiles[str(threads)] = data
    err = data["fit_error"]
    print(f"  profile at {threads} thread(s): {len(data['points'])} steps, fit error mean "
          f"{err['mean_abs_rel']:.1%} max {err['max_abs_rel']:.1%} ({time.monotonic() - started:.0f} s)",
          flush=True)


def corrected(model, factor: float = 1.0, overhead_s: float = 0.0):
    """`model`'s step times x `factor`, plus a fixed per-step overhead (an online correction)."""
    from cluster.perf_model import OnlineCorrection
    return OnlineCorrection(model, factor=factor, overhead_s=overhead_s)


def roles_of(deployment: dict) -> tuple[str, ...]:
    return ("colocated",) if deployment["mode"] == "colocated" else ("prefill", "decode")


def take_live_steps(roles: tuple[str, ...]) -> dict[str, list]:
    """Per role, the engine steps its live replicas ran since the last call, as
    [prefill tokens, prefill attention, decode seqs, decode context, seconds,
    threads] (bench/worker_steps.py, in a process of its own)."""
    out = subprocess.run([sys.executable, str(REPO / "bench" / "worker_steps.py"), *roles], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise ServerFailed(f"fetching the workers' steps failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)


def handoff_totals(base_url: str) -> tuple[float, float, int]:
    """The server's KV hand-offs so far: (seconds, bytes, count), from GET /metrics."""
    m = scrape_metrics(base_url, timeout_s=30)
    return (m.get("pdserve_kv_transfer_time_seconds_sum", 0.0), m.get("pdserve_kv_transfer_bytes_sum", 0.0),
            int(m.get("pdserve_kv_transfer_time_seconds_count", 0)))


def measured_link(before: tuple, after: tuple):
    """The KV link as the live hand-offs between two handoff_totals: the modelled
    bandwidth, and a latency making up the rest of their mean time (the default
    link without hand-offs)."""
    from cluster.simulator.from_config import CPU_KV_BANDWIDTH, KVLink
    seconds, nbytes, count = (a - b for a, b in zip(after, before))
    if count <= 0:
        return KVLink()
    return KVLink(CPU_KV_BANDWIDTH, max(0.0, (seconds - nbytes / CPU_KV_BANDWIDTH) / count))


def step_factors(profiled, live: dict[str, list]) -> dict[str, float]:
    """Per role, the mean of measured / profiled time over its live steps (1.0
    without any); `profiled(shape, threads)` is a step's profiled time with the
    threads it ran with. The mean, as the workers' online correction keeps it
    (cluster/perf_model/online.py): a step that lost its core for a while is
    time every request in it waited, and a TPOT is the mean of its steps. A
    median left those steps out and under-predicted TPOT under load."""
    factors = {}
    for role, steps in live.items():
        ratios = []
        for shape, seconds, threads in steps:
            model_s = profiled(shape, threads)
            if model_s > 0:
                ratios.append(seconds / model_s)
        factors[role] = sum(ratios) / len(ratios) if ratios else 1.0
    return factors


def fit_contention(spec_with, trickle_run: tuple, busy_run: tuple, trickle_factors: dict,
                   busy_factors: dict) -> tuple[float, dict]:
    """The serving cores per request streaming, and per role the factor for the
    rest, with which the simulated calibration runs slow the steps down as the
    live ones did: factor x simulated stretch = the live factor, on the trickle
    exactly, on the busy run as closely as the grid of serving cores allows
    (least squares of the logs over roles)."""
    best = None
    for serving_cores in SERVING_CORES_GRID:
        per_role = factors_for_live_steps(lambda per: spec_with(per, serving_cores), trickle_factors, trickle_run,
                                          trickle_factors)
        stretch = mean_stretch(spec_with(per_role, serving_cores), *busy_run)
        error = sum(math.log(per_role[r] * stretch.get(r, 1.0) / f) ** 2 for r, f in busy_factors.items())
        if best is None or error < best[0]:
            best = (error, serving_cores, per_role)
    return best[1], best[2]


def factors_for_live_steps(spec_for, start: dict, run: tuple, live_factors: dict) -> dict:
    """Per role, the factor with which the simulated `run` slows its steps down
    as the live workers' steps in that run were slowed (factor x simulated
    stretch = live factor), starting from `start`; `spec_for(per_role)` builds
    the spec. On a load's own steps, this is the online correction."""
    per = dict(start)
    for _ in range(2):       # the factors change the steps' overlap, hence the stretch: settle them
        stretch = mean_stretch(spec_for(per), *run)
        per = {r: live_factors.get(r, per[r]) / stretch.get(r, 1.0) for r in per}
    return per


def mean_stretch(spec, lengths, rate: float, seed: int) -> dict[str, float]:
    """Per role, the simulated steps' mean of step time / the model's time."""
    return run_simulation(spec, lengths, rate, seed).mean_stretch


def figures(result: dict) -> dict:
    return {k: result.get(k) for k in (*FIGURES, "slo_attainment")}


def run_simulation(spec, lengths, rate: float, seed: int):
    """`lengths`: each request's (prompt, output) tokens; arrivals as the load generator's."""
    from cluster.simulator import simulate
    return simulate(spec, lengths, arrival_offsets(len(lengths), rate, 1.0, seed))


def simulated(spec, lengths, rate: float, seed: int) -> dict:
    sim = run_simulation(spec, lengths, rate, seed)
    records = sim.records()
    run = RunResult(RunConfig(base_url="simulated", model="bench", request_rate=rate, seed=seed), records,
                    len(lengths), 0.0, sim.duration, None)
    summary = summarize(records, num_requests=len(lengths), duration=sim.duration, slos_ms=SLOS_MS,
                        percentiles=(50, 90, 99))
    return figures(build_result(run, summary))


def measured(base_url: str, model: str, requests, rate: float, seed: int, tokenizer) -> dict:
    config = RunConfig(base_url=base_url, model=model, request_rate=rate, max_duration=300.0, request_timeout=120.0,
                       temperature=0.0, ignore_eos=True, seed=seed, disable_tqdm=True)
    run = asyncio.run(run_benchmark(requests, config, tokenizer=tokenizer))
    summary = summarize(run.records, num_requests=run.num_requests, duration=run.duration, slos_ms=SLOS_MS,
                        percentiles=(50, 90, 99))
    return figures(build_result(run, summary))


def capacity(spec, lengths, seed: int) -> float:
    """The simulated highest rate with >= 90% of requests meeting the SLOs, on
    these requests' lengths cycled to SUSTAINED_REQUESTS: over a short run a
    queue that grows slowly stays under the TTFT SLO, and the rate found would
    not be sustainable."""
    lengths = [lengths[i % len(lengths)] for i in range(max(len(lengths), SUSTAINED_REQUESTS))]
    low, high = 0.0, 0.25
    while _attains(spec, lengths, high, seed) and high < 1000:
        low, high = high, high * 2
    for _ in range(7):
        mid = (low + high) / 2
        low, high = (mid, high) if _attains(spec, lengths, mid, seed) else (low, mid)
    return max(low, 0.05)


def _attains(spec, lengths, rate: float, seed: int) -> bool:
    return (simulated(spec, lengths, rate, seed)["slo_attainment"] or 0.0) >= 0.9


@dataclass
class Calibration:
    """A deployment's simulator as corrected from its two calibration loads."""
    spec_with: Callable              # (per-role factor, serving cores, step s, request s) -> ClusterSpec
    raw_spec: object                 # the engine-only profile's ClusterSpec
    spec: object                     # the corrected one
    profiled: Callable               # (shape, threads) -> profiled seconds (profiled_step)
    per_role: dict[str, float]
    serving_cores: float
    step_s: float
    request_s: float
    live_factors: dict               # per calibration load, per role: served / profiled step
    busy_rate: float
    handoff_latency_s: float

    @property
    def summary(self) -> dict:
        """What was fitted, for the results file."""
        return {"busy_rate": self.busy_rate, "live_step_factor": self.live_factors,
                "serving_cores_per_stream": self.serving_cores, "step_factor": self.per_role,
                "handoff_latency_s": self.handoff_latency_s, "per_step_s": self.step_s,
                "per_request_s": self.request_s}


def profiled_step(base, wide, threads: int, cores: int) -> Callable:
    """`(shape, threads it ran with) -> profiled seconds`: the rank's own profile,
    or with cores borrowed (resources.lend_idle_cores) the lent-step model."""
    from cluster.simulator.cluster_sim import lent_step_time

    def profiled(shape, step_threads: int) -> float:
        if wide is None or step_threads <= threads:
            return base.step_time(shape)
        return lent_step_time(base, wide, shape, own_threads=threads, threads=step_threads, cores=cores)
    return profiled


def deployment_models(dep: dict, profiles: dict) -> tuple:
    """(base, wide or None) step models of a recorded deployment: at its ranks'
    threads, and at the machine's cores when a rank can borrow them."""
    from cluster.perf_model.step_shape import load_step_model
    base = load_step_model(profiles[str(dep["threads"])])
    wide = load_step_model(profiles[str(dep["cores"])]) if dep["threads"] < dep["cores"] else None
    return base, wide


def profile_only_spec(dep: dict, profiles: dict, model_config):
    """The deployment on this machine's shared cores, its engines' steps as
    profiled (no correction, no serving cost): what sizes the busy calibration
    load. A spec without the shared cores would give every rank a core of its
    own: 1 prefill + 2 decode on 2 cores, three one-thread ranks, got a "busy"
    load past its capacity (1.2x and 2.2x the corrected model's on two machines)."""
    from cluster.config import DeploymentConfig
    from cluster.simulator.from_config import cluster_spec
    base, wide = deployment_models(dep, profiles)
    return cluster_spec(DeploymentConfig.model_validate(dep["body"]), base, model_config=model_config,
                        shared_cores=dep["cores"], threads_per_rank=dep["threads"], wide_model=wide)


def calibrate(dep: dict, profiles: dict, model_config) -> Calibration:
    """The corrected simulator of a recorded deployment, from its calibration
    phases only (module doc, step 2): what the loads are predicted with."""
    from cluster.config import DeploymentConfig
    from cluster.simulator.from_config import KVLink, cluster_spec
    config = DeploymentConfig.model_validate(dep["body"])
    cores, threads = dep["cores"], dep["threads"]
    base, wide = deployment_models(dep, profiles)
    profiled = profiled_step(base, wide, threads, cores)
    link = KVLink(**dep["link"])
    trickle, busy = dep["calibration"]["trickle"], dep["calibration"]["busy"]
    trickle_factors = step_factors(profiled, live_steps(trickle))
    busy_factors = step_factors(profiled, live_steps(busy))

    def spec_with(per_role: dict, serving_cores: float, step_s: float = 0.0, request_s: float = 0.0):
        models = {role: corrected(base, f, step_s) for role, f in per_role.items()}
        borrower = "colocated" if "colocated" in per_role else "decode"
        wide_model = corrected(wide, per_role[borrower], step_s) if wide is not None else None
        return cluster_spec(config, models[borrower], prefill_model=models.get("prefill"),
                            model_config=model_config, link=link, request_overhead_s=request_s,
                            shared_cores=cores, threads_per_rank=threads,
                            serving_cores_per_stream=serving_cores, wide_model=wide_model)
    trickle_run, busy_run = phase_run(trickle), phase_run(busy)
    serving_cores, per_role = fit_contention(spec_with, trickle_run, busy_run, trickle_factors, busy_factors)
    meas = trickle["measured"]
    sim = simulated(spec_with(per_role, serving_cores), *trickle_run)
    step_s = max(0.0, (meas["median_tpot_ms"] - sim["median_tpot_ms"]) / 1000)
    sim = simulated(spec_with(per_role, serving_cores, step_s), *trickle_run)
    request_s = max(0.0, (meas["median_ttft_ms"] - sim["median_ttft_ms"]) / 1000)
    spec = spec_with(per_role, serving_cores, step_s, request_s)
    return Calibration(spec_with, cluster_spec(config, base, model_config=model_config), spec, profiled, per_role,
                       serving_cores, step_s, request_s, {"trickle": trickle_factors, "busy": busy_factors},
                       busy["rate"], link.latency_s)


def predict(dep: dict, calibration: Calibration) -> dict:
    """Per recorded load: the measured figures beside the simulated ones (as
    calibrated, online-corrected, uncorrected)."""
    c = calibration
    rows = {}
    for load, phase in dep["loads"].items():
        run = phase_run(phase)
        load_factors = step_factors(c.profiled, live_steps(phase))
        online = factors_for_live_steps(lambda per: c.spec_with(per, c.serving_cores, c.step_s, c.request_s),
                                        c.per_role, run, load_factors)
        rows[load] = {"rate": phase["rate"], "simulated": simulated(c.spec, *run), "measured": phase["measured"],
                      "uncorrected": simulated(c.raw_spec, *run), "live_step_factor": load_factors,
                      "online_step_factor": online,
                      "simulated_online": simulated(c.spec_with(online, c.serving_cores, c.step_s, c.request_s), *run)}
        if "measured_again" in phase:
            rows[load]["measured_again"] = phase["measured_again"]
    return rows


def phase_run(phase: dict) -> tuple:
    """(request lengths, rate, seed) of a recorded phase: what simulating it takes."""
    return [tuple(x) for x in phase["lengths"]], phase["rate"], phase["seed"]


def live_steps(phase: dict) -> dict[str, list]:
    """A recorded phase's live engine steps, per role, as (StepShape, seconds, threads)."""
    from cluster.perf_model.step_shape import StepShape
    return {role: [(StepShape(int(p), a, int(d), int(c)), seconds, int(threads))
                   for p, a, d, c, seconds, threads in steps]
            for role, steps in phase["steps"].items()}


def record_deployment(name: str, args, base_url: str, datasets: dict, tokenizer, profiles: dict,
                      model_config, cores: int, threads: int) -> dict:
    """Run the warm-up, the two calibration loads and the three loads against the
    live deployment at `base_url`; the loads' rates come from the calibrated
    simulator's capacity. Returns the record `calibrate` and `predict` read."""
    body = deployment_body(name, datasets["model_dir"])
    dep = {"body": body, "cores": cores, "threads": threads, "calibration": {}, "loads": {}}
    model = served_model(base_url, None)
    roles = roles_of(body)
    requests = datasets["sizing"]

    def phase(prompts: list, rate: float, seed: int) -> dict:
        take_live_steps(roles)                                       # drops earlier phases' steps
        meas = measured(base_url, model, prompts, rate, seed, tokenizer)
        return {"lengths": lengths_of(prompts), "rate": rate, "seed": seed, "measured": meas,
                "steps": take_live_steps(roles)}
    measured(base_url, model, datasets["warmup"], 1000.0, args.seed + 99, tokenizer)
    dep["calibration"]["trickle"] = phase(datasets["trickle"], TRICKLE_RATE, args.seed + 7)
    busy_rate = round(BUSY_CALIBRATION_LOAD * capacity(profile_only_spec(dep, profiles, model_config),
                                                       lengths_of(requests), args.seed), 3)
    handoffs = handoff_totals(base_url)
    dep["calibration"]["busy"] = phase(datasets["busy"], busy_rate, args.seed + 8)
    link = measured_link(handoffs, handoff_totals(base_url))
    dep["link"] = {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s}
    calibration = calibrate(dep, profiles, model_config)
    cap = capacity(calibration.spec, lengths_of(requests), args.seed)
    dep["capacity"] = cap
    print(f"  {calibration_line(calibration, roles)}; simulated capacity {cap:.2f} req/s", flush=True)
    for load, factor in LOAD_FACTORS.items():
        rate = round(cap * factor, 3)
        dep["loads"][load] = phase(datasets["loads"][load], rate, args.seed)
        if load == REPEATED_LOAD:
            dep["loads"][load]["measured_again"] = measured(base_url, model, datasets["repeat"], rate,
                                                            args.seed, tokenizer)
        meas = dep["loads"][load]["measured"]
        print(f"  {load} ({rate:.2f} req/s) measured: "
              + ", ".join(f"{k} {_fmt(meas[k])}" for k in FIGURES), flush=True)
    return dep


def calibration_line(c: Calibration, roles) -> str:
    live = c.live_factors
    return ("online correction: served/profiled step " + ", ".join(
        f"{r} x{live['trickle'][r]:.2f} at {TRICKLE_RATE:g} req/s, x{live['busy'][r]:.2f} at "
        f"{c.busy_rate:.2f} req/s" for r in roles)
        + f"; fitted: {c.serving_cores:.2f} serving cores per request streaming, step x"
        + ", ".join(f"{f:.2f}" for f in c.per_role.values())
        + f", +{c.step_s * 1e3:.1f} ms per step, +{c.request_s * 1e3:.1f} ms per request, "
        f"hand-off latency {c.handoff_latency_s * 1e3:.1f} ms")


def deployment_body(name: str, model_dir: str) -> dict:
    return {"model": {"path": model_dir, "max_model_len": 2048}, "device": "cpu", **DEPLOYMENTS[name],
            "engine": {"max_num_seqs": 32, "max_num_batched_tokens": 2048}}


def lengths_of(requests) -> list[list[int]]:
    return [[r.prompt_len, r.expected_output_len] for r in requests]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--calibration-prompts", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/simulator_accuracy.json")
    parser.add_argument("--record", default="bench/results/simulator_accuracy_record.json",
                        help="where the live run's record goes (its profiles, requests, measured figures and "
                             "the workers' engine steps)")
    parser.add_argument("--replay", metavar="RECORD",
                        help="no live run: calibrate and simulate again from a recorded one")
    args = parser.parse_args()

    from engine.model.model_config import ModelConfig
    from engine.tiny_model import ensure_preset_model

    model_dir = str(ensure_preset_model("bench"))
    model_config = ModelConfig.from_pretrained(model_dir)
    record = json.loads(Path(args.replay).read_text()) if args.replay else record_live(args, model_dir, model_config)
    results = {key: record[key] for key in ("cores", "slos_ms", "num_prompts", "input_len", "output_len")}
    results["deployments"] = {}
    for name, dep in record["deployments"].items():
        if "error" in dep:
            results["deployments"][name] = {"loads": {"error": dep["error"]}}
            continue
        calibration = calibrate(dep, record["profiles"], model_config)
        if args.replay:
            print(f"{name}: {calibration_line(calibration, roles_of(dep['body']))}")
        results["deployments"][name] = {"capacity": dep.get("capacity"), "threads": dep["threads"],
                                        "online_factors": calibration.summary,
                                        "loads": predict(dep, calibration)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    for key, what in (("simulated", "calibrated before the loads"), ("simulated_online", "online-corrected")):
        hits, total = within_target(results, key)
        print(f"{what}: {hits} of {total} figures within +-{TOLERANCE:.0%} of the measured ones")
    return 0


def record_live(args, model_dir: str, model_config) -> dict:
    """Every deployment's live run (record_deployment), with the profiles they
    are simulated with; written to args.record."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def dataset(num_prompts: int, seed: int, lengths_seed: int | None = None) -> list:
        return random_dataset(tokenizer, num_prompts=num_prompts, input_len=args.input_len,
                              output_len=args.output_len, range_ratio=0.25, prefix_len=0, seed=seed,
                              lengths_seed=lengths_seed)

    # Every phase gets prompts no other phase sent: a repeated prompt would be a prefix-cache
    # hit on the live server (its prefill nearly free) that the simulator does not model.
    datasets = {"model_dir": model_dir, "sizing": dataset(args.num_prompts, args.seed), "warmup": dataset(8, args.seed + 99),
                "busy": dataset(args.calibration_prompts, args.seed + 98), "trickle": dataset(20, args.seed + 97),
                # lengths from a seed of their own, so that the repeat below can draw the same ones
                "loads": {load: dataset(args.num_prompts, args.seed + 1 + i, lengths_seed=args.seed + 1 + i)
                          for i, load in enumerate(LOAD_FACTORS)},
                # the near-capacity load again, other prompts of its lengths (at its arrival times): the live noise
                "repeat": dataset(args.num_prompts, args.seed + 50,
                                  lengths_seed=args.seed + 1 + list(LOAD_FACTORS).index(REPEATED_LOAD))}
    cores = os.cpu_count() or 1
    record = {"cores": cores, "slos_ms": SLOS_MS, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "seed": args.seed, "profiles": {}, "deployments": {}}
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-simacc-"))
    for name in args.deployments.split(","):
        body = deployment_body(name, model_dir)
        threads = max(1, cores // ranks(body))
        print(f"{name}: {ranks(body)} rank(s) on {cores} cores, {threads} thread(s) each", flush=True)
        for t in {threads, cores}:     # a one-rank decode (colocated) engine borrows idle engines' cores
            profile_for(model_dir, t, record["profiles"])
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(body))
        try:
            with served(path, args.port, workdir / f"{name}.log") as base_url:
                record["deployments"][name] = record_deployment(name, args, base_url, datasets, tokenizer,
                                                                record["profiles"], model_config, cores, threads)
        except ServerFailed as exc:
            print(f"  {name} failed: {exc}", file=sys.stderr)
            record["deployments"][name] = {"error": str(exc)}
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)     # after each: a later failure keeps it
        Path(args.record).write_text(json.dumps(record, separators=(",", ":")) + "\n")
    return record


def within_target(results: dict, key: str) -> tuple[int, int]:
    """(figures of `key` within TOLERANCE of the measured ones, figures compared)."""
    hits = total = 0
    for d in results["deployments"].values():
        for load, row in d["loads"].items():
            if load == "error" or key not in row:
                continue
            for k in FIGURES:
                sim, meas = row[key][k], row["measured"][k]
                if sim is None or not meas:
                    continue
                total += 1
                hits += abs(sim / meas - 1) <= TOLERANCE
    return hits, total


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(results: dict) -> str:
    lines = ["| deployment | load | rate | " + " | ".join(f"{k} sim / meas (ratio)" for k in FIGURES)
             + " | goodput, uncorrected sim |", "|---|---|---:|" + "---|" * (len(FIGURES) + 1)]
    for name, d in results["deployments"].items():
        for load, row in d["loads"].items():
            if load == "error":
                continue
            raw = row["uncorrected"]["request_goodput"]
            lines.append(f"| {name} | {load} | {row['rate']:.2f} | " + _cells(row["simulated"], row["measured"])
                         + f" | {_fmt(raw)} |")
            if "simulated_online" in row:
                lines.append(f"| {name} | {load}, online-corrected sim / measured | {row['rate']:.2f} | "
                             + _cells(row["simulated_online"], row["measured"]) + " | |")
            if "measured_again" in row:
                lines.append(f"| {name} | {load}, measured again / measured | {row['rate']:.2f} | "
                             + _cells(row["measured_again"], row["measured"]) + " | |")
    return "\n".join(lines)


def _cells(a: dict, b: dict) -> str:
    """Each figure as "a / b (a/b)"."""
    cells = []
    for k in FIGURES:
        x, y = a[k], b[k]
        ratio = f"{x / y:.2f}" if x is not None and y else "-"
        cells.append(f"{_fmt(x)} / {_fmt(y)} ({ratio})")
    return " | ".join(cells)


if __name__ == "__main__":
    sys.exit(main())
