"""Builds the Ray Serve application from a DeploymentConfig.

    Router (ingress, FastAPI) ──▶ PrefillServer × prefill.replicas  ─┐ KV over per-pair
                              └─▶ DecodeServer  × decode.replicas  ◀─┘ process groups
                                  (a DecodeServer asks PrefillServer replicas for the KV itself)
    (colocated mode: Router ──▶ ColocatedServer × colocated.replicas: a DecodeServer
     with no prefill pool)

Each worker replica is a TP gang: it reserves one bundle per rank in a
STRICT_PACK placement group (`cpus_per_rank` CPUs per rank, plus one GPU per
rank on CUDA; see cluster/serving/gang_devices.py for how the ranks find their
GPUs). On CPU each rank runs torch with as many threads as its bundle has CPUs.

`build_app` is the `import_path` target of the Serve config files in configs/
(`serve run configs/serve/tiny-cpu.yaml`); `pdserve serve` calls
`build_application` directly.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.config import DeploymentConfig, Mode, load_config, with_overrides
from cluster.serving.replica_routing import LoadAwareRouter
from cluster.transport.transport_factory import TransportSettings
from engine.cpu_count import usable_cpus
from router.backend import ModelInfo
from router.cors import CorsSettings

log = logging.getLogger(__name__)

ROUTING_STATS_PERIOD_S = 0.5
# Worker replicas log no access line per call: their calls are the router's internal RPCs
# (generate, prefill, KV hand-offs, the routing stats every ROUTING_STATS_PERIOD_S), whose
# lines would bury the router's HTTP access log on the console, and each line costs CPU
# in the replica, Ray's log monitor and the driver that prints it.
WORKER_LOGGING = {"enable_access_log": False}
# Serve's default (5) would queue every request past the fifth in the HTTP proxy, in front of
# an engine that batches hundreds: the router admits them all and the engines queue them.
ROUTER_MAX_ONGOING_REQUESTS = 100_000
# Nor does Serve bound the calls in flight to a worker replica: its engine queues the work, and
# admission control bounds what waits. A bound here would also hold back the calls that free
# KV (a decode replica's send_kv and release to the prefill replica that holds it) behind
# prompts that wait in that replica's engine for those very blocks: with small KV caches and
# ~150 concurrent requests, send_kv calls waited 48 s for a free slot, the holds' leases ran
# out, and 135 of 300 requests failed.
WORKER_MAX_ONGOING_REQUESTS = 100_000


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder. args: `config` (a deployment YAML file;
    default: the built-in defaults) or `config_json` (a whole deployment as a
    dict), and dotted overrides, e.g. {"prefill.replicas": 2, "model.path":
    "/models/llama"}; `autoscaling_profile`: autoscaling.profile's contents, read
    where the deployment was made (`pdserve serve --autoscale` sends them), in
    place of reading its path here. With autoscaling enabled, the Serve config's
    application must also name the policy: `autoscaling_policy: {policy_function:
    cluster.autoscaler.serve_policy:router_targets}`."""
    import ray

    from cluster.serving.placement import placed_config, resolve_cpus_per_rank

    args = dict(args or {})
    path = _deployment_file(args.pop("config", None))
    whole = args.pop("config_json", None)      # a whole deployment, as `pdserve serve --autoscale` sends it
    profile = args.pop("autoscaling_profile", None)
    config = with_overrides(DeploymentConfig.model_validate(whole), args) if whole else \
        load_config(path, args, overrides_from="in the Serve config's args")
    given = {key for key, value in args.items() if value is not None}
    for problem in [] if whole else config.unused_settings(given):   # (pdserve serve, sending `whole`, said so)
        log.warning(problem)
    if not whole:     # (`pdserve serve` chose the device of a whole deployment)
        config = config.with_default_device(_cluster_gpus())
        default = type(config.http)()
        address = [name for name in ("host", "port") if getattr(config.http, name) != getattr(default, name)]
        if address:
            log.warning("the deployment's http.%s is not used here: the Serve config's http_options set the "
                        "address (http.* is pdserve serve's)", ", http.".join(address))
    if ray.is_initialized():   # a Serve config file's application is built in the cluster: check against it
        config = placed_config(config)
    else:
        # `serve run module:build_app ...` builds before it connects to any cluster
        if config.autoscaling.enabled:
            raise ValueError("an autoscaled deployment needs Serve's application-level autoscaling_policy, which "
                             "only a Serve config file carries: deploy it with a Serve config file (as "
                             "configs/serve/tiny-cpu-autoscale.yaml) or with pdserve serve --config")
        log.warning("the deployment's placement is not checked against the cluster: this application is built "
                    "before Ray is connected (serve run with an import path); a Serve config file, or pdserve "
                    "serve, checks it before deploying")
        config = resolve_cpus_per_rank(config, usable_cpus())
    return build_application(config, resolve_model(config, profile))


def _deployment_file(path: str | None) -> str | None:
    """A relative `config:` names a file in the working directory, else one that pdserve
    ships (configs/...): `serve deploy` builds the application in a Ray worker, whose
    working directory need not be the one the Serve file was written for."""
    if path is None or Path(path).is_absolute() or Path(path).exists():
        return path
    shipped = Path(__file__).resolve().parent.parent / path
    return str(shipped) if shipped.exists() else path


def _cluster_gpus() -> float:
    """The GPUs of the connected Ray cluster, or, before any connection, of this machine."""
    import ray

    from cluster.serving.placement import cluster_resources, visible_gpus
    if ray.is_initialized():
        return sum(node.gpus for node in cluster_resources().nodes)
    return visible_gpus()


class ResolvedModel(NamedTuple):
    path: str                                   # the checkpoint directory
    info: ModelInfo                             # what the router tells clients about it
    autoscaling_profile: dict | None = None     # autoscaling.profile, read and checked
    tokenizer_path: str | None = None           # the tokenizer's directory (None: `path`)


def resolve_model(config: DeploymentConfig, profile: dict | None = None) -> ResolvedModel:
    """The checkpoint directory (building the tiny model when none is set), what
    the router tells clients about it, and the autoscaling profile (`profile`,
    where its contents were read already, else autoscaling.profile's file). Raises
    ValueError (CheckpointError, or the list of problems) for a directory without
    weights, for settings the workers' engines would refuse for this model, or
    for a profile that cannot price its steps, before anything deploys."""
    from engine.model import ModelConfig
    from engine.model.loader import checkpoint_files
    from engine.chat_template import read_chat_template
    from engine.model.model_config import generation_sampling_defaults
    from engine.preflight import preflight
    from engine.tiny_model import checkpoint_dir
    from engine.tokenizer import load_tokenizer

    path = checkpoint_dir(config.model.path)
    checkpoint_files(Path(path))
    mc = ModelConfig.from_pretrained(path)
    tokenizer = config.tokenizer_path() or path
    load_tokenizer(tokenizer)    # the router and every worker load it
    max_len = mc.resolve_context(config.model.max_model_len)
    problems = [f"{role}: {problem}" for role in config.pools()
                for problem in preflight(config.engine_config(role, path), mc, max_len)]
    problems += _gpu_fit_problems(config, mc, max_len)
    if problems:
        raise ValueError("the workers' engines would refuse this deployment:\n  " + "\n  ".join(problems))
    profile = _autoscaling_profile(config, mc, profile) \
        if config.autoscaling.enabled and config.autoscaling.profile else None
    name, *aliases = config.model.served_names(path)
    template = read_chat_template(config.model.chat_template) if config.model.chat_template else None
    return ResolvedModel(path, ModelInfo(served_model_name=name, max_model_len=max_len, vocab_size=mc.vocab_size,
                                         sampling_defaults=generation_sampling_defaults(path),
                                         chat_template=template, aliases=tuple(aliases)), profile, tokenizer)


def _gpu_fit_problems(config: DeploymentConfig, mc, max_len: int) -> list[str]:
    """Where a CUDA deployment names its GPUs (resources.gpu_type or gpu_memory_gib): each
    pool whose replica the memory planner finds would not start there (weights past the
    memory, or a KV cache short of one max_model_len sequence), as the simulator sizes it."""
    if config.device != "cuda" or not (config.resources.gpu_type or config.resources.gpu_memory_gib):
        return []
    from cluster.simulator.from_config import kv_blocks
    from engine.memory_planner import resolve_dtype
    dtype = resolve_dtype(mc, config.model.dtype)
    problems = []
    for role, pool in config.pools().items():
        try:
            kv_blocks(config, pool, mc, dtype, max_len)
        except ValueError as exc:
            problems.append(f"{role}: {exc}; raise {role}.tensor_parallel_size (a shorter model.max_model_len "
                            "helps only a KV cache that is short)")
    return problems


def _autoscaling_profile(config: DeploymentConfig, mc, read: dict | None = None) -> dict:
    """autoscaling.profile as data, read here, where its path means what the user
    gave (the router may run on another node), unless `read` holds its contents
    already; ValueError when it cannot price this deployment's steps."""
    from cluster.perf_model.step_shape import load_step_model, profile_model_problem, profile_tp_problem
    where = f"autoscaling.profile {config.autoscaling.profile}"
    try:
        model = load_step_model(config.autoscaling.profile if read is None else read)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    tps = {role: pool.tensor_parallel_size for role, pool in config.pools().items()}
    problems = [p for p in (profile_tp_problem(model, tps), profile_model_problem(model, mc)) if p]
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    return model.to_json()


def build_application(config: DeploymentConfig, resolved: ResolvedModel | None = None) -> serve.Application:
    """The Serve application; `config.resources.cpus_per_rank` must be resolved
    (cluster/serving/placement.py: resolve_cpus_per_rank). `resolved`: the
    config's resolve_model, where the caller has it already."""
    from cluster.autoscaler.capacity import ReplicaLimits
    from decode_workers.decode_server import DecodeServer
    from prefill_workers.prefill_server import PrefillServer
    from router.disaggregation_policy import DisaggregationSettings
    from router.ingress import Router
    from router.openai_api import RequestLimits

    if config.resources.cpus_per_rank is None:
        raise ValueError("resources.cpus_per_rank is not resolved; call resolve_cpus_per_rank first")
    model_path, info, profile, tokenizer_path = resolved or resolve_model(config)
    router_args = {}
    if config.mode is Mode.colocated:
        colocated = _worker_options(DecodeServer.options(name="ColocatedServer"), config, "colocated",
                                    "free_kv_blocks", "max", "kv_block_size")
        workers = {"colocated": colocated.bind(config.engine_config("colocated", model_path))}
    else:
        transport = TransportSettings(timeout_s=config.kv_transfer.timeout_s, secret=config.kv_transfer_secret(),
                                      host=config.kv_transfer.listen_address)
        prefill = _worker_options(PrefillServer, config, "prefill", "queued_prefill_tokens", "min")
        decode = _worker_options(DecodeServer, config, "decode", "free_kv_blocks", "max", "kv_block_size")
        staging_bytes = int(config.kv_transfer.staging_mib * 2**20)
        prefill_app = prefill.bind(config.engine_config("prefill", model_path), transport,
                                   config.kv_transfer.lease_s, staging_budget_bytes=staging_bytes)
        workers = {
            "prefill": prefill_app,
            "decode": decode.bind(config.engine_config("decode", model_path), transport,
                                  config.kv_transfer.reserve_timeout_s, prefill=prefill_app,
                                  staging_budget_bytes=staging_bytes),
        }
        d = config.disaggregation
        router_args["disaggregation"] = DisaggregationSettings(d.policy, d.local_prefill_max_tokens,
                                                               d.max_remote_wait_ms / 1000)
    # a logging config only where a level is asked for: one set here hides a Serve config file's from the router
    router_logging = {"logging_config": {"log_level": config.log_level}} if config.log_level else {}
    router = Router.options(max_ongoing_requests=ROUTER_MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
                            **router_logging, **_replica_count(config, None))
    lim = config.limits
    router_args["limits"] = RequestLimits(lim.max_prompt_tokens, lim.max_tokens, lim.max_logprobs,
                                          lim.max_stop_sequences, lim.max_request_body_bytes, lim.max_stop_token_ids,
                                          lim.max_n, lim.max_logit_bias, lim.max_allowed_token_ids,
                                          lim.max_prompts, lim.max_logprob_entries, lim.max_stop_chars)
    router_args["api_key_sha256"] = config.api_key_sha256()
    router_args["protect_metrics"] = config.http.protect_metrics
    router_args["cors"] = CorsSettings(tuple(config.http.allowed_origins), config.http.allow_credentials) \
        if config.http.allowed_origins else None
    router_args["stream_interval_s"] = config.http.stream_interval_ms / 1000
    router_args["admission"] = config.admission.settings(config.slo)
    router_args["max_migrations"] = config.migration.max_migrations
    if config.autoscaling.enabled:
        router_args["autoscaling"] = config.autoscaling_settings()
        router_args["autoscaling_profile"] = profile
        router_args["autoscaling_deployed"] = {role: pool.replicas for role, pool in config.pools().items()}
        running = config.engine_config("decode" if "decode" in config.pools() else "colocated",
                                       model_path).max_running_seqs
        router_args["autoscaling_limits"] = ReplicaLimits(running, block_size=config.engine.block_size)
    return router.bind(info, tokenizer_path or model_path, config.mode.value, **workers, **router_args)


# Serve's own delays and look-back stay out of the way: the router's policy has its own guards.
_SERVE_AUTOSCALING = {"upscale_delay_s": 0.0, "downscale_delay_s": 0.0, "metrics_interval_s": 1.0,
                      "look_back_period_s": 2.0}
# a replica scaled down finishes the streams it holds before it stops
AUTOSCALED_GRACEFUL_SHUTDOWN_S = 600.0


def _replica_count(config: DeploymentConfig, role: str | None) -> dict[str, Any]:
    """Serve options for how many replicas a deployment runs: a fixed count, or
    with autoscaling an autoscaling_config bounding the policy's targets (the
    router, role None, is pinned to one replica but reports the targets)."""
    if not config.autoscaling.enabled:
        return {"num_replicas": 1 if role is None else config.pools()[role].replicas}
    if role is None:
        bounds = {"min_replicas": 1, "max_replicas": 1, "initial_replicas": 1}
        return {"autoscaling_config": {**bounds, **_SERVE_AUTOSCALING}}
    s = config.autoscaling_settings()
    initial = config.pools()[role].replicas
    bounds = {"min_replicas": s.min_for(role), "max_replicas": s.max_for(role),
              "initial_replicas": initial}
    return {"autoscaling_config": {**bounds, **_SERVE_AUTOSCALING},
            "graceful_shutdown_timeout_s": AUTOSCALED_GRACEFUL_SHUTDOWN_S}


def _worker_options(deployment, config: DeploymentConfig, role: str, stat: str, prefer: str,
                    per_unit: str | None = None):
    tp = config.pools()[role].tensor_parallel_size
    cpus = config.resources.cpus_per_rank
    gpus = 1 if config.device == "cuda" else 0
    bundles = [{"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus} for _ in range(tp)]
    actor = {"num_cpus": cpus, "num_gpus": gpus}
    return deployment.options(
        **_replica_count(config, role), ray_actor_options=actor,
        placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=WORKER_MAX_ONGOING_REQUESTS,
        request_router_config=RequestRouterConfig(
            request_router_class=LoadAwareRouter,
            request_router_kwargs={"stat": stat, "prefer": prefer, "per_unit": per_unit},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
        health_check_period_s=5.0,
        logging_config={**WORKER_LOGGING, **({"log_level": config.log_level} if config.log_level else {})})
