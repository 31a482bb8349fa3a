"""Overload: a ramp from 0.5x to 10x the measured capacity against `pdserve
serve`, admission control off and on, in one run.

    python bench/overload.py [--steps 0.5,1,2,5,10] [--step-s 15] [--drain-s 0] [--slo ttft:1000 tpot:100]
                             [--slo-factor F] [--overload-wait-factor F]
                             [--systems "admission off,admission on"]
                             [--capacity RPS --unloaded-ttft-ms MS] [--model DIR]
                             [--mode colocated|disaggregated]
                             [--json bench/results/overload.json]

Checkpoint: the "bench" preset. Deployment, on a local cluster: one colocated
replica (--mode colocated, the default), or pdserve's default deployment (one
prefill and one decode replica, conditional disaggregation: --mode
disaggregated). Requests: ~280-token prompts, 64 output tokens, greedy, ignore_eos,
streamed. First, with admission off, the capacity C (requests/s at 16
concurrent) and the unloaded TTFT (30 requests one at a time: its p99 is the
reference for the admitted p99, its median is reported beside it), on a server
of its own when the systems leave admission off out; then for each
system the ramp: --step-s seconds of Poisson arrivals at step x C for each
step, back to back in one run (--drain-s S > 0 instead runs each step on its
own, S seconds after the previous one ended, so that every step starts from an
idle server). Per step, over the requests that arrived in it: goodput
(requests meeting both SLOs per second of the step), SLO attainment of the
admitted requests, the share refused (429) and how fast the 429 came (p99),
and TTFT p50 / p99 / max of the admitted ones (the JSON keeps each admitted
request's send time and TTFT, to place a tail in the step). Targets with admission on:
goodput at 10x >= 80% of the peak goodput; p99 TTFT of admitted requests <= 2x
its unloaded value.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.loadtest.datasets import random_dataset  # noqa: E402
from bench.loadtest.metrics import e2el, meets_slos, percentile, ttft  # noqa: E402
from bench.loadtest.runner import RunConfig, run_benchmark  # noqa: E402
from bench.serving_overhead import served  # noqa: E402
from cluster.cli.plan_goodput import parse_slo  # noqa: E402
from engine.tp_group import free_port  # noqa: E402

UNLOADED_REQUESTS = 30      # one at a time: enough for a p99 that is not one request's chance


def config_file(config: dict, log_dir: Path, name: str) -> Path:
    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(base_url: str, requests, rate: float, tokenizer, *, concurrency: int | None = None,
        offsets: list[float] | None = None, limit_s: float = 900.0):
    """`limit_s`: the run's and each request's time limit (a request past it is unfinished)."""
    cfg = RunConfig(base_url=base_url, model="bench", ignore_eos=True, request_rate=rate, max_concurrency=concurrency,
                    disable_tqdm=True, max_duration=limit_s, request_timeout=limit_s)
    res = asyncio.run(run_benchmark(requests, cfg, tokenizer=tokenizer, offsets=offsets))
    if res.interrupted:
        unfinished = sum(r.unfinished for r in res.records)
        print(f"  warning: the run stopped early ({res.interrupted}): {unfinished} requests unfinished, "
              f"{res.num_requests - len(res.records)} never sent; the steps count them as failures", flush=True)
    return res


def time_limit_s(steps: list[float], step_s: float) -> float:
    """Long enough for every request of the steps to be served: with nothing refused, the
    queue drains at the capacity, so by sum(steps) x step_s (their requests over the capacity)."""
    return max(900.0, 1.5 * sum(steps) * step_s + 120)


def measure_capacity(url: str, tokenizer, *, warm: bool = False) -> tuple[float, float, float]:
    """(requests/s at 16 concurrent, unloaded TTFT p99 ms, its median ms) of a server
    with admission control off (`warm`: it has served a few requests already)."""
    if not warm:
        run(url, random_dataset(tokenizer, num_prompts=8, input_len=280, output_len=64, seed=99), 4.0, tokenizer)
    closed = run(url, random_dataset(tokenizer, num_prompts=48, input_len=280, output_len=64, seed=1),
                 float("inf"), tokenizer, concurrency=16)
    capacity = sum(r.succeeded for r in closed.records) / closed.duration
    alone = run(url, random_dataset(tokenizer, num_prompts=UNLOADED_REQUESTS, input_len=280, output_len=64, seed=2),
                float("inf"), tokenizer, concurrency=1)
    alone_ms = sorted(ttft(r) * 1000 for r in alone.records if r.succeeded)
    p99, median = percentile(alone_ms, 99), statistics.median(alone_ms)
    print(f"  capacity {capacity:.2f} req/s at 16 concurrent; unloaded TTFT p50 {median:.0f} ms, p99 {p99:.0f} ms",
          flush=True)
    return capacity, p99, median


def step_load(tokenizer, index: int, rate: float, step_s: float) -> tuple[list, list[float]]:
    """Step `index`'s requests, round(rate x step_s) of them, and their send
    times over [0, step_s) in seconds: Poisson arrivals given their count
    (sorted uniform times), so each step offers exactly its rate and the steps
    follow one another without a gap or an overlap. The same for every system."""
    rng = random.Random(200 + index)
    arrivals = sorted(rng.uniform(0.0, step_s) for _ in range(max(1, round(rate * step_s))))
    requests = random_dataset(tokenizer, num_prompts=len(arrivals), input_len=280, output_len=64, seed=100 + index)
    return requests, arrivals


def ramp(url: str, steps: list[float], capacity: float, step_s: float, tokenizer, slos_ms: dict) -> list[dict]:
    """The steps back to back in one run (a ramp): step i's requests arrive over
    [i, i + 1) x step_s at steps[i] x capacity; each step's figures are over the
    requests that arrived in it."""
    requests, offsets, step_of = [], [], []
    for i, step in enumerate(steps):
        step_requests, arrivals = step_load(tokenizer, i, step * capacity, step_s)
        requests += step_requests
        offsets += [i * step_s + t for t in arrivals]
        step_of += [i] * len(arrivals)
    started = time.monotonic()
    res = run(url, requests, capacity, tokenizer, offsets=offsets, limit_s=time_limit_s(steps, step_s))
    wall_s = time.monotonic() - started
    by_step: list[list] = [[] for _ in steps]
    for record in res.records:
        by_step[step_of[record.index]].append(record)
    rows = []
    for i, step in enumerate(steps):
        rows.append({"step": step, "rate": step * capacity, **step_figures(by_step[i], slos_ms, step_s),
                     "not_sent": step_of.count(i) - len(by_step[i]), "wall_s": wall_s})
        print_row(rows[-1])
    return rows


def steps_from_idle(url: str, steps: list[float], capacity: float, step_s: float, drain_s: float, tokenizer,
                    slos_ms: dict) -> list[dict]:
    """Each step a run of its own, started `drain_s` after the previous one ended
    (every step starts from an idle server)."""
    rows = []
    for i, step in enumerate(steps):
        rate = step * capacity
        reqs, arrivals = step_load(tokenizer, i, rate, step_s)
        started = time.monotonic()
        res = run(url, reqs, rate, tokenizer, offsets=arrivals, limit_s=time_limit_s([step], step_s))
        rows.append({"step": step, "rate": rate, **step_figures(res.records, slos_ms, step_s),
                     "not_sent": res.num_requests - len(res.records), "wall_s": time.monotonic() - started})
        print_row(rows[-1])
        time.sleep(drain_s)
    return rows


def print_row(row: dict) -> None:
    cut = (f" ({row['unfinished']} unfinished, {row['not_sent']} not sent at the time limit)"
           if row["unfinished"] or row["not_sent"] else "")
    print(f"  {row['step']:4g}x ({row['rate']:5.2f} req/s): goodput {row['goodput']:.2f} req/s, admitted met SLOs "
          f"{row['attainment_admitted']:.0%}, refused {row['refused_share']:.0%}, TTFT p50 / p99 "
          f"{row['ttft_p50_ms'] or 0:.0f} / {row['ttft_p99_ms'] or 0:.0f} ms, "
          f"other failures {row['failed_other']}{cut}, "
          f"429 answered in {row['refusal_p99_ms'] or 0:.0f} ms (p99)", flush=True)


def step_figures(records: list, slos_ms: dict, step_s: float) -> dict:
    """One step's figures. Admitted: every request not refused (429), a failure after
    admission included: it counts against the admitted requests' attainment, as a
    request that missed its SLOs (its TTFT, where it had one, in the percentiles)."""
    refused = [r for r in records if r.status == 429]
    admitted = [r for r in records if r.status != 429]
    good = sum(r.succeeded and meets_slos(r, slos_ms) for r in admitted)
    ttfts = sorted(t for r in admitted if (t := ttft(r)) is not None)
    refusal_s = sorted(e2el(r) for r in refused if e2el(r) is not None)
    return {"sent": len(records), "admitted": len(admitted), "refused_share": len(refused) / max(1, len(records)),
            "unfinished": sum(r.unfinished for r in records),    # still running when the run's time limit came
            "refusal_p99_ms": percentile(refusal_s, 99) * 1000 if refusal_s else None,
            "failed_other": sum(not r.succeeded for r in admitted), "goodput": good / step_s,
            "attainment_admitted": good / max(1, len(admitted)),
            "ttft_p50_ms": percentile(ttfts, 50) * 1000 if ttfts else None,
            "ttft_p99_ms": percentile(ttfts, 99) * 1000 if ttfts else None,
            "ttft_max_ms": ttfts[-1] * 1000 if ttfts else None,
            "ttfts_ms": [round(t * 1000, 1) for t in ttfts],
            # (scheduled send time s after the run's start, TTFT ms) of each admitted request, in send order:
            # where in the step a tail came from
            "admitted_ttfts": [[round(r.scheduled_offset, 3), round(t * 1000, 1)]
                               for r in sorted(admitted, key=lambda r: r.scheduled_offset)
                               if (t := ttft(r)) is not None]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="0.5,1,2,5,10")
    ap.add_argument("--step-s", type=float, default=15.0)
    ap.add_argument("--drain-s", type=float, default=0.0,
                    help="0: the steps back to back (a ramp); > 0: each step starts from an idle server, "
                         "this many seconds after the previous step ended")
    ap.add_argument("--slo", nargs=2, type=parse_slo, default=[("ttft", 1000.0), ("tpot", 100.0)])
    ap.add_argument("--slo-factor", type=float, default=None, help="admission.slo_factor (default: the server's)")
    ap.add_argument("--overload-wait-factor", type=float, default=None,
                    help="admission.overload_wait_factor (default: the server's)")
    ap.add_argument("--systems", default="admission off,admission on")
    ap.add_argument("--capacity", type=float, default=None, help="skip measuring it (req/s at 16 concurrent)")
    ap.add_argument("--unloaded-ttft-ms", type=float, default=None,
                    help="skip measuring it: the unloaded TTFT p99 in ms")
    ap.add_argument("--model", default=None)
    ap.add_argument("--mode", choices=("colocated", "disaggregated"), default="colocated",
                    help="one colocated replica, or the default 1 prefill + 1 decode deployment")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if (args.capacity is None) != (args.unloaded_ttft_ms is None):
        ap.error("--capacity and --unloaded-ttft-ms go together (both skip the measurement that gives both)")
    from transformers import AutoTokenizer

    from engine.tiny_model import ensure_preset_model
    model_dir = args.model or str(ensure_preset_model("bench"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    slos_ms = dict(args.slo)
    base = {"model": {"path": model_dir, "served_model_name": "bench"}, "mode": args.mode}
    systems = {"admission off": {**base, "admission": {"enabled": False}},
               "admission on": {**base, "slo": {"ttft_ms": slos_ms["ttft"], "tpot_ms": slos_ms["tpot"]},
                                "admission": {k: v for k, v in (("slo_factor", args.slo_factor),
                                                                ("overload_wait_factor", args.overload_wait_factor))
                                              if v is not None}}}
    off = systems["admission off"]
    systems = {name: systems[name] for name in args.systems.split(",")}
    log_dir = Path(tempfile.mkdtemp(prefix="overload-"))
    steps = [float(x) for x in args.steps.split(",")]
    results: dict = {"args": vars(args), "systems": {}}
    capacity, unloaded_ttft_ms, unloaded_median_ms = args.capacity, args.unloaded_ttft_ms, None
    if capacity is None and "admission off" not in systems:
        # measured with admission off: a closed loop whose requests are refused measures the refusals
        print("== admission off (capacity only)", flush=True)
        with served(config_file(off, log_dir, "capacity"), free_port(), log_dir / "capacity.log", 300) as url:
            capacity, unloaded_ttft_ms, unloaded_median_ms = measure_capacity(url, tokenizer)
    for name, config in systems.items():
        print(f"== {name}", flush=True)
        stem = name.replace(" ", "-")
        with served(config_file(config, log_dir, stem), free_port(), log_dir / f"{stem}.log", 300) as url:
            run(url, random_dataset(tokenizer, num_prompts=8, input_len=280, output_len=64, seed=99), 4.0, tokenizer)
            if capacity is None:
                capacity, unloaded_ttft_ms, unloaded_median_ms = measure_capacity(url, tokenizer, warm=True)
            rows = (ramp(url, steps, capacity, args.step_s, tokenizer, slos_ms) if args.drain_s == 0 else
                    steps_from_idle(url, steps, capacity, args.step_s, args.drain_s, tokenizer, slos_ms))
            results["systems"][name] = rows
    results["capacity_rps"], results["unloaded_ttft_ms"] = capacity, unloaded_ttft_ms    # its p99
    results["unloaded_ttft_p50_ms"] = unloaded_median_ms
    if args.json:      # first: nothing below may lose a run's results
        Path(args.json).write_text(json.dumps(results, indent=2))
    if "admission on" in results["systems"]:
        print(summary(results["systems"]["admission on"], unloaded_ttft_ms, unloaded_median_ms))
    return 0


def summary(on: list[dict], unloaded_p99_ms: float, unloaded_median_ms: float | None) -> str:
    """The targets' figures for the admission-on ramp (its last step against its peak)."""
    peak, last = max(r["goodput"] for r in on), on[-1]
    share = f"{last['goodput'] / peak:.0%}" if peak > 0 else "n/a (no goodput at any step)"
    line = (f"\nadmission on: goodput at {last['step']:g}x is {share} of its peak (target >= 80%); admitted p99 "
            f"TTFT at {last['step']:g}x ({last.get('admitted', '?')} admitted) is "
            f"{(last['ttft_p99_ms'] or 0) / unloaded_p99_ms:.1f}x the unloaded TTFT p99 (target <= 2x)")
    return line + (f", {(last['ttft_p99_ms'] or 0) / unloaded_median_ms:.1f}x its median"
                   if unloaded_median_ms else "")


if __name__ == "__main__":
    sys.exit(main())
