"""`pdserve simulate`: what `pdserve loadtest` would measure against `pdserve
serve --config DEPLOY.yaml`, computed by the discrete-event simulator from a
performance profile (`pdserve profile`) in seconds instead of run.

    pdserve simulate --config DEPLOY.yaml --profile PROFILE.json [--slo ttft:MS tpot:MS] [--autoscale]
                     [the dataset, load and results flags of pdserve loadtest]

The router's admission control runs as the deployment file sets it (admission:
and slo: sections, --slo overriding the SLOs): a refused request is a 429 in
the results, as `pdserve loadtest` records one. The result JSON has `pdserve
loadtest`'s keys (plus "simulated": true and the simulator's counters), so the
two compare line by line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from cluster.cli.plan_goodput import SloAction, load_profile, parse_slo, unused_slo_problem


def _cmd_simulate(args: argparse.Namespace) -> int:
    from bench.loadtest.arrivals import arrival_offsets
    from bench.loadtest.command import LoadtestError, _build_dataset, check_dataset_flags, check_result_path
    from bench.loadtest.metrics import peaks, summarize
    from bench.loadtest.report import JSON_PERCENTILES, build_result, format_table, vllm_json
    from bench.loadtest.runner import RunConfig, RunResult
    from cluster.config import ConfigFileError, load_config
    from cluster.perf_model.step_shape import profile_model_problem, profile_tp_problem
    from cluster.simulator import simulate
    from cluster.simulator.from_config import KVLink, cluster_spec, default_kv_link
    from engine.model.model_config import ModelConfig
    from cluster.cli import serve_command
    from engine.tiny_model import checkpoint_dir
    from engine.tokenizer import load_tokenizer

    try:
        check_dataset_flags(args)
        _check_flags(args)
        check_result_path(args)      # before the simulation, not after it (its result lost to a traceback)
        config = load_config(args.config, {f"slo.{name}_ms": ms for name, ms in args.slo or []})
        config = config.with_default_device(serve_command.visible_gpus())     # the device `pdserve serve` would take here
        _check_flags_against(args, config)
        if args.lend_profile and not config.lends_idle_cores():
            raise ValueError("--lend-profile applies to a CPU deployment whose resources.lend_idle_cores is true; "
                             f"{args.config}'s engines do not lend cores")
        if args.shared_cores is not None and config.device != "cpu":
            raise ValueError(f"--shared-cores models CPU replicas sharing one machine's cores, and {args.config} "
                             f"runs on {config.device}: drop it (and the flags that go with it)")
        step_model = load_profile(args.profile, "--profile")
        if problem := profile_tp_problem(step_model, {r: p.tensor_parallel_size for r, p in config.pools().items()}):
            raise ValueError(problem)
        wide_model = load_profile(args.lend_profile, "--lend-profile") if args.lend_profile else None
        model_dir = checkpoint_dir(config.model.path)
        model_config = ModelConfig.from_pretrained(model_dir)
        for profile, model in ((args.profile, step_model), (args.lend_profile, wide_model)):
            if model is not None and (problem := profile_model_problem(model, model_config)):
                raise ValueError(f"{profile}: {problem}")
        tokenizer = load_tokenizer(args.tokenizer or config.tokenizer_path() or model_dir)
        transport = default_kv_link(config)        # (the flags override it)
        link = KVLink(transport.bandwidth_bytes_per_s if args.kv_bandwidth_gibps is None
                      else args.kv_bandwidth_gibps * (1 << 30),
                      transport.latency_s if args.kv_latency_ms is None else args.kv_latency_ms / 1000)
        spec = cluster_spec(config, step_model, model_config=model_config, link=link,
                            request_overhead_s=args.request_overhead_ms / 1000, shared_cores=args.shared_cores,
                            threads_per_rank=max(1, int(args.threads_per_rank or config.resources.cpus_per_rank or 1)),
                            serving_cores_per_stream=args.serving_cores_per_stream, wide_model=wide_model)
        # (the engines' context, as the live load test filters a dataset by the server's)
        requests = _build_dataset(args, tokenizer, spec.max_model_len, args.seed, lengths_seed=args.seed)
    except (ConfigFileError, LoadtestError, ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rate = math.inf if args.request_rate is None else args.request_rate
    arrivals = arrival_offsets(len(requests), rate, args.burstiness, args.seed)
    autoscaler = None
    if args.autoscale or config.autoscaling.enabled:    # as pdserve serve --config would autoscale
        try:
            autoscaler = _autoscaler(config, args, spec)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    started = time.perf_counter()
    # the prompts' tokens, for the replicas' prefix caches (a shared-prefix dataset reuses them)
    prompt_token_ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]   # as prompt_len
    result = simulate(spec, [(r.prompt_len, r.expected_output_len) for r in requests], arrivals,
                      max_concurrency=args.max_concurrency, max_duration=args.max_duration, autoscaler=autoscaler,
                      prompt_token_ids=prompt_token_ids)
    wall = time.perf_counter() - started
    run_config = RunConfig(base_url=f"simulated:{args.config}", model=config.model.served_names(model_dir)[0],
                           request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                           max_duration=args.max_duration, seed=args.seed)
    records = result.records()
    duration = result.duration if records else 0.0
    run = RunResult(run_config, records, len(requests), 0.0, duration, result.interrupted)
    summary = summarize(records, num_requests=len(requests), duration=duration, slos_ms=dict(args.goodput or []),
                        percentiles=sorted(set(JSON_PERCENTILES) | set(args.metric_percentiles)))
    print(format_table(summary, metrics=args.percentile_metrics, percentiles=args.metric_percentiles,
                       title="Simulated Serving Benchmark Result", interrupted=result.interrupted,
                       peak=peaks(records)), flush=True)
    print(f"simulated {len(requests)} requests in {wall:.2f} s: {result.num_steps} replica steps, "
          f"{result.num_preemptions} preemptions, {result.num_local_prefills} prompts prefilled on a decode worker, "
          f"{result.cached_prompt_tokens} prompt tokens from prefix caches, "
          f"{sum(result.refusals.values())} refused by admission control"
          + (f" ({', '.join(f'{reason} {n}' for reason, n in sorted(result.refusals.items()))})"
             if result.refusals else ""))
    if autoscaler is not None:
        for entry in result.timeline:
            print(f"  {entry['time_s']:7.1f} s  {entry['rate']:6.2f} req/s  serving {entry['running']}  "
                  f"-> {entry['targets']}")
        print("replica-seconds: " + ", ".join(f"{r} {s:.0f}" for r, s in result.replica_seconds.items()))
    if args.save_result:
        payload = build_result(run, summary, meta={
            "tokenizer": str(args.tokenizer or model_dir), "prompt_lengths": "the model's tokenizer",
            "dataset_name": args.dataset_name, "dataset_path": args.dataset_path,
            "max_duration": "inf" if math.isinf(args.max_duration) else args.max_duration,   # (JSON has no inf)
            "simulated": True, "profile": str(args.profile), "config": str(args.config), "num_steps": result.num_steps,
            "num_preemptions": result.num_preemptions, "num_local_prefills": result.num_local_prefills,
            "cached_prompt_tokens": result.cached_prompt_tokens, "refusals": result.refusals,
            "replica_seconds": result.replica_seconds, "autoscaler_timeline": result.timeline})
        name = args.result_file or f"simulate-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path = Path(args.result_dir or ".") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(vllm_json(payload), indent=2) + "\n")
        print(f"saved the result to {path}")
    return 0


def _check_flags_against(args: argparse.Namespace, config) -> None:
    """Flags the deployment in --config would ignore are refused, as `pdserve serve` refuses them."""
    if args.slo and (problem := unused_slo_problem(config, args.autoscale)):
        raise ValueError(f"{args.config}: {problem}")
    handoff = [flag for flag, value in (("--kv-bandwidth-gibps", args.kv_bandwidth_gibps),
                                        ("--kv-latency-ms", args.kv_latency_ms)) if value is not None]
    if handoff and config.mode.value == "colocated":
        raise ValueError(f"{' and '.join(handoff)} model the KV hand-off, and {args.config} serves colocated "
                         "(no hand-off): drop them")


def _check_flags(args: argparse.Namespace) -> None:
    """Flags that would be ignored, or that would make time run backwards, are refused."""
    given = [v for v in (args.kv_bandwidth_gibps, args.kv_latency_ms, args.shared_cores) if v is not None]
    finite = [*given, args.request_overhead_ms, args.serving_cores_per_stream]
    bandwidth, latency = args.kv_bandwidth_gibps, args.kv_latency_ms
    if not all(math.isfinite(v) for v in finite) or (bandwidth is not None and bandwidth <= 0) or \
            (latency is not None and latency < 0) or args.request_overhead_ms < 0:
        raise ValueError("--kv-bandwidth-gibps must be > 0, --kv-latency-ms and --request-overhead-ms >= 0, "
                         "and every number finite")
    if args.shared_cores is not None and not args.shared_cores > 0 or args.serving_cores_per_stream < 0:
        raise ValueError("--shared-cores must be > 0 and --serving-cores-per-stream >= 0")
    if args.threads_per_rank is not None and args.threads_per_rank < 1:
        raise ValueError(f"--threads-per-rank must be >= 1, got {args.threads_per_rank}")
    if not args.save_result and (args.result_dir or args.result_file):
        raise ValueError("--result-dir and --result-file name the file --save-result writes; add --save-result")
    if args.shared_cores is None:
        given = [flag for flag, value in (("--threads-per-rank", args.threads_per_rank),
                                          ("--serving-cores-per-stream", args.serving_cores_per_stream or None),
                                          ("--lend-profile", args.lend_profile)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply to replicas sharing one machine's cores; add "
                             "--shared-cores N or drop them")


def _autoscaler(config, args, spec):
    """The deployment's autoscaling policy over the simulated pools (its SLOs: the
    config's, --slo applied)."""
    from cluster.autoscaler.capacity import ReplicaLimits
    from cluster.autoscaler.policy import GoodputPolicy
    from cluster.simulator.autoscaling import SimAutoscaler

    if config.slo.ttft_ms is None or config.slo.tpot_ms is None:
        raise ValueError("--autoscale needs the SLOs: --slo ttft:MS tpot:MS, or slo.ttft_ms and slo.tpot_ms in "
                         "the deployment file")
    if not config.autoscaling.enabled:     # --autoscale: the checks a file that enables it gets
        enabled = {**config.autoscaling.model_dump(), "enabled": True}
        config = type(config).model_validate({**config.model_dump(), "autoscaling": enabled})
    settings = config.autoscaling.settings(config.mode.value, config.pools(), config.slo,
                                           lend_idle_cores=config.lends_idle_cores())
    replicas = {"prefill": spec.prefill, "decode": spec.decode, "colocated": spec.decode}
    models = {r: replicas[r].model for r in settings.roles}
    limits = {r: ReplicaLimits(replicas[r].max_num_seqs, replicas[r].num_kv_blocks, replicas[r].block_size)
              for r in settings.roles}
    shared = spec.shared_cores if spec.lend_idle_cores else None
    return SimAutoscaler(GoodputPolicy(settings, models, limits, shared_cores=shared))


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from bench.loadtest.cli import add_workload_arguments
    p = subparsers.add_parser("simulate", help="simulate a deployment under a load-test workload")
    p.add_argument("--config", required=True, help="deployment file (as for pdserve serve --config)")
    p.add_argument("--profile", required=True, help="performance profile JSON (pdserve profile)")
    p.add_argument("--tokenizer", default=None, help="tokenizer for the dataset (default: the config's model)")
    p.add_argument("--kv-bandwidth-gibps", type=float, default=None,
                   help="KV hand-off bandwidth in GiB/s (default: on CPU 1.0, gloo as measured on a 2-core "
                        "machine; on GPUs 70%% of resources.gpu_type's NVLink per rank pair, as pdserve plan)")
    p.add_argument("--kv-latency-ms", type=float, default=None,
                   help="fixed cost of one hand-off in ms (default: on CPU 8.4, as measured on a 2-core "
                        "machine; on GPUs 1)")
    p.add_argument("--request-overhead-ms", type=float, default=0.0,
                   help="router + HTTP time added to every token of a request (default 0)")
    p.add_argument("--shared-cores", type=float, default=None,
                   help="CPU deployments on one machine: the cores all replicas share; a step slows down "
                        "when the replicas in a step and the serving path ask for more (default: a device "
                        "per rank)")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="with --shared-cores: torch threads per rank (default: the config's "
                        "resources.cpus_per_rank, else 1)")
    p.add_argument("--serving-cores-per-stream", type=float, default=0.0,
                   help="with --shared-cores: cores the router, the HTTP path and the client keep busy per "
                        "request streaming tokens (bench/simulator_accuracy.py fits it; default 0)")
    p.add_argument("--lend-profile", default=None, metavar="PROFILE.json",
                   help="with --shared-cores and the config's resources.lend_idle_cores: a profile taken at "
                        "--shared-cores threads; one-rank decode (colocated) replicas then borrow idle "
                        "replicas' cores for their steps, as the engines do")
    p.add_argument("--autoscale", action="store_true",
                   help="let the deployment's autoscaling policy (its autoscaling: section) set the pools, as "
                        "a file with autoscaling.enabled does without this flag; a replica asked for serves "
                        "after autoscaling.startup_s")
    p.add_argument("--slo", nargs="+", type=parse_slo, action=SloAction, metavar="ttft:MS|tpot:MS",
                   help="the SLOs admission control refuses for and the autoscaler scales for (default: the "
                        "deployment file's slo: section)")
    add_workload_arguments(p, result_name="simulate-<date>.json")
    p.set_defaults(func=_cmd_simulate)
    return p
