"""What an engine would refuse at start-up, found from its config and the
model's config.json alone, without loading weights or touching a device.

The engine runs these same checks when it starts (one definition each). A
deployment's driver runs `preflight` for every role before anything deploys:
a worker that fails in its constructor is retried by Ray Serve, reloading the
model each time, and the user sees the reason only in a replica's log.
"""

from __future__ import annotations

import os

import torch

from engine.engine_config import EngineConfig
from engine.kv_cache import GIB, KVCacheSpec
from engine.kv_head_map import check_tp_for_heads, kv_heads_of_rank
from engine.model.model_config import ModelConfig


def tensor_parallel_problem(mc: ModelConfig, tp: int) -> str | None:
    """Why the model's layers cannot be split over `tp` ranks, or None."""
    if mc.num_heads % tp:
        return f"num_attention_heads ({mc.num_heads}) is not divisible by tensor_parallel_size ({tp})"
    if mc.intermediate_size % tp:
        return f"intermediate_size ({mc.intermediate_size}) is not divisible by tensor_parallel_size ({tp})"
    try:
        check_tp_for_heads(mc.num_kv_heads, tp)
    except ValueError as exc:
        return str(exc)
    return None


def step_budget_problem(config: EngineConfig, max_model_len: int, max_num_batched_tokens: int | None = None
                        ) -> str | None:
    """Without chunked prefill a prompt runs in one step: the budget (`config`'s, or
    `max_num_batched_tokens` where the caller resolved it: a deployment file's
    engine section leaves it to the device) must hold the longest."""
    budget = config.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
    if config.enable_chunked_prefill or budget >= max_model_len:
        return None
    return (f"with chunked prefill off, max_num_batched_tokens ({budget}) must be "
            f">= max_model_len ({max_model_len}), or a long prompt could never be scheduled; raise "
            "max_num_batched_tokens, lower max_model_len, or enable chunked prefill")


def cpu_kv_blocks(config: EngineConfig, spec: KVCacheSpec, max_model_len: int) -> int:
    """Blocks a CPU rank's KV cache gets: the memory budget's, but no more than
    max_num_seqs sequences at full length could use (num_kv_blocks wins)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    return min(spec.num_blocks_for(int(config.kv_cache_memory_gib * GIB)),
               config.max_num_seqs * -(-max_model_len // spec.block_size))


def kv_capacity_problem(num_blocks: int, block_size: int, max_model_len: int, device_type: str) -> str | None:
    """Why a cache of `num_blocks` on `device_type` ("cpu" or "cuda") cannot hold one sequence
    of max_model_len tokens, or None."""
    needed = -(-max_model_len // block_size)
    if num_blocks >= needed:
        return None
    more = ("kv_cache_memory_gib, the CPU memory each rank's KV cache may take (--kv-cache-memory-gib); to "
            "serve on GPUs, device cuda (--device cuda)" if device_type == "cpu" else
            "gpu_memory_utilization, or more GPUs per replica (tensor parallelism)")
    return (f"the KV cache on {device_type} holds {num_blocks} blocks of {block_size} tokens, fewer than one "
            f"sequence of max_model_len={max_model_len} tokens needs ({needed}); lower max_model_len or give the "
            f"KV cache more memory: {more}")


def attention_backend_problem(config: EngineConfig, device_type: str, dtype) -> str | None:
    """Why the chosen attention kernels cannot run on this device and dtype, or None
    (an automatic choice always can: it falls back to torch)."""
    backend = config.attention_backend
    if backend == "triton" and device_type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return ("attention_backend 'triton' on CPU runs only under Triton's interpreter (TRITON_INTERPRET=1, "
                "slow: for tests); use attention_backend 'torch' on CPU")
    if backend == "cpp" and (device_type != "cpu" or dtype != torch.float32):
        return "attention_backend 'cpp' needs float32 on CPU; use attention_backend 'torch' (or auto)"
    return None


def preflight(config: EngineConfig, mc: ModelConfig, max_model_len: int) -> list[str]:
    """Everything `config` asks that the engine would refuse for this model (empty: none found)."""
    tp = config.tensor_parallel_size
    device_type = config.resolved_device().type
    dtype = config.resolved_dtype(mc.torch_dtype)
    problems = [tensor_parallel_problem(mc, tp), step_budget_problem(config, max_model_len),
                attention_backend_problem(config, device_type, dtype)]
    if device_type == "cpu" and problems[0] is None:
        heads = len(kv_heads_of_rank(mc.num_kv_heads, tp, 0))
        spec = KVCacheSpec(mc.num_layers, heads, mc.head_dim, config.block_size, dtype)
        problems.append(kv_capacity_problem(cpu_kv_blocks(config, spec, max_model_len), config.block_size,
                                            max_model_len, device_type))
    return [p for p in problems if p is not None]
