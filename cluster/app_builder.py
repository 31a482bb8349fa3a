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

import os
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.config import DeploymentConfig, Mode, WorkerPool, load_config
from cluster.serving.replica_routing import LoadAwareRouter
from cluster.transport.transport_factory import TransportSettings
from router.backend import ModelInfo

ROUTING_STATS_PERIOD_S = 0.5
# Serve's default (5) would queue every request past the fifth in the HTTP proxy, in front of
# an engine that batches hundreds: the router admits them all and the engines queue them.
ROUTER_MAX_ONGOING_REQUESTS = 100_000


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder. args: `config` (a deployment YAML file;
    default: the built-in defaults) and dotted overrides, e.g.
    {"prefill.replicas": 2, "model.path": "/models/llama"}."""
    import ray

    from cluster.serving.placement import placed_config, resolve_cpus_per_rank

    args = dict(args or {})
    path = args.pop("config", None)
    base = load_config(path) if path else DeploymentConfig()
    config = with_overrides(base, args)
    if ray.is_initialized():   # `serve run` connects before it builds: check against the real cluster
        return build_application(placed_config(config))
    return build_application(resolve_cpus_per_rank(config, os.cpu_count() or 1))


def with_overrides(config: DeploymentConfig, overrides: dict[str, Any]) -> DeploymentConfig:
    """A copy of `config` with dotted keys replaced, validated again."""
    data = config.model_dump(mode="json")
    for key, value in overrides.items():
        if value is None:
            continue
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise ValueError(f"unknown setting {key!r}")
            node = node[part]
        if leaf not in node:
            raise ValueError(f"unknown setting {key!r}")
        node[leaf] = value
    return DeploymentConfig.model_validate(data)


def resolve_model(config: DeploymentConfig) -> tuple[str, ModelInfo]:
    """The checkpoint directory (building the tiny model when none is set) and
    what the router tells clients about it."""
    from engine.engine_config import EngineConfig
    from engine.model import ModelConfig
    from engine.model_worker import resolve_max_model_len
    from engine.tiny_model import ensure_default_model

    path = config.model.path or str(ensure_default_model())
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path {path} is not a HuggingFace checkpoint directory (no config.json)")
    mc = ModelConfig.from_pretrained(path)
    max_len = resolve_max_model_len(EngineConfig(model=path, max_model_len=config.model.max_model_len), mc)
    name = config.model.served_model_name or ("tiny" if config.model.path is None else Path(path).name)
    return path, ModelInfo(served_model_name=name, max_model_len=max_len, vocab_size=mc.vocab_size)


def build_application(config: DeploymentConfig) -> serve.Application:
    """The Serve application; `config.resources.cpus_per_rank` must be resolved
    (cluster/serving/placement.py: resolve_cpus_per_rank)."""
    from decode_workers.decode_server import DecodeServer
    from prefill_workers.prefill_server import PrefillServer
    from router.disaggregation_policy import DisaggregationSettings
    from router.ingress import Router

    if config.resources.cpus_per_rank is None:
        raise ValueError("resources.cpus_per_rank is not resolved; call resolve_cpus_per_rank first")
    model_path, info = resolve_model(config)
    transport = TransportSettings(timeout_s=config.kv_transfer.timeout_s)
    router_args = {}
    if config.mode is Mode.colocated:
        colocated = _worker_options(DecodeServer.options(name="ColocatedServer"), config, config.colocated,
                                    "free_kv_blocks", "max")
        workers = {"colocated": colocated.bind(config.engine_config("colocated", model_path))}
    else:
        prefill = _worker_options(PrefillServer, config, config.prefill, "queued_prefill_tokens", "min")
        decode = _worker_options(DecodeServer, config, config.decode, "free_kv_blocks", "max")
        prefill_app = prefill.bind(config.engine_config("prefill", model_path), transport,
                                   config.kv_transfer.lease_s)
        workers = {
            "prefill": prefill_app,
            "decode": decode.bind(config.engine_config("decode", model_path), transport,
                                  config.kv_transfer.reserve_timeout_s, prefill=prefill_app),
        }
        d = config.disaggregation
        router_args["disaggregation"] = DisaggregationSettings(d.policy, d.local_prefill_max_tokens,
                                                               d.max_remote_wait_ms / 1000)
    return Router.options(num_replicas=1, max_ongoing_requests=ROUTER_MAX_ONGOING_REQUESTS,
                          ray_actor_options={"num_cpus": 0}).bind(
        info, model_path, config.mode.value, **workers, **router_args)


def _worker_options(deployment, config: DeploymentConfig, pool: WorkerPool, stat: str, prefer: str):
    tp = pool.tensor_parallel_size
    cpus = config.resources.cpus_per_rank
    gpus = 1 if config.device == "cuda" else 0
    bundles = [{"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus} for _ in range(tp)]
    actor = {"num_cpus": cpus, "num_gpus": gpus}
    return deployment.options(
        num_replicas=pool.replicas, ray_actor_options=actor,
        placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=max(64, config.engine.max_num_seqs * 2),
        request_router_config=RequestRouterConfig(
            request_router_class=LoadAwareRouter, request_router_kwargs={"stat": stat, "prefer": prefer},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
        health_check_period_s=5.0)
