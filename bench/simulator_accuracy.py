"""The simulator against the live system, side by side, in one run.

For each deployment (colocated; 1 prefill + 1 decode; 1 prefill + 2 decode)
on the `bench` checkpoint, CPU:
1. profile the engine with the torch threads each of that deployment's ranks
   gets (`pdserve profile`'s code, in process);
2. start `pdserve serve --config` on a local cluster of this machine's size
   and run a calibration load (a trickle of requests); the step model is
   corrected online from it (cluster/perf_model/online.py): the measured TPOT
   minus the simulated one is the serving path's cost per step, added to every
   step; the TTFT left over after that is the cost per request (router, HTTP,
   the hand-off's messages), added to its token times;
3. find the corrected model's simulated capacity (the highest rate at >= 90%
   SLO attainment) and pick three loads from it: light (0.3x), near capacity
   (0.9x), overloaded (1.5x);
4. run each load through the load generator (`pdserve loadtest`'s code) and
   simulate the same requests (same lengths, same arrival times);
5. print goodput, TTFT p50/p90 and TPOT p50/p90, simulated / measured, with
   the uncorrected (engine-only profile) prediction alongside.

    python bench/simulator_accuracy.py [--num-prompts 60] [--out bench/results/simulator_accuracy.json]

Target: each simulated figure within +-20% of the measured one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadtest.arrivals import arrival_offsets  # noqa: E402
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
FIGURES = ("request_goodput", "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms")
CALIBRATION_RATE = 1.0       # req/s: requests rarely overlap, so each one's times are its own steps'


def ranks(deployment: dict) -> int:
    pools = ("colocated",) if deployment["mode"] == "colocated" else ("prefill", "decode")
    return sum(deployment[p]["replicas"] for p in pools)


def profile_for(model_dir: str, threads: int, cache: dict) -> object:
    from cluster.perf_model.profiler import ProfileGrid, run_profile
    from cluster.perf_model.step_shape import load_step_model
    if threads not in cache:
        started = time.monotonic()
        grid = ProfileGrid(prompt_lens=(16, 64, 256, 512), batch_sizes=(1, 4, 16), contexts=(64, 300),
                           chunk_len=64, decode_steps=4)
        data = run_profile(model_dir, device="cpu", grid=grid, engine_options={"cpu_threads": threads})
        cache[threads] = (load_step_model(data), data)
        err = data["fit_error"]
        print(f"  profile at {threads} thread(s): {len(data['points'])} steps, fit error mean "
              f"{err['mean_abs_rel']:.1%} max {err['max_abs_rel']:.1%} ({time.monotonic() - started:.0f} s)",
              flush=True)
    return cache[threads][0]


def corrected(model, overhead_s: float):
    """`model` with a fixed per-step overhead added (an online correction)."""
    from cluster.perf_model import OnlineCorrection
    return OnlineCorrection(model, overhead_s=overhead_s)


def figures(result: dict) -> dict:
    return {k: result.get(k) for k in (*FIGURES, "slo_attainment")}


def simulated(spec, requests, rate: float, seed: int) -> dict:
    from cluster.simulator import simulate
    lengths = [(r.prompt_len, r.expected_output_len) for r in requests]
    sim = simulate(spec, lengths, arrival_offsets(len(requests), rate, 1.0, seed))
    records = sim.records()
    run = RunResult(RunConfig(base_url="simulated", model="bench", request_rate=rate, seed=seed), records,
                    len(requests), 0.0, sim.duration, None)
    summary = summarize(records, num_requests=len(requests), duration=sim.duration, slos_ms=SLOS_MS,
                        percentiles=(50, 90, 99))
    return figures(build_result(run, summary))


def measured(base_url: str, model: str, requests, rate: float, seed: int, tokenizer) -> dict:
    config = RunConfig(base_url=base_url, model=model, request_rate=rate, max_duration=300.0, request_timeout=120.0,
                       temperature=0.0, ignore_eos=True, seed=seed, disable_tqdm=True)
    run = asyncio.run(run_benchmark(requests, config, tokenizer=tokenizer))
    summary = summarize(run.records, num_requests=run.num_requests, duration=run.duration, slos_ms=SLOS_MS,
                        percentiles=(50, 90, 99))
    return figures(build_result(run, summary))


def capacity(spec, requests, seed: int) -> float:
    """The simulated highest rate with >= 90% of these requests meeting the SLOs."""
    low, high = 0.0, 0.25
    while _attains(spec, requests, high, seed) and high < 1000:
        low, high = high, high * 2
    for _ in range(7):
        mid = (low + high) / 2
        low, high = (mid, high) if _attains(spec, requests, mid, seed) else (low, mid)
    return max(low, 0.05)


def _attains(spec, requests, rate: float, seed: int) -> bool:
    return (simulated(spec, requests, rate, seed)["slo_attainment"] or 0.0) >= 0.9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--calibration-prompts", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/simulator_accuracy.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from cluster.config import DeploymentConfig
    from cluster.simulator.from_config import cluster_spec
    from engine.model.model_config import ModelConfig
    from engine.tiny_model import ensure_preset_model

    model_dir = str(ensure_preset_model("bench"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model_config = ModelConfig.from_pretrained(model_dir)
    requests = random_dataset(tokenizer, num_prompts=args.num_prompts, input_len=args.input_len,
                              output_len=args.output_len, range_ratio=0.25, prefix_len=0, seed=args.seed)
    cores = os.cpu_count() or 1
    profiles: dict = {}
    results = {"cores": cores, "slos_ms": SLOS_MS, "num_prompts": args.num_prompts, "input_len": args.input_len,
               "output_len": args.output_len, "deployments": {}}
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-simacc-"))
    for name in args.deployments.split(","):
        body = {"model": {"path": model_dir, "max_model_len": 2048}, "device": "cpu", **DEPLOYMENTS[name],
                "engine": {"max_num_seqs": 32, "max_num_batched_tokens": 2048}}
        config = DeploymentConfig.model_validate(body)
        threads = max(1, cores // ranks(body))
        print(f"{name}: {ranks(body)} rank(s) on {cores} cores, {threads} thread(s) each", flush=True)
        base = profile_for(model_dir, threads, profiles)
        raw_spec = cluster_spec(config, base, model_config=model_config)
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(body))
        rows, factors, cap = {}, {}, None
        try:
            with served(path, args.port, workdir / f"{name}.log") as base_url:
                model = served_model(base_url, None)
                measured(base_url, model, requests[:8], 1000.0, args.seed + 99, tokenizer)    # warm-up
                calibration = requests[:args.calibration_prompts]
                meas = measured(base_url, model, calibration, CALIBRATION_RATE, args.seed + 7, tokenizer)
                sim = simulated(raw_spec, calibration, CALIBRATION_RATE, args.seed + 7)
                step_s = max(0.0, (meas["median_tpot_ms"] - sim["median_tpot_ms"]) / 1000)
                stepped = cluster_spec(config, corrected(base, step_s), model_config=model_config)
                sim = simulated(stepped, calibration, CALIBRATION_RATE, args.seed + 7)
                request_s = max(0.0, (meas["median_ttft_ms"] - sim["median_ttft_ms"]) / 1000)
                factors = {"per_step_s": step_s, "per_request_s": request_s}
                spec = cluster_spec(config, corrected(base, step_s), model_config=model_config,
                                    request_overhead_s=request_s)
                cap = capacity(spec, requests, args.seed)
                print(f"  online correction: +{step_s * 1e3:.1f} ms per step, +{request_s * 1e3:.1f} ms per request; "
                      f"simulated capacity {cap:.2f} req/s", flush=True)
                for load, factor in LOAD_FACTORS.items():
                    rate = round(cap * factor, 3)
                    meas = measured(base_url, model, requests, rate, args.seed, tokenizer)
                    sim = simulated(spec, requests, rate, args.seed)
                    raw = simulated(raw_spec, requests, rate, args.seed)
                    rows[load] = {"rate": rate, "simulated": sim, "measured": meas, "uncorrected": raw}
                    print(f"  {load} ({rate:.2f} req/s): " + ", ".join(
                        f"{k} {_fmt(sim[k])} / {_fmt(meas[k])}" for k in FIGURES), flush=True)
        except ServerFailed as exc:
            print(f"  {name} failed: {exc}", file=sys.stderr)
            rows["error"] = str(exc)
        results["deployments"][name] = {"capacity": cap, "threads": threads, "online_factors": factors,
                                        "loads": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    return 0


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(results: dict) -> str:
    lines = ["| deployment | load | rate | " + " | ".join(f"{k} sim / meas (ratio)" for k in FIGURES)
             + " | goodput, uncorrected sim |", "|---|---|---:|" + "---|" * (len(FIGURES) + 1)]
    for name, d in results["deployments"].items():
        for load, row in d["loads"].items():
            if load == "error":
                continue
            cells = []
            for k in FIGURES:
                s, m = row["simulated"][k], row["measured"][k]
                ratio = f"{s / m:.2f}" if s is not None and m else "-"
                cells.append(f"{_fmt(s)} / {_fmt(m)} ({ratio})")
            raw = row["uncorrected"]["request_goodput"]
            lines.append(f"| {name} | {load} | {row['rate']:.2f} | " + " | ".join(cells) + f" | {_fmt(raw)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
