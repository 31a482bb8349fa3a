"""The goodput autoscaler against every static prefill/decode split of the same
budget, on one phased workload, in the simulator.

    python bench/autoscale.py [--model llama-3-70b] [--gpu H100-SXM] [--gpus 8] [--tp 2]
                              [--slo ttft:1000 tpot:50] [--predictors ewma,constant,trend]
                              [--starts planned,even] [--seed 0] [--admission]
                              [--json bench/results/autoscale.json] [--plot bench/results/autoscale.png]

Workload (Poisson arrivals, lengths +-25%), five phases of 60 s:
  chat          ~1k-token prompts, ~256-token outputs, at 80% of what the budget serves
  long prompts  ~3k-token prompts, ~128-token outputs, 80%
  long outputs  ~300-token prompts, ~1k-token outputs, 80%
  quiet         chat at 20%
  burst         chat at 100%
"What the budget serves" is the best split's capacity at the SLOs
(cluster/autoscaler/capacity.py), so each phase fits the budget with its own
best split.

Every system serves the same requests: the autoscaler with each load
predictor from each first split of --starts (replicas ready 30 s after they
are asked for) and each static split
P prefill + D decode replicas of TP `--tp` with (P + D) * tp = --gpus. For
each: goodput (requests meeting both SLOs per second of the run), SLO
attainment, the requests within both SLOs by the phase they arrived in, and
GPU-seconds (replica-seconds times TP, a starting replica included). Prints
a table and the ratio of the autoscaler to the best static split; writes JSON
and a PNG timeline (rate, replicas per role, attainment) of the first
predictor from the first start. A start is `even` (half the slots
each way), `planned` (the best split for the first phase's traffic, what
`pdserve plan` answers for it: a deployment planned for the traffic it
expects) or a split such as `1P+3D`.
With `--admission` every system runs behind the router's admission control
at the SLOs (as `pdserve serve --slo` does): a request predicted to miss is
refused (a 429, counted against the system's attainment) instead of queued,
and the autoscaler sees the refusals.
Step times: the roofline of --model on --gpu (cluster/perf_model/roofline.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.loadtest.metrics import meets_slos, summarize  # noqa: E402
from cluster.autoscaler.capacity import ReplicaLimits, decode_capacity, prefill_seconds  # noqa: E402
from cluster.autoscaler.policy import AutoscaleSettings, GoodputPolicy  # noqa: E402
from cluster.cli.plan_command import resolve_model_dir  # noqa: E402
from cluster.cli.plan_goodput import parse_slo  # noqa: E402
from cluster.planner.search import Candidate, roofline_spec_builder  # noqa: E402
from cluster.simulator.autoscaling import SimAutoscaler  # noqa: E402
from cluster.simulator.cluster_sim import simulate  # noqa: E402
from engine.model import ModelConfig  # noqa: E402
from router.admission import AdmissionSettings  # noqa: E402

PHASE_S = 60.0
# (name, prompt tokens, output tokens, share of what the best split of the budget serves at these lengths)
PHASES = (("chat", 1000, 256, 0.8), ("long prompts", 3000, 128, 0.8), ("long outputs", 300, 1000, 0.8),
          ("quiet", 1000, 256, 0.2), ("burst", 1000, 256, 1.0))


def phase_prefill_capacity(model, prompt_len: float, ttft_s: float) -> float:
    """What the phases' rates count one prefill replica to serve: the rate at
    which an M/D/1 queue's mean TTFT is 80% of the SLO. The workload's own
    definition, fixed so that runs of different policies compare; the policy's
    capacity (cluster/autoscaler/capacity.py) holds the 90th percentile instead."""
    s = prefill_seconds(model, prompt_len)
    budget = 0.8 * ttft_s
    if s >= budget:
        return 0.0
    x = (budget - s) / s
    return (2 * x / (1 + 2 * x)) / s


def phase_rates(prefill_model, decode_model, limits: ReplicaLimits, phases, ttft_s: float, tpot_s: float,
                slots: int, scale: float = 1.0, phase_s: float = PHASE_S) -> list[dict]:
    """Each phase of `phases` ((name, prompt, output, share), `phase_s` each) with
    its rate: `share` x the most that any split of `slots` one-rank replicas
    serves at its lengths (the narrower pool's capacity at 80% of the SLOs'
    means) x `scale`, so every phase fits the budget, each with its own best
    split."""
    out, start = [], 0.0
    for name, prompt, output, share in phases:
        cap_p = phase_prefill_capacity(prefill_model, prompt, ttft_s)
        cap_d = decode_capacity(decode_model, prompt, output, 0.8 * tpot_s, limits)
        best_p = max(range(1, slots), key=lambda p: min(p * cap_p, (slots - p) * cap_d))
        rate = share * scale * min(best_p * cap_p, (slots - best_p) * cap_d)
        out.append({"name": name, "start_s": start, "rate": rate, "prompt": prompt, "output": output,
                    "best_split": f"{best_p}P+{slots - best_p}D"})
        start += phase_s
    return out


def workload(spec, ttft_s: float, tpot_s: float, slots: int, seed: int):
    """(lengths, arrivals, phases): PHASES at phase_rates on `spec`'s step
    models, Poisson arrivals, lengths +-25% around each phase's."""
    rng = random.Random(seed)
    limits = ReplicaLimits(spec.decode.max_num_seqs, spec.decode.num_kv_blocks, spec.decode.block_size)
    phases = phase_rates(spec.prefill.model, spec.decode.model, limits, PHASES, ttft_s, tpot_s, slots)
    lengths, arrivals = [], []
    for phase in phases:
        t, end = phase["start_s"], phase["start_s"] + PHASE_S
        while (t := t + rng.expovariate(phase["rate"])) <= end:
            lengths.append((max(1, round(phase["prompt"] * rng.uniform(0.75, 1.25))),
                            max(1, round(phase["output"] * rng.uniform(0.75, 1.25)))))
            arrivals.append(t)
    return lengths, arrivals, phases


def score(result, slos_ms: dict, duration: float, tp: int) -> dict:
    records = result.records()
    summary = summarize(records, num_requests=len(records), duration=duration, slos_ms=slos_ms, percentiles=[90])
    good = summary.good or 0
    per_phase = _per_phase_counts([r.scheduled_offset for r in records if meets_slos(r, slos_ms)])
    return {"goodput": good / duration, "attainment": good / max(1, len(records)), "good_per_phase": per_phase,
            "gpu_seconds": sum(result.replica_seconds.values()) * tp,
            "ttft_p90_ms": summary.latency["ttft"].percentiles.get(90),
            "tpot_p90_ms": summary.latency["tpot"].percentiles.get(90),
            "refused": sum(result.refusals.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3-70b")
    ap.add_argument("--gpu", default="H100-SXM")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--slo", nargs=2, type=parse_slo, default=[("ttft", 1000.0), ("tpot", 50.0)])
    ap.add_argument("--predictors", default="ewma,constant,trend",
                    help="load predictors to run the autoscaler with (the first one is plotted)")
    ap.add_argument("--startup-s", type=float, default=30.0)
    ap.add_argument("--interval-s", type=float, default=10.0)
    ap.add_argument("--downscale-window-s", type=float, default=AutoscaleSettings.downscale_window_s,
                    help="a scale-down must hold the load of every interval of this window (0: the latest)")
    ap.add_argument("--starts", default="planned,even",
                    help="the autoscaler's first splits, each run in turn: even, planned, or PP+DD (e.g. 1P+3D)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--admission", action="store_true",
                    help="run every system behind the router's admission control at the SLOs")
    args = ap.parse_args()
    slos_ms = dict(args.slo)
    mc = ModelConfig.from_pretrained(resolve_model_dir(args.model))
    build = roofline_spec_builder(mc, gpu=args.gpu, dtype="bfloat16", max_model_len=8192)
    slots = args.gpus // args.tp
    even = max(1, slots // 2)
    base, why = build(Candidate("disaggregated", even, args.tp, slots - even, args.tp))
    if base is None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    starts = args.starts.split(",")
    for start in starts:
        if start not in ("even", "planned") and not _parse_split(start, slots):
            print(f"error: --starts: {start!r} is not even, planned or a split PP+DD of {slots} slots "
                  f"(e.g. 1P+{slots - 1}D)", file=sys.stderr)
            return 2
    ttft_s, tpot_s = slos_ms["ttft"] / 1000, slos_ms["tpot"] / 1000
    lengths, arrivals, phases = workload(base, ttft_s, tpot_s, slots, args.seed)
    admission = AdmissionSettings(ttft_slo_s=ttft_s, tpot_slo_s=tpot_s) if args.admission else None
    base = dataclasses.replace(base, admission=admission)
    duration = PHASE_S * len(PHASES)
    print(f"{args.model} on {args.gpus} x {args.gpu}, TP{args.tp} replicas, SLOs TTFT <= {slos_ms['ttft']:.0f} ms, "
          f"TPOT <= {slos_ms['tpot']:.0f} ms; {len(lengths)} requests over {duration:.0f} s")
    for p in phases:
        print(f"  {p['name']:<13} from {p['start_s']:5.0f} s: {p['rate']:.2f} req/s, ~{p['prompt']} -> "
              f"~{p['output']} tokens (best split {p['best_split']})")
    specs = {p: dataclasses.replace(build(Candidate("disaggregated", p, args.tp, slots - p, args.tp))[0],
                                    admission=admission)
             for p in range(1, slots)}     # one per split, static or the autoscaler's first
    rows = {}
    for p_count, spec in specs.items():
        rows[f"static {p_count}P+{slots - p_count}D"] = score(simulate(spec, lengths, arrivals), slos_ms, duration,
                                                              args.tp)
    limits = {r: ReplicaLimits(base.decode.max_num_seqs, base.decode.num_kv_blocks, base.decode.block_size)
              for r in ("prefill", "decode")}
    timelines = {}
    first_splits = {"even": f"{even}P+{slots - even}D", "planned": phases[0]["best_split"]}
    for start, predictor in [(st, pr) for st in starts for pr in args.predictors.split(",")]:
        split = first_splits.get(start, start)
        first = specs[_parse_split(split, slots)[0]]
        settings = AutoscaleSettings(ttft_slo_s=ttft_s, tpot_slo_s=tpot_s, budget=args.gpus,
                                     tensor_parallel={"prefill": args.tp, "decode": args.tp},
                                     interval_s=args.interval_s, startup_s=args.startup_s, predictor=predictor,
                                     downscale_window_s=args.downscale_window_s)
        scaler = SimAutoscaler(GoodputPolicy(settings, {"prefill": base.prefill.model,
                                                        "decode": base.decode.model}, limits))
        auto = simulate(first, lengths, arrivals, autoscaler=scaler)
        name = f"{predictor}, from {split}" + (", planned" if start == "planned" else "")
        rows[f"autoscaled ({name})"] = score(auto, slos_ms, duration, args.tp)
        timelines[name] = auto.timeline
    best_name = max((n for n in rows if n.startswith("static")), key=lambda n: rows[n]["goodput"])
    best = rows[best_name]
    chosen = next(iter(timelines))
    width = max(len(n) for n in rows)
    print(f"\n{'system':<{width}} {'goodput req/s':>13} {'SLO met':>8} {'GPU-s':>8} {'TTFT p90':>9} {'TPOT p90':>9} "
          f"{'refused':>8}")
    for name, r in rows.items():
        print(f"{name:<{width}} {r['goodput']:13.2f} {r['attainment']:8.0%} {r['gpu_seconds']:8.0f} "
              f"{r['ttft_p90_ms'] or 0:9.0f} {r['tpot_p90_ms'] or 0:9.1f} {r['refused']:8d}")
    print(f"\nrequests within both SLOs, by the phase they arrived in (of {_per_phase_counts(arrivals)}):")
    print(f"{'system':<{width}} " + " ".join(f"{p['name']:>13}" for p in phases))
    for name, r in rows.items():
        print(f"{name:<{width}} " + " ".join(f"{n:13d}" for n in r["good_per_phase"]))
    print()
    for name, a in rows.items():
        if name.startswith("autoscaled"):
            print(f"{name} vs the best static split ({best_name}): goodput x{a['goodput'] / best['goodput']:.2f}, "
                  f"GPU-seconds x{a['gpu_seconds'] / best['gpu_seconds']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "phases": phases, "systems": rows,
                                               "timelines": timelines, "best_static": best_name}, indent=2))
    if args.plot:
        plot(timelines[chosen], phases, args.plot, f"{args.model}, {args.gpus} x {args.gpu}, autoscaled ({chosen})")
    return 0


def _per_phase_counts(arrivals: list[float]) -> list[int]:
    """How many of `arrivals` (offsets, s) fall in each phase."""
    counts = [0] * len(PHASES)
    for t in arrivals:
        counts[min(len(PHASES) - 1, int(t // PHASE_S))] += 1
    return counts


def _parse_split(split: str, slots: int) -> tuple[int, int] | None:
    """(prefill, decode) replicas of a split written `PP+DD` that fills `slots`, else None."""
    p, plus, d = split.upper().partition("P+")
    if not plus or not d.endswith("D") or not p.isdigit() or not d[:-1].isdigit():
        return None
    p, d = int(p), int(d[:-1])
    return (p, d) if p >= 1 and d >= 1 and p + d == slots else None


def plot(timeline: list[dict], phases: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = [e["time_s"] for e in timeline]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    axes[0].plot(t, [e["rate"] for e in timeline], label="measured")
    axes[0].plot(t, [e["predicted_rate"] for e in timeline], "--", label="predicted")
    axes[0].set_ylabel("req/s")
    axes[0].legend()
    for role in ("prefill", "decode"):
        axes[1].step(t, [e["running"][role] for e in timeline], where="post", label=f"{role} serving")
        axes[1].step(t, [e["targets"][role] for e in timeline], ":", where="post", label=f"{role} target")
    axes[1].set_ylabel("replicas")
    axes[1].legend(fontsize=7)
    axes[2].plot(t, [e["attainment"] if e["attainment"] is not None else float("nan") for e in timeline])
    axes[2].set_ylabel("SLO met")
    axes[2].set_xlabel("s")
    for ax in axes:
        for p in phases:
            ax.axvline(p["start_s"], color="grey", lw=0.5)
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
