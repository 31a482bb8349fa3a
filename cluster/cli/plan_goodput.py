"""`pdserve plan --slo ...`: the goodput search (cluster/planner) from the
command line: the table of every candidate that fits, the best of each mode,
and a deployment file for the winner.

    pdserve plan --model M --slo ttft:MS tpot:MS --gpus N --gpu-type T
                 [--random-input-len L --random-output-len L --random-range-ratio R --num-prompts N]
                 [--max-prompts N --refine-top K --rate-tolerance T] [--jobs N]
                 [--profile PROFILE.json] [--policy always|conditional] [--attainment 0.9]
                 [--write-config FILE] [--json]

Every candidate is screened on --num-prompts simulated requests; the
--refine-top best of each mode are then simulated on 2x, 4x, ... as many until
their rate settles within --rate-tolerance (at most --max-prompts requests): a
short run overstates what a configuration sustains. --jobs simulates that many
candidates at once (default: every core).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from cluster.cli.output_file import output_problem, write_output
from engine.cpu_count import usable_cpus


def parse_slo(text: str) -> tuple[str, float]:
    key, sep, value = text.partition(":")
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not sep or key not in ("ttft", "tpot") or not 0 < ms < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected ttft:MS or tpot:MS with MS > 0, e.g. --slo ttft:1000 "
                                         "tpot:50")
    return key, ms


MAX_PLAN_GPUS = 256


class SloAction(argparse.Action):
    """--slo KEY:MS ...: ttft and tpot at most once each (a second one silently won)."""

    def __call__(self, parser, namespace, values, option_string=None):
        keys = [key for key, _ in values]
        if len(set(keys)) < len(keys):
            parser.error(f"{option_string}: give each of ttft and tpot at most once, got "
                         f"{' '.join(f'{key}:{ms:g}' for key, ms in values)}")
        setattr(namespace, self.dest, values)


def unused_slo_problem(config, autoscale: bool = False) -> str | None:
    """Why --slo would do nothing in `config` (`autoscale`: --autoscale given beside it, where
    it is not in `config` already), or None: admission control and the autoscaler are what serve it."""
    if config.admission.enabled or autoscale or config.autoscaling.enabled:
        return None
    return ("--slo sets the SLOs admission control and the autoscaler serve, and both are off here: enable "
            "admission (admission.enabled) or add --autoscale, or drop --slo")


def load_profile(path: str, flag: str):
    """The step-time profile `flag` names; ValueError naming the flag where it cannot be read."""
    from cluster.perf_model import load_step_model
    try:
        return load_step_model(path)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None


def run_goodput_plan(args: argparse.Namespace, model_dir, model) -> int:
    from cluster.config import AdmissionSection, SloSection
    from cluster.perf_model.roofline import GPU_SPECS
    from cluster.perf_model.step_shape import profile_model_problem, profile_tp
    from cluster.planner.search import Workload, roofline_spec_builder, search, unbounded
    from engine.memory_planner import (
        resolve_dtype,
        resolve_gpu_type,
        valid_tps,
    )

    try:
        gpu = resolve_gpu_type(args.gpu_type).name
        dtype = resolve_dtype(model, args.dtype)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if gpu not in GPU_SPECS:
        print(f"error: --gpu-type {gpu} has no roofline spec", file=sys.stderr)
        return 2
    if args.gpus is None or args.gpus < 1:
        print("error: --slo needs --gpus N (the GPU budget, N >= 1)", file=sys.stderr)
        return 2
    if args.gpus > MAX_PLAN_GPUS:   # every split of the budget is simulated: past this, hours with nothing said
        print(f"error: --gpus {args.gpus}: the search simulates every split of the budget, at most "
              f"{MAX_PLAN_GPUS} GPUs; plan one model's replica set (e.g. a node's 8 GPUs) and repeat it",
              file=sys.stderr)
        return 2
    if args.gpu_memory_gib is not None and not args.gpu_memory_gib > 0 or not 0 < args.gpu_memory_utilization <= 1:
        print("error: --gpu-memory-gib must be > 0 and --gpu-memory-utilization in (0, 1]", file=sys.stderr)
        return 2
    if args.write_config and (problem := output_problem(Path(args.write_config))):   # before the search
        print(f"error: --write-config {args.write_config} cannot be written: {problem}", file=sys.stderr)
        return 2
    if args.num_prompts < 1 or args.refine_top < 0 or not 0 < args.rate_tolerance < 1 or args.jobs < 1:
        print("error: --num-prompts and --jobs must be >= 1, --refine-top >= 0 and --rate-tolerance in (0, 1)",
              file=sys.stderr)
        return 2
    tps = [t for t in valid_tps(model) if t <= args.gpus]
    models = None
    if args.profile:
        try:
            profile = load_profile(args.profile, "--profile")
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        tp = profile_tp(profile) or 1
        problem = profile_model_problem(profile, model)
        if problem is None and tp not in tps:
            problem = (f"it was measured at TP {tp}, which this model on --gpus {args.gpus} cannot run "
                       f"(TP degrees: {', '.join(map(str, tps)) or 'none'}): profile at one of them")
        if problem is not None:
            print(f"error: --profile {args.profile}: {problem}", file=sys.stderr)
            return 2
        models, tps = {tp: profile}, [tp]
    if args.max_model_len is not None and args.max_model_len < 1:
        print(f"error: --max-model-len must be >= 1, got {args.max_model_len}", file=sys.stderr)
        return 2
    max_len = args.max_model_len or model.default_context     # the engine's default
    if not 0 < args.attainment <= 1 or args.max_num_batched_tokens < 1:
        print("error: --attainment must be in (0, 1] and --max-num-batched-tokens >= 1", file=sys.stderr)
        return 2
    try:
        workload = Workload(args.random_input_len, args.random_output_len, args.random_range_ratio,
                            args.num_prompts, args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if workload.input_len + workload.output_len > max_len:
        print(f"error: prompts of {workload.input_len} + outputs of {workload.output_len} tokens exceed the "
              f"{max_len}-token context; lower the lengths or raise --max-model-len", file=sys.stderr)
        return 2
    if workload.longest > max_len:   # the simulated router treats them as the live one does
        longest_prompt = workload.bounds(workload.input_len)[1]
        refused = (f"; prompts of {max_len} tokens or more are refused (400) and count as missing the SLOs"
                   if longest_prompt >= max_len else "")
        print(f"warning: prompts of up to {longest_prompt} + outputs of up to "
              f"{workload.bounds(workload.output_len)[1]} tokens (--random-range-ratio {workload.range_ratio:g}) "
              f"can exceed the {max_len}-token context: such outputs are cut to the room the prompt leaves "
              f"(finish_reason length){refused}", file=sys.stderr)
    slos = dict(args.slo)
    # every candidate behind the router's admission control at the SLOs, as the deployment file written
    # for the winner serves it (its slo: section, admission on by default): its refusals count as misses
    admission = AdmissionSection().settings(SloSection(**{f"{name}_ms": ms for name, ms in slos.items()}))
    build = roofline_spec_builder(model, gpu=gpu, dtype=dtype, max_model_len=max_len,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  gpu_memory_utilization=args.gpu_memory_utilization, policy=args.policy,
                                  models=models, gpu_memory_gib=args.gpu_memory_gib,
                                  overhead_gib=args.overhead_gib, admission=admission)
    result = search(num_gpus=args.gpus, tps=tps, workload=workload, slos_s={k: v / 1000 for k, v in slos.items()},
                    build_spec=build, target=args.attainment, refine_top=args.refine_top,
                    tolerance=args.rate_tolerance, max_requests=args.max_prompts, jobs=args.jobs,
                    progress=None if args.json else lambda m: print(f"  {m}", file=sys.stderr))
    best = result.best()
    report = {
        "model": str(model_dir), "gpu_type": gpu, "gpus": args.gpus, "dtype": dtype, "slos_ms": slos,
        "attainment_target": args.attainment, "step_model": "profile" if models else "roofline",
        "refinement": {"top_per_mode": args.refine_top, "tolerance": args.rate_tolerance,
                       "max_requests": args.max_prompts},
        "workload": vars(workload),
        "candidates": [{"config": e.candidate.describe(), **vars(e.candidate), "gpus_used": e.candidate.gpus,
                        "max_rate": e.max_rate, "unbounded": unbounded(e.max_rate),
                        "goodput_per_gpu": e.goodput_per_gpu,
                        "attainment_at_max": e.attainment_at_max, "kv_blocks": e.kv_blocks,
                        "num_requests": e.num_requests or workload.num_requests,
                        "estimates": [vars(r) for r in e.refined], "settled": e.settled}
                       for e in sorted(result.evaluated, key=lambda e: -e.goodput_per_gpu)],
        "skipped": [{"config": c.describe(), "why": why} for c, why in result.skipped],
        "best": {m: (None if result.best(m) is None else result.best(m).candidate.describe())
                 for m in ("colocated", "disaggregated")},
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    if best is None or best.max_rate == 0:
        print("no configuration meets the SLOs at any rate; relax the SLOs, shorten the requests or add GPUs",
              file=sys.stderr)
        return 1
    if args.write_config:
        write_output(Path(args.write_config), deployment_yaml(best.candidate, model_dir, dtype, max_len, gpu, args))
        print(f"wrote {args.write_config} ({best.candidate.describe()})", file=sys.stderr)
    return 0


def format_report(report: dict) -> str:
    from cluster.planner.search import RATE_CAP
    lines = [f"goodput per GPU at >= {report['attainment_target']:.0%} SLO attainment "
             f"({', '.join(f'{k} <= {v:g} ms' for k, v in report['slos_ms'].items())}), "
             f"{report['gpus']} x {report['gpu_type']}, {report['step_model']} step times:", "",
             "| configuration | GPUs | max rate (req/s) | goodput per GPU | simulated requests |",
             "|---|---:|---:|---:|---|"]
    for c in report["candidates"]:
        runs = (" -> ".join(f"{e['num_requests']}: {e['rate']:.2f}" for e in c["estimates"]) if c["estimates"]
                else f"{c['num_requests']} (screened)")
        if c["estimates"] and not c["settled"]:
            runs += " (not settled: raise --max-prompts)"
        rate = f">= {c['max_rate']:.0f}" if c["unbounded"] else f"{c['max_rate']:.2f}"
        lines.append(f"| {c['config']} | {c['gpus_used']} | {rate} | {c['goodput_per_gpu']:.3f} | {runs} |")
    if any(c["unbounded"] for c in report["candidates"]):
        lines += ["", ">= : the SLOs held at every rate the search tried (it stops doubling at "
                      f"{RATE_CAP:g} req/s): the workload is too light to rate these configurations"]
    lines += ["", f"best colocated:     {report['best']['colocated']}",
              f"best disaggregated: {report['best']['disaggregated']}"]
    if report["skipped"]:
        lines.append(f"{len(report['skipped'])} configurations do not fit memory (--json lists them)")
    return "\n".join(lines)


def deployment_yaml(cand, model_dir, dtype: str, max_len: int, gpu: str, args: argparse.Namespace) -> str:
    pools = ({"colocated": {"replicas": cand.decode_replicas, "tensor_parallel_size": cand.decode_tp}}
             if cand.mode == "colocated" else
             {"prefill": {"replicas": cand.prefill_replicas, "tensor_parallel_size": cand.prefill_tp},
              "decode": {"replicas": cand.decode_replicas, "tensor_parallel_size": cand.decode_tp}})
    # absolute: the file is read from other working directories (serve deploy builds it in a Ray worker)
    data = {"model": {"path": str(Path(model_dir).absolute()), "dtype": dtype, "max_model_len": max_len},
            "mode": cand.mode, "device": "cuda", **pools,
            "engine": {"max_num_batched_tokens": args.max_num_batched_tokens,
                       "gpu_memory_utilization": args.gpu_memory_utilization},
            "resources": {"gpu_type": gpu},
            # the SLOs it was chosen for: admission control (and autoscaling, once enabled) hold them
            "slo": {f"{name}_ms": ms for name, ms in dict(args.slo).items()}}
    if args.gpu_memory_gib is not None:
        data["resources"]["gpu_memory_gib"] = args.gpu_memory_gib
    if cand.mode == "disaggregated":
        data["disaggregation"] = {"policy": args.policy}
    header = (f"# {cand.describe()}: chosen by `pdserve plan --slo "
              f"{' '.join(f'{k}:{v:g}' for k, v in dict(args.slo).items())} --gpus {args.gpus}`\n")
    if not any(Path(model_dir).glob("*.safetensors")):
        header += ("# model.path holds the model's config.json but no weights (a model for planning): set it to "
                   "the checkpoint directory before deploying\n")
    return header + yaml.safe_dump(data, sort_keys=False)


def add_goodput_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("goodput search (with --slo)")
    g.add_argument("--slo", nargs="+", type=parse_slo, action=SloAction, default=None, metavar="KEY:MS",
                   help="search for the best configuration meeting these SLOs, e.g. ttft:1000 tpot:50")
    g.add_argument("--gpus", type=int, default=None, help="GPU budget for the search")
    g.add_argument("--profile", default=None, help="step times from this profile (its TP only) instead of the "
                                                    "roofline")
    g.add_argument("--policy", choices=["always", "conditional"], default="always",
                   help="disaggregated candidates' policy (default always)")
    g.add_argument("--attainment", type=float, default=0.9, help="SLO attainment target (default 0.9)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget (default 2048)")
    g.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (default 1024)")
    g.add_argument("--random-output-len", type=int, default=256, help="output tokens (default 256)")
    g.add_argument("--random-range-ratio", type=float, default=0.2,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default 0.2)")
    g.add_argument("--num-prompts", type=int, default=500,
                   help="simulated requests per rate probed when screening every candidate (default 500)")
    g.add_argument("--max-prompts", type=int, default=8000,
                   help="most simulated requests when refining the leaders (default 8000; under twice "
                        "--num-prompts: no refinement)")
    g.add_argument("--refine-top", type=int, default=2,
                   help="leaders of each mode refined on 2x, 4x, ... the requests (default 2; 0: none)")
    g.add_argument("--rate-tolerance", type=float, default=0.03,
                   help="refinement stops when three successive rates agree within this fraction (default 0.03)")
    g.add_argument("--jobs", type=int, default=usable_cpus(),
                   help="candidates simulated at once, in worker processes (default: every core)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--write-config", default=None, metavar="FILE", help="write a deployment file for the winner")
    # what a plan without --slo refuses to ignore: any of these set away from its default
    p.set_defaults(goodput_defaults={a.dest: a.default for a in g._group_actions if a.dest != "slo"})
