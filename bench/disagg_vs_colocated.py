"""Disaggregated vs colocated serving under the same CPU budget, in one run.

    python bench/disagg_vs_colocated.py [--rates 2,4,8,16] [--num-prompts 48] [--slo-ttft-ms 250] [--slo-tpot-ms 15]

Starts a local Ray cluster and serves the built-in tiny model twice, one after
the other: disaggregated (1 prefill + 1 decode replica) and colocated (2
replicas), each replica one rank with one CPU (`cpus_per_rank: 1`), so both
modes get the same two cores. The workload mixes short chat-like requests
(short prompt, long answer: they spend their life decoding) with long prompts
that want one short answer: in colocated mode a long prompt's prefill runs in
the same steps as the short requests' decodes and stalls them; disaggregated,
it runs on the prefill replica instead. For each offered rate, both modes get
the same requests on the same Poisson schedule (`pdserve loadtest`'s runner);
goodput counts requests meeting both the TTFT and the TPOT SLO.

Writes bench/results/disagg_vs_colocated.json and PNG plots in
bench/results/disagg_vs_colocated/, and prints one table row per (rate, mode).
Figures depend on the machine: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

from bench.loadtest.datasets import SampleRequest, random_dataset
from bench.loadtest.metrics import summarize
from bench.loadtest.report import build_result
from bench.loadtest.runner import RunConfig, run_benchmark
from bench.serve_app import deploy

RESULTS = Path(__file__).parent / "results"
MODES = {
    "disaggregated": {"mode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 1}},
    "colocated": {"mode": "colocated", "colocated": {"replicas": 2}},
}


def mixed_workload(tokenizer, *, num_prompts: int, long_fraction: float, short_len: int, short_output: int,
                   long_len: int, long_output: int, seed: int) -> list[SampleRequest]:
    """`num_prompts` requests, a `long_fraction` share of them long prompts, in random order."""
    num_long = round(num_prompts * long_fraction)
    short = random_dataset(tokenizer, num_prompts=num_prompts - num_long, input_len=short_len,
                           output_len=short_output, range_ratio=0.25, seed=seed)
    long = random_dataset(tokenizer, num_prompts=max(num_long, 1), input_len=long_len, output_len=long_output,
                          range_ratio=0.1, seed=seed + 1)[:num_long]
    requests = short + long
    random.Random(seed).shuffle(requests)
    return requests


def settings(mode: str) -> dict:
    """The deployment of `mode`: one CPU per replica, the tiny model in fp32."""
    return {**MODES[mode], "model": {"dtype": "float32", "max_model_len": 1024},
            "engine": {"max_num_batched_tokens": 1024, "kv_cache_memory_gib": 0.25},
            "resources": {"cpus_per_rank": 1}}


def run_mode(mode: str, port: int, workloads: dict[float, list[SampleRequest]], warmup: list[SampleRequest],
             slos: dict[str, float], seed: int) -> list[dict]:
    from ray import serve

    base = deploy(mode, settings(mode), port)
    config = RunConfig(base_url=base, model="tiny", ignore_eos=True, seed=seed, disable_tqdm=True,
                       max_duration=300)
    asyncio.run(run_benchmark(warmup, config))
    results = []
    for rate, requests in workloads.items():
        run = asyncio.run(run_benchmark(requests, RunConfig(**{**config.__dict__, "request_rate": rate})))
        summary = summarize(run.records, num_requests=run.num_requests, duration=run.duration, slos_ms=slos)
        result = build_result(run, summary, meta={"mode": mode})
        results.append(result)
        print(row(mode, rate, result), flush=True)
    serve.delete(mode)
    return results


HEADER = (f"{'rate':>6} {'mode':>14} {'req/s':>7} {'goodput':>8} {'SLO met':>8} {'failed':>6} "
          f"{'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p90':>9}")


def row(mode: str, rate: float, r: dict) -> str:
    def ms(key: str) -> str:
        return "-" if r.get(key) is None else f"{r[key]:.1f}"
    return (f"{rate:6g} {mode:>14} {r['request_throughput']:7.2f} {r['request_goodput']:8.2f} "
            f"{r['slo_attainment'] * 100:7.0f}% {r['failed']:6d} {ms('median_ttft_ms'):>9} {ms('p90_ttft_ms'):>9} "
            f"{ms('median_tpot_ms'):>9} {ms('p90_tpot_ms'):>9}")


def plot(rates: list[float], results: dict[str, list[dict]], slos: dict[str, float], out: Path) -> list[Path]:
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    panels = [("request_goodput", "goodput (req/s meeting both SLOs)", "goodput.png"),
              ("slo_attainment", "share of requests meeting both SLOs", "slo_attainment.png"),
              ("p90_ttft_ms", "p90 time to first token (ms)", "ttft_p90.png"),
              ("p90_tpot_ms", "p90 time per output token (ms)", "tpot_p90.png")]
    written = []
    for key, label, name in panels:
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        for mode, runs in results.items():
            ax.plot(rates, [r.get(key) for r in runs], marker="o", label=mode)
        if key in ("p90_ttft_ms", "p90_tpot_ms"):
            ax.axhline(slos[key.split("_")[1]], color="gray", linestyle=":", label="SLO")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_title(f"tiny model, 2 CPUs: {label.split(' (')[0]}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, format="png", dpi=100)
        written.append(out / name)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="2,4,8,16", help="offered request rates (req/s), comma-separated")
    parser.add_argument("--num-prompts", type=int, default=48, help="requests per rate")
    parser.add_argument("--long-fraction", type=float, default=0.25)
    parser.add_argument("--short-len", type=int, default=32)
    parser.add_argument("--short-output", type=int, default=64)
    parser.add_argument("--long-len", type=int, default=768)
    parser.add_argument("--long-output", type=int, default=4)
    parser.add_argument("--slo-ttft-ms", type=float, default=250.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "disagg_vs_colocated.json"))
    parser.add_argument("--plot-dir", default=str(RESULTS / "disagg_vs_colocated"))
    args = parser.parse_args()

    import ray
    from ray import serve

    from engine.tiny_model import ensure_default_model
    from engine.tokenizer import load_tokenizer
    from engine.tp_group import free_port

    rates = [float(r) for r in args.rates.split(",")]
    slos = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    tokenizer = load_tokenizer(str(ensure_default_model()))
    shape = dict(long_fraction=args.long_fraction, short_len=args.short_len, short_output=args.short_output,
                 long_len=args.long_len, long_output=args.long_output)
    workloads = {rate: mixed_workload(tokenizer, num_prompts=args.num_prompts, seed=args.seed + i, **shape)
                 for i, rate in enumerate(rates)}
    warmup = mixed_workload(tokenizer, num_prompts=8, seed=args.seed + 1000, **shape)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    print(f"{args.num_prompts} requests per rate: {1 - args.long_fraction:.0%} with ~{args.short_len}-token prompts "
          f"and {args.short_output} output tokens, {args.long_fraction:.0%} with ~{args.long_len}-token prompts and "
          f"{args.long_output}; SLOs TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")
    print(HEADER, flush=True)
    try:
        results = {mode: run_mode(mode, port, workloads, warmup, slos, args.seed) for mode in MODES}
    finally:
        serve.shutdown()
        ray.shutdown()

    best = {mode: max(r["request_goodput"] for r in runs) for mode, runs in results.items()}
    print("best goodput: " + ", ".join(f"{mode} {g:.2f} req/s" for mode, g in best.items())
          + f" (disaggregated / colocated = {best['disaggregated'] / max(best['colocated'], 1e-9):.2f})")
    written = plot(rates, results, slos, Path(args.plot_dir))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "slos_ms": slos, "rates": rates, "best_goodput": best,
        "runs": {mode: [{k: v for k, v in r.items() if k not in ("requests", "generated_texts", "itls")}
                        for r in runs] for mode, runs in results.items()}}, indent=2) + "\n")
    print(f"wrote {args.out} and {', '.join(str(p) for p in written)}")


if __name__ == "__main__":
    main()
