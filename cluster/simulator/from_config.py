"""A ClusterSpec for a deployment file: pools, engine limits and KV capacity
as `pdserve serve` would run them, step times from a performance model."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.perf_model.step_shape import StepTimeModel
from cluster.simulator.cluster_sim import ClusterSpec, ReplicaSpec

GIB = 1 << 30
# The hand-off measured on this project's CPU machine (README "Where a served request's
# time goes": 8.4 ms from the decode worker's reservation to the committed KV) and the
# gloo transport's large-message rate (README "KV transfer": ~1 GiB/s).
CPU_KV_LATENCY_S = 8.4e-3
CPU_KV_BANDWIDTH = 1.0 * GIB


# Hand-offs between GPUs, as `pdserve plan` prices them: the link at this share of its per-direction
# rate, one link per rank pair (a TP-t prefill replica's ranks send their shards at once), and a
# fixed cost per hand-off. The link is NVLink where a prefill and a decode replica fit one node
# together, else the network between nodes (GpuSpec.link_rate).
NVLINK_EFFICIENCY = 0.7
NVLINK_KV_LATENCY_S = 1e-3
DEFAULT_GPU_TYPE = "H100-SXM"


@dataclass(frozen=True)
class KVLink:
    bandwidth_bytes_per_s: float = CPU_KV_BANDWIDTH
    latency_s: float = CPU_KV_LATENCY_S


def handoff_bandwidth(gpu_type: str, prefill_tp: int, decode_tp: int) -> float:
    """Bytes/s a hand-off from a TP `prefill_tp` to a TP `decode_tp` replica moves
    between `gpu_type` GPUs (a name or alias cluster.perf_model.roofline knows):
    over NVLink where the two replicas fit one node, else over the network."""
    from cluster.perf_model.roofline import GPU_SPECS
    from engine.memory_planner import resolve_gpu_type
    spec = GPU_SPECS[resolve_gpu_type(gpu_type).name]
    return spec.link_rate(prefill_tp + decode_tp) * NVLINK_EFFICIENCY * min(prefill_tp, decode_tp)


def default_kv_link(config) -> KVLink:
    """The hand-off a deployment's transport gives: gloo on this CPU machine, or
    NVLink between its GPUs (resources.gpu_type, default H100-SXM)."""
    if config.device == "cpu" or config.mode.value != "disaggregated":
        return KVLink()
    pools = config.pools()
    return KVLink(handoff_bandwidth(config.resources.gpu_type or DEFAULT_GPU_TYPE,
                                   pools["prefill"].tensor_parallel_size, pools["decode"].tensor_parallel_size),
                  NVLINK_KV_LATENCY_S)


def cluster_spec(config, model: StepTimeModel, *, model_config, link: KVLink | None = None,
                 request_overhead_s: float = 0.0, prefill_model: StepTimeModel | None = None,
                 shared_cores: float | None = None, threads_per_rank: int = 1,
                 serving_cores_per_stream: float = 0.0, wide_model: StepTimeModel | None = None) -> ClusterSpec:
    """`config`: a cluster.config.DeploymentConfig; `model_config`: the engine
    ModelConfig of its checkpoint (KV bytes per token, context limit; ValueError
    where the config's max_model_len is past it). `link`: the hand-off (default:
    default_kv_link(config)).
    `shared_cores`: the CPU cores every replica shares (one machine), with
    `threads_per_rank` torch threads per rank; None: a device per rank.
    `wide_model`: the step model at `shared_cores` threads; with it, and the
    config's resources.lend_idle_cores, one-rank decode (colocated) replicas
    borrow idle replicas' cores as the engines do. The router's admission
    control is the config's (its admission: and slo: sections)."""
    from engine.memory_planner import kv_bytes_per_token
    from engine.preflight import step_budget_problem, tensor_parallel_problem
    e = config.engine
    link = link or default_kv_link(config)
    # the engines' context: the model's default (its RoPE scaling, a sliding window) where none is set
    max_len = model_config.resolve_context(config.model.max_model_len)
    dtype = "float32" if config.device == "cpu" and config.model.dtype == "auto" else \
        ("bfloat16" if config.model.dtype == "auto" else config.model.dtype)
    kv_per_token = kv_bytes_per_token(model_config, 1, dtype)      # the whole model's: what a hand-off moves

    lending = shared_cores is not None and config.resources.lend_idle_cores
    admission = config.admission.settings(config.slo)
    if problem := step_budget_problem(e, max_len, config.tokens_per_step()):
        raise ValueError(f"the engines would not start: {problem}")
    for role, pool in config.pools().items():
        if problem := tensor_parallel_problem(model_config, pool.tensor_parallel_size):
            raise ValueError(f"the {role} engines would not start: {problem}")

    def replica(pool, step_model: StepTimeModel) -> ReplicaSpec:
        one_rank = pool.tensor_parallel_size == 1       # TP gangs keep their threads (engine/core_lending.py)
        return ReplicaSpec(step_model, kv_blocks(config, pool, model_config, dtype, max_len), e.block_size,
                           e.max_num_seqs, config.tokens_per_step(), threads_per_rank * pool.tensor_parallel_size,
                           in_core_ledger=lending and one_rank, wide_model=wide_model if lending else None,
                           enable_prefix_caching=e.enable_prefix_caching,
                           enable_chunked_prefill=e.enable_chunked_prefill)

    d = config.disaggregation
    if config.mode.value == "colocated":
        return ClusterSpec("colocated", decode=replica(config.colocated, model),
                           decode_replicas=config.colocated.replicas, request_overhead_s=request_overhead_s,
                           shared_cores=shared_cores, serving_cores_per_stream=serving_cores_per_stream,
                           lend_idle_cores=lending, admission=admission, max_model_len=max_len)
    return ClusterSpec(
        "disaggregated", prefill=replica(config.prefill, prefill_model or model), decode=replica(config.decode, model),
        prefill_replicas=config.prefill.replicas, decode_replicas=config.decode.replicas, policy=d.policy,
        local_prefill_max_tokens=d.local_prefill_max_tokens, max_remote_wait_s=d.max_remote_wait_ms / 1000,
        kv_bytes_per_token=kv_per_token, kv_bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
        kv_latency_s=link.latency_s, request_overhead_s=request_overhead_s, shared_cores=shared_cores,
        serving_cores_per_stream=serving_cores_per_stream, lend_idle_cores=lending, admission=admission,
        max_model_len=max_len)


def kv_blocks(config, pool, model_config, dtype: str, max_len: int) -> int:
    """KV blocks of one replica of `pool`, sized as the engine sizes them: on CPU
    the kv_cache_memory_gib budget, capped at max_num_seqs full-length
    sequences; on CUDA what the memory planner leaves after the weights (and,
    disaggregated, after kv_transfer.staging_mib for hand-off buffers).
    Raises ValueError where the engine would refuse to start: the weights do
    not fit, or the KV cache holds less than one max_model_len sequence."""
    from engine.memory_planner import kv_bytes_per_token, plan, resolve_gpu_type
    from engine.preflight import kv_capacity_problem
    e = config.engine
    tp = pool.tensor_parallel_size
    per_block = kv_bytes_per_token(model_config, tp, dtype) * e.block_size
    if config.device == "cpu":
        blocks = min(int(e.kv_cache_memory_gib * GIB // per_block), e.max_num_seqs * math.ceil(max_len / e.block_size))
    else:
        spec = resolve_gpu_type(config.resources.gpu_type or DEFAULT_GPU_TYPE)
        p = plan(model_config, tp=tp, gpu_memory_gib=config.resources.gpu_memory_gib or spec.memory_gib,
                 gpu_memory_utilization=e.gpu_memory_utilization, dtype=dtype, max_model_len=max_len,
                 gpu_type=spec.name, block_size=e.block_size, kv_transfer_staging_gib=config.kv_transfer_staging_gib())
        if not p.fits:
            raise ValueError(f"a TP-{tp} replica does not fit on {spec.name}: {'; '.join(p.problems)}")
        blocks = p.kv_tokens_capacity // e.block_size
    if problem := kv_capacity_problem(blocks, e.block_size, max_len, config.device):
        raise ValueError(f"a TP-{tp} replica would not start: {problem}")
    return blocks
