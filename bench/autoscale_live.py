"""The goodput autoscaler against each static split of the same budget, served
live by `pdserve serve` on this machine, one phased workload, one run.

    python bench/autoscale_live.py [--budget 3] [--phase-s 60] [--slo ttft:1000 tpot:100]
                                   [--served-factor 1.25] [--model DIR] [--profile FILE]
                                   [--json bench/results/autoscale_live.json] [--plot PNG]

Checkpoint: the "bench" preset (~30M-parameter Llama, fp32). Workload: the
phases of bench/autoscale.py (the simulator's scenario) at lengths this CPU
serves within the SLOs, Poisson arrivals, lengths +-20%, --phase-s each:
  chat          ~300-token prompts,  64 output tokens, at 80% of what the budget serves
  long prompts  ~900-token prompts,  16 output tokens, 80%
  long outputs  ~200-token prompts, 256 output tokens, 80%
  quiet         chat at 20%
  burst         chat at 100%
"What the budget serves" is bench/autoscale.py's phase_rates on the engine's
own one-thread profile of this machine (`pdserve profile`'s code, in
process: ~10 s; --profile keeps it for the next run, so runs share rates),
times the machine's cores over the budget's ranks (the ranks share the
cores), over --served-factor (served engine steps run 1.1-1.4x their
profiled time under load, bench/simulator_accuracy.py), so the rates follow
the machine's speed. Greedy, ignore_eos, streamed
(bench/loadtest). Systems, one at a time, each a fresh `pdserve serve` on a
local cluster (disaggregation policy "always", so a prompt runs on a prefill
worker and the roles stay apart):
  static kP+(budget-k)D for every k, and
  autoscaled: starting at the split that suits the first phase, budget
  --budget ranks, interval 5 s, start-up horizon 15 s, scale-down cool-down 15 s,
  the step model fitted to the workers' own steps.
Every system has the same `slo:` section, so admission control refuses (429)
by the same rules in each; refusals are counted apart from failures.
For each: goodput (requests meeting both SLOs per second of the run),
attainment, TTFT/TPOT p90, and replica-seconds (the autoscaled run reads the
replicas serving from /metrics every second: their mean times the run's
duration; a static split holds all of its replicas for the whole run). On 2
cores the replicas share the cores, so a replica more of one role takes CPU
from the others: what moves is which role the cores work for.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import os
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.loadtest.datasets import random_dataset  # noqa: E402
from bench.loadtest.metrics import meets_slos, summarize  # noqa: E402
from bench.loadtest.runner import RunConfig, run_benchmark  # noqa: E402
from bench.serving_overhead import ServerFailed, served  # noqa: E402
from cluster.cli.plan_goodput import parse_slo  # noqa: E402
from engine.tp_group import free_port  # noqa: E402


# (name, prompt tokens, output tokens, share of what the budget serves): bench/autoscale.py's
# phases at lengths a CPU engine prefills well within a 1 s TTFT
LIVE_PHASES = (("chat", 300, 64, 0.8), ("long prompts", 900, 16, 0.8), ("long outputs", 200, 256, 0.8),
               ("quiet", 300, 64, 0.2), ("burst", 300, 64, 1.0))


def live_phases(model_dir: str, args) -> list[dict]:
    """LIVE_PHASES with their rates (module doc) on this machine's one-thread profile."""
    from bench.autoscale import phase_rates
    from bench.simulator_accuracy import profile_for
    from cluster.autoscaler.capacity import ReplicaLimits
    from cluster.perf_model.step_shape import load_step_model
    saved = Path(args.profile) if args.profile else None
    profiles: dict = {"1": json.loads(saved.read_text())} if saved is not None and saved.exists() else {}
    profile_for(model_dir, 1, profiles)
    if saved is not None and not saved.exists():
        saved.write_text(json.dumps(profiles["1"]))
    model = load_step_model(profiles["1"])
    slo = dict(args.slo)
    scale = min(1.0, (os.cpu_count() or 1) / args.budget) / args.served_factor
    return phase_rates(model, model, ReplicaLimits(), LIVE_PHASES, slo["ttft"] / 1000, slo["tpot"] / 1000,
                       args.budget, scale=scale, phase_s=args.phase_s)


def workload(tokenizer, phases: list[dict], args):
    """(requests, send offsets): each phase's Poisson arrivals at its rate."""
    rng = random.Random(args.seed)
    requests, offsets = [], []
    for i, phase in enumerate(phases):
        times, t, end = [], phase["start_s"], phase["start_s"] + args.phase_s
        while (t := t + rng.expovariate(phase["rate"])) < end:
            times.append(t)
        requests += random_dataset(tokenizer, num_prompts=len(times), input_len=phase["prompt"],
                                   output_len=phase["output"], range_ratio=0.2, seed=args.seed + i)
        offsets += times
    return requests, offsets


def deployment(args, model_dir: str, prefill: int, decode: int, autoscale: bool) -> dict:
    config = {"model": {"path": model_dir, "served_model_name": "bench"},
              "prefill": {"replicas": prefill}, "decode": {"replicas": decode},
              "disaggregation": {"policy": "always"}}
    slo = dict(args.slo)      # every system: the SLOs also set what admission control refuses
    config["slo"] = {"ttft_ms": slo["ttft"], "tpot_ms": slo["tpot"]}
    if autoscale:
        config["autoscaling"] = {"enabled": True, "budget": args.budget, "interval_s": 5, "startup_s": 15,
                                 "downscale_cooldown_s": 15}
        if args.downscale_window_s is not None:
            config["autoscaling"]["downscale_window_s"] = args.downscale_window_s
    return config


def replicas_watcher(base_url: str, stop: threading.Event, samples: list) -> None:
    """Every second: the replicas serving per role, from the router's /metrics."""
    while not stop.is_set():
        try:
            text = urllib.request.urlopen(base_url + "/metrics", timeout=5).read().decode()
            running = {m.group(1): float(m.group(2)) for m in
                       re.finditer(r'^pdserve_autoscaler_current_replicas\{role="(\w+)"\} ([0-9.]+)$', text, re.M)}
            targets = {m.group(1): float(m.group(2)) for m in
                       re.finditer(r'^pdserve_autoscaler_target_replicas\{role="(\w+)"\} ([0-9.]+)$', text, re.M)}
            samples.append({"time_s": time.monotonic(), "running": running, "targets": targets})
        except OSError:
            pass
        stop.wait(1.0)


# admission control's refusal messages (router/admission.py), by the SLO or bound they protect
REFUSAL_KINDS = (("a decode step is predicted", "tpot"), ("predicted time to first token", "ttft"),
                 ("faster than this server prefills", "overload"))


def phase_figures(records, phases: list[dict], slos_ms: dict) -> dict:
    """Per phase (by each request's scheduled send time): requests sent, those
    meeting both SLOs, and refusals (429) by kind with their send times (s)."""
    starts = [p["start_s"] for p in phases]
    out = {p["name"]: {"sent": 0, "met": 0, "refused": {}, "refused_at_s": []} for p in phases}
    for r in records:
        fig = out[phases[bisect.bisect_right(starts, r.scheduled_offset) - 1]["name"]]
        fig["sent"] += 1
        fig["met"] += bool(r.succeeded and meets_slos(r, slos_ms))
        if r.status == 429:
            kind = next((k for text, k in REFUSAL_KINDS if text in (r.error or "")), "queue")
            fig["refused"][kind] = fig["refused"].get(kind, 0) + 1
            fig["refused_at_s"].append(round(r.scheduled_offset, 1))
    return out


BIN_S = 10.0


def attainment_bins(records, slos_ms: dict, duration_s: float) -> list[dict]:
    """Per BIN_S of scheduled send time: requests sent and those meeting both SLOs."""
    bins = [{"start_s": i * BIN_S, "sent": 0, "met": 0} for i in range(math.ceil(duration_s / BIN_S))]
    for r in records:
        b = bins[min(len(bins) - 1, int(r.scheduled_offset // BIN_S))]
        b["sent"] += 1
        b["met"] += bool(r.succeeded and meets_slos(r, slos_ms))
    return bins


def autoscaled_replica_seconds(samples: list[dict], deployed: int, duration_s: float) -> float:
    """The mean replicas held over the samples (about one a second) times the run's
    duration: per role the more of those serving and those asked for, so a replica
    still starting (asked for, not yet serving) and one draining (serving, no
    longer asked for) count, as a static split's replicas count all the time (only
    those serving: every re-split came out a start-up's worth cheaper). A sample
    from before the autoscaler's first decision (no figures in /metrics yet)
    counts the pools as deployed."""
    counts = [sum(max(s["running"].get(r, 0.0), s["targets"].get(r, 0.0))
                  for r in set(s["running"]) | set(s["targets"])) or deployed for s in samples]
    return (sum(counts) / len(counts) if counts else deployed) * duration_s


def run_system(name: str, config: dict, requests, offsets, phases, args, tokenizer, log_dir: Path) -> dict:
    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = log_dir / f"{name}.log"
    print(f"== {name}: pdserve serve --config {path} (log {log})", flush=True)
    samples: list = []
    stop = threading.Event()
    try:
        with served(path, free_port(), log, 300) as base_url:
            time.sleep(5)
            threading.Thread(target=replicas_watcher, args=(base_url, stop, samples), daemon=True).start()
            cfg = RunConfig(base_url=base_url, model="bench", ignore_eos=True,
                            max_duration=args.phase_s * (len(phases) + 1), disable_tqdm=True)
            result = asyncio.run(run_benchmark(requests, cfg, tokenizer=tokenizer, offsets=offsets))
            stop.set()
    except ServerFailed as exc:
        print(f"  failed: {exc}", flush=True)
        return {"error": str(exc)}
    finally:
        stop.set()
    slos_ms = dict(args.slo)
    summary = summarize(result.records, num_requests=len(requests), duration=result.duration, slos_ms=slos_ms,
                        percentiles=[90])
    good = summary.good or 0
    deployed = config["prefill"]["replicas"] + config["decode"]["replicas"]
    if config.get("autoscaling"):
        start = samples[0]["time_s"] if samples else 0.0
        replica_s = autoscaled_replica_seconds(samples, deployed, result.duration)
        timeline = [{**s, "time_s": s["time_s"] - start} for s in samples]
    else:
        replica_s = deployed * result.duration
        timeline = []
    # admission control's answers (429 + Retry-After) are refusals, not lost requests
    failures = {error: n for error, n in summary.error_counts.items() if not error.startswith("HTTP 429")}
    refused = summary.failed - sum(failures.values())
    row = {"phases": phase_figures(result.records, phases, slos_ms),
           "bins": attainment_bins(result.records, slos_ms, args.phase_s * len(phases)),
           "goodput": good / result.duration, "attainment": good / max(1, len(requests)),
           "failed": summary.failed, "refused": refused, "errors": summary.error_counts,
           "duration_s": result.duration, "replica_seconds": replica_s,
           "ttft_p90_ms": summary.latency["ttft"].percentiles.get(90),
           "tpot_p90_ms": summary.latency["tpot"].percentiles.get(90), "timeline": timeline}
    for name, fig in row["phases"].items():
        print(f"  {name}: {fig['met']}/{fig['sent']} met SLOs, refused {fig['refused']}", flush=True)
    print(f"  goodput {row['goodput']:.2f} req/s ({row['attainment']:.0%} met), refused {refused} (429), "
          f"failed {sum(failures.values())}, "
          f"replica-s {replica_s:.0f}, TTFT p90 {row['ttft_p90_ms']:.0f} ms, TPOT p90 {row['tpot_p90_ms']:.1f} ms",
          flush=True)
    for error, count in failures.items():
        print(f"  {count} failed: {error}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=3)
    ap.add_argument("--phase-s", type=float, default=60.0)
    ap.add_argument("--slo", nargs=2, type=parse_slo, default=[("ttft", 1000.0), ("tpot", 100.0)])
    ap.add_argument("--served-factor", type=float, default=1.25,
                    help="served over profiled engine step time the phases' rates allow for")
    ap.add_argument("--model", default=None)
    ap.add_argument("--profile", default=None,
                    help="the one-thread profile the rates come from: read if the file exists, else written")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--downscale-window-s", type=float, default=None,
                    help="autoscaling.downscale_window_s (default: the server's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="a PNG timeline: rate, the autoscaler's replicas, SLO attainment")
    ap.add_argument("--static", action=argparse.BooleanOptionalAction, default=True,
                    help="also serve every static split (--no-static: the autoscaled system alone)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from engine.tiny_model import ensure_preset_model
    model_dir = args.model or str(ensure_preset_model("bench"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    phases = live_phases(model_dir, args)
    requests, offsets = workload(tokenizer, phases, args)
    print(f"{len(requests)} requests over {args.phase_s * len(phases):.0f} s; budget {args.budget} ranks; SLOs "
          f"{dict(args.slo)} ms", flush=True)
    for p in phases:
        print(f"  {p['name']:<13} from {p['start_s']:4.0f} s: {p['rate']:.2f} req/s, ~{p['prompt']} -> "
              f"~{p['output']} tokens (best split by the profile: {p['best_split']})", flush=True)
    rows = {}
    log_dir = Path(tempfile.mkdtemp(prefix="autoscale-live-"))
    for k in range(1, args.budget if args.static else 1):
        rows[f"static {k}P+{args.budget - k}D"] = run_system(
            f"static-{k}p{args.budget - k}d", deployment(args, model_dir, k, args.budget - k, False),
            requests, offsets, phases, args, tokenizer, log_dir)
    rows["autoscaled"] = run_system("autoscaled", deployment(args, model_dir, args.budget - 1, 1, True),
                                    requests, offsets, phases, args, tokenizer, log_dir)
    ok = {n: r for n, r in rows.items() if "error" not in r}
    statics = [n for n in ok if n.startswith("static")]
    if statics and "autoscaled" in ok:
        best = max(statics, key=lambda n: ok[n]["goodput"])
        a, b = ok["autoscaled"], ok[best]
        print(f"autoscaled vs the best static split ({best}): goodput x{a['goodput'] / b['goodput']:.2f}, "
              f"replica-seconds x{a['replica_seconds'] / b['replica_seconds']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "phases": phases,
                                               "systems": rows}, indent=2, default=str))
    if args.plot and "autoscaled" in ok:
        plot(ok, phases, args.plot)
    return 0


def plot(rows: dict, phases: list[dict], path: str) -> None:
    """Sent rate and each phase's, the autoscaler's replicas serving per role,
    and every system's SLO attainment per BIN_S of send time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    bins = rows["autoscaled"]["bins"]
    mids = [b["start_s"] + BIN_S / 2 for b in bins]
    axes[0].plot(mids, [b["sent"] / BIN_S for b in bins], label="sent")
    axes[0].step([p["start_s"] for p in phases], [p["rate"] for p in phases], ":", where="post", label="phase rate")
    axes[0].set_ylabel("req/s")
    axes[0].legend(fontsize=7)
    timeline = rows["autoscaled"]["timeline"]
    for role in ("prefill", "decode"):
        axes[1].step([e["time_s"] for e in timeline], [e["running"].get(role, float("nan")) for e in timeline],
                     where="post", label=f"autoscaled: {role} serving")
    axes[1].set_ylabel("replicas")
    axes[1].legend(fontsize=7)
    for name, row in rows.items():
        axes[2].plot(mids, [b["met"] / b["sent"] if b["sent"] else float("nan") for b in row["bins"]], label=name)
    axes[2].set_ylabel("SLO met")
    axes[2].set_xlabel("s")
    axes[2].legend(fontsize=7)
    for ax in axes:
        for p in phases:
            ax.axvline(p["start_s"], color="grey", lw=0.5)
    axes[0].set_title("bench preset served live on this machine: " + ", ".join(p["name"] for p in phases))
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
