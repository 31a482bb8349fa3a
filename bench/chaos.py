"""Chaos: a worker replica killed every N seconds under steady load against
`pdserve serve`; how many requests are lost, and what a migration costs.

    python bench/chaos.py [--duration-s 150] [--kill-every-s 20] [--rate R]
                          [--baseline-s 40] [--model DIR] [--json bench/results/chaos.json]

Deployment: disaggregated, one prefill and two decode replicas on a local
cluster (half a CPU per rank), the built-in tiny checkpoint unless --model.
Requests: ~160-token prompts, 64 output tokens, greedy, ignore_eos, streamed,
Poisson arrivals at --rate (default: half of the capacity measured first at 8
concurrent). First a baseline of --baseline-s without failures, then
--duration-s of the same load while a worker replica's process is SIGKILLed
every --kill-every-s seconds (decode, decode, prefill, in turn). Serve
replaces each killed replica; a kill waits until the last one's replacement
serves (the router hears from every replica), so every kill hits a replica
that carries traffic.

Figures: requests sent, completed, lost (any that did not complete with
status 200; target 0); migrations (the router's counter, in all and from each
kill to the next: a run whose decode kills moved nothing says so); replica processes
that ended without being killed (a replacement must not restart the others); for requests in
flight at a kill ("affected") against the others and the baseline: end-to-end
latency p50/p99 and the longest pause between two chunks (the stall a
client sees while its request moves). Every prompt of the chaos phase is also
in the baseline: completed outputs are compared with the undisturbed ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.loadtest.client import metrics_text, scrape_metrics  # noqa: E402
from bench.loadtest.datasets import random_dataset  # noqa: E402
from bench.loadtest.metrics import e2el, itls, percentile, ttft  # noqa: E402
from bench.loadtest.runner import RunConfig, run_benchmark  # noqa: E402
from bench.serving_overhead import served  # noqa: E402
from engine.tp_group import free_port  # noqa: E402

APP = "pdserve"
INPUT_LEN, OUTPUT_LEN = 160, 64
KILL_ORDER = ("DecodeServer", "DecodeServer", "PrefillServer")


def replica_pids(deployment: str) -> list[int]:
    """The processes of a deployment's replicas (Ray titles them ray::ServeReplica:APP:DEPLOYMENT)."""
    out = subprocess.run(["pgrep", "-f", f"^ray::ServeReplica:{APP}:{deployment}"], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def counter(base_url: str, sample: str) -> float:
    return scrape_metrics(base_url).get(sample, 0.0)


# deployment -> (the router's worker label prefix, the replicas the deployment runs)
FULL_STRENGTH = {"DecodeServer": ("decode-", 2), "PrefillServer": ("prefill-", 1)}


def serving_replicas(base_url: str) -> dict[str, int]:
    """Replicas per deployment that the router hears from (its per-worker gauges):
    a replacement counts once it is up and reporting."""
    lines = metrics_text(base_url).splitlines()
    return {deployment: sum(line.startswith(f'pdserve_num_requests_running{{worker="{prefix}') for line in lines)
            for deployment, (prefix, _) in FULL_STRENGTH.items()}


class Killer(threading.Thread):
    """SIGKILLs one replica process every `every_s` seconds, in KILL_ORDER, until stopped;
    records (perf_counter time, deployment) of each kill. A kill waits until every
    replica is up and serving again (the last kill's replacement included), so
    each one hits a replica that carries traffic; `migrations_per_kill` holds the
    router's migration counter's increase from each kill to the next (or the end)."""

    def __init__(self, every_s: float, seed: int, base_url: str):
        super().__init__(daemon=True)
        self.every_s, self.rng, self.base_url = every_s, random.Random(seed), base_url
        self.kills: list[tuple[float, str]] = []
        self.migrations_per_kill: list[float] = []
        self.waited_s = 0.0   # time spent waiting for replacements before kills
        self.skipped = 0   # no live replica of the deployment (its replacement still starting)
        self.killed_pids: set[int] = set()
        self.seen_pids: set[int] = set()   # every replica process seen: one that vanished unkilled was restarted
        self.stop = threading.Event()

    def replicas_lost_unkilled(self) -> int:
        """Replica processes that ended although nobody killed them (Serve restarted a bystander)."""
        live = {pid for d in set(KILL_ORDER) for pid in replica_pids(d)}
        return len(self.seen_pids - live - self.killed_pids)

    def _full_strength(self) -> bool:
        """Waits (while not stopped) until every deployment serves with all its replicas."""
        started = time.perf_counter()
        while not self.stop.is_set():
            try:
                serving = serving_replicas(self.base_url)
            except Exception:  # noqa: BLE001 - the router itself may be restarting
                serving = {}
            if all(serving.get(d) == n for d, (_, n) in FULL_STRENGTH.items()):
                self.waited_s += time.perf_counter() - started
                return True
            self.stop.wait(0.5)
        return False

    def _migrations(self) -> float:
        try:
            return counter(self.base_url, "pdserve_request_migrations_total")
        except Exception:  # noqa: BLE001
            return float("nan")

    def run(self) -> None:
        turn, before = 0, None
        while not self.stop.wait(self.every_s) and self._full_strength():
            deployment = KILL_ORDER[turn % len(KILL_ORDER)]
            turn += 1
            for d in set(KILL_ORDER):
                self.seen_pids.update(replica_pids(d))
            pids = replica_pids(deployment)
            if not pids:
                self.skipped += 1
                continue
            victim = self.rng.choice(pids)
            now = self._migrations()
            if subprocess.run(["kill", "-9", str(victim)], check=False, capture_output=True).returncode != 0:
                self.skipped += 1          # it was gone already (Serve replacing it): no kill of ours
                continue
            self.killed_pids.add(victim)
            if before is not None:
                self.migrations_per_kill.append(now - before)
            before = now
            self.kills.append((time.perf_counter(), deployment))
            print(f"  killed a {deployment} replica at {time.strftime('%X')}", flush=True)
        if before is not None:
            self.migrations_per_kill.append(self._migrations() - before)


def run(base_url: str, requests, rate: float, *, concurrency: int | None = None, duration_s: float = 900):
    cfg = RunConfig(base_url=base_url, model="tiny", ignore_eos=True, request_rate=rate, max_concurrency=concurrency,
                    disable_tqdm=True, max_duration=duration_s, request_timeout=300)
    return asyncio.run(run_benchmark(requests, cfg))


def longest_pause_s(record) -> float:
    """The longest wait the client saw: for its first chunk, or between two."""
    return max([ttft(record) or 0.0, *itls(record)])


def pct(values: list[float], q: float) -> float | None:
    return percentile(sorted(values), q) if values else None


def latency_figures(records) -> dict:
    e2e = [e2el(r) for r in records]
    pauses = [longest_pause_s(r) for r in records]
    return {"count": len(records), "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
            "pause_p50_s": pct(pauses, 50), "pause_p99_s": pct(pauses, 99),
            "pause_max_s": max(pauses) if pauses else None}


def _describe_sent(record, start: float, kills: list[tuple[float, str]]) -> dict:
    """When a request was sent, against the kill before it."""
    before = [(t, d) for t, d in kills if t <= (record.send_time or 0.0)]
    last = before[-1] if before else None
    return {"sent_s": (record.send_time or start) - start,
            "since_kill_s": record.send_time - last[0] if last else None, "killed": last[1] if last else None}


def _describe(record, start: float, kills: list[tuple[float, str]]) -> dict:
    """One completed request's timing, against the kill before it was sent."""
    return {**_describe_sent(record, start, kills), "e2e_s": e2el(record), "ttft_s": ttft(record),
            "longest_pause_s": longest_pause_s(record)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=150.0)
    ap.add_argument("--kill-every-s", type=float, default=20.0)
    ap.add_argument("--baseline-s", type=float, default=40.0)
    ap.add_argument("--rate", type=float, default=None, help="req/s (default: half the measured capacity)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from engine.tiny_model import ensure_default_model
    model_dir = args.model or str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = {"model": {"path": model_dir, "served_model_name": "tiny"}, "mode": "disaggregated",
              "prefill": {"replicas": 1}, "decode": {"replicas": 2}, "resources": {"cpus_per_rank": 0.5},
              "kv_transfer": {"timeout_s": 10},
              # the chaos run sends the baseline's prompts again (their outputs are compared): with the
              # prefix cache on, its first requests would skip their prefill and look faster than the baseline
              "engine": {"enable_prefix_caching": False}}
    log_dir = Path(tempfile.mkdtemp(prefix="chaos-"))
    (log_dir / "chaos.yaml").write_text(yaml.safe_dump(config))
    results: dict = {"args": vars(args)}
    with served(log_dir / "chaos.yaml", free_port(), log_dir / "serve.log", 300) as url:
        run(url, random_dataset(tokenizer, num_prompts=8, input_len=INPUT_LEN, output_len=OUTPUT_LEN, seed=99), 4.0)
        rate = args.rate
        if rate is None:
            closed = run(url, random_dataset(tokenizer, num_prompts=32, input_len=INPUT_LEN, output_len=OUTPUT_LEN,
                                             seed=1), float("inf"), concurrency=8)
            rate = 0.5 * sum(r.succeeded for r in closed.records) / closed.duration
        results["rate_rps"] = rate
        n = max(8, round(rate * args.duration_s))
        requests = random_dataset(tokenizer, num_prompts=n, input_len=INPUT_LEN, output_len=OUTPUT_LEN,
                                  seed=args.seed + 7)
        n_base = min(n, max(8, round(rate * args.baseline_s)))
        print(f"== baseline: {n_base} requests at {rate:.2f} req/s, no failures", flush=True)
        baseline = run(url, requests[:n_base], rate)
        undisturbed = {r.index: r.text for r in baseline.records if r.succeeded}
        migrations_before = counter(url, "pdserve_request_migrations_total")
        print(f"== chaos: {n} requests at {rate:.2f} req/s, a replica killed every {args.kill_every_s:g} s",
              flush=True)
        killer = Killer(args.kill_every_s, args.seed, url)
        killer.start()
        try:
            chaos = run(url, requests, rate)
        finally:
            killer.stop.set()
            killer.join()
        migrations = counter(url, "pdserve_request_migrations_total") - migrations_before
        bystanders_restarted = killer.replicas_lost_unkilled()
    kill_times = [t for t, _ in killer.kills]
    done = [r for r in chaos.records if r.succeeded]
    lost = [r for r in chaos.records if not r.succeeded]
    affected = [r for r in done if any(r.send_time <= t <= r.end_time for t in kill_times)]
    unaffected = [r for r in done if r not in affected]
    compared = [r for r in done if r.index in undisturbed]
    equal = sum(r.text == undisturbed[r.index] for r in compared)
    results.update({
        "kills": [{"t_s": t - chaos.records[0].send_time if chaos.records else 0.0, "deployment": d}
                  for t, d in killer.kills],
        "kills_skipped": killer.skipped, "bystanders_restarted": bystanders_restarted,
        "migrations_per_kill": killer.migrations_per_kill, "waited_for_replacements_s": killer.waited_s,
        "sent": len(chaos.records), "completed": len(done), "lost": len(lost),
        "lost_errors": sorted({(r.status, (r.error or "")[:200]) for r in lost}), "migrations": migrations,
        "lost_requests": [{**_describe_sent(r, chaos.records[0].send_time, killer.kills),
                           "chunks": len(r.chunk_times)} for r in lost],
        "affected": latency_figures(affected), "unaffected": latency_figures(unaffected),
        "baseline": latency_figures([r for r in baseline.records if r.succeeded]),
        "outputs_equal_to_undisturbed": [equal, len(compared)],
        "slowest": [_describe(r, chaos.records[0].send_time, killer.kills) for r in
                    sorted(done, key=e2el)[-10:]]})
    print(f"\nkills: {len(killer.kills)} ({', '.join(d for _, d in killer.kills)}); skipped {killer.skipped}; "
          f"replicas that ended without being killed: {bystanders_restarted}")
    print(f"requests: sent {len(chaos.records)}, completed {len(done)}, lost {len(lost)} (target 0); "
          f"migrations {migrations:.0f} (per kill, in order: {', '.join(f'{m:.0f}' for m in killer.migrations_per_kill)})")
    decode_kills = sum(d == "DecodeServer" for _, d in killer.kills)
    if decode_kills and not migrations:
        print(f"warning: {decode_kills} decode replicas were killed and no request moved: the kills hit no "
              "request mid-stream, so this run does not test migration")
    for name in ("baseline", "unaffected", "affected"):
        f = results[name]
        if f["count"]:
            print(f"  {name:>10}: {f['count']:4d} requests, e2e p50 {f['e2e_p50_s']:.2f} s p99 {f['e2e_p99_s']:.2f} s,"
                  f" longest pause p50 {f['pause_p50_s'] * 1000:.0f} ms p99 {f['pause_p99_s'] * 1000:.0f} ms")
    if affected and unaffected:
        extra = statistics.median(e2el(r) for r in affected) - results["unaffected"]["e2e_p50_s"]
        results["extra_latency_p50_s"] = extra
        print(f"extra latency of requests in flight at a kill (median against the others): {extra:.2f} s")
    print(f"outputs equal to the undisturbed run: {equal}/{len(compared)}")
    for status, error in results["lost_errors"]:
        print(f"  lost: {status} {error}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0 if not lost else 1


if __name__ == "__main__":
    sys.exit(main())
