"""One tensor-parallel rank's share of the model: weights, KV cache, forward.

Rank 0's worker lives inside the LLMEngine, which schedules and samples. Every
other rank runs `follow`: it receives each step's inputs from rank 0 (a
broadcast) and runs the same forward pass on its shard; the collectives inside
the layers (all-reduce, logits gather) keep the ranks in lockstep.

    rank 0:   schedule → prepare inputs → broadcast ─┐→ forward → logits → sample
    rank k:                     wait for broadcast ──┘→ forward → (send logits shard)
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch

from engine.cpu_allocator import keep_freed_memory_in_heap
from engine.engine_config import EngineConfig
from engine.kv_cache import GIB, KVCache, KVCacheSpec, gpu_kv_budget_bytes
from engine.model import ModelConfig, load_model
from engine.model.attention_metadata import AttentionMetadata, DecodeGroup, PrefillChunk
from engine.model.parallel import SINGLE_PROCESS, TensorParallel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelInputs:
    """What every rank needs for one forward pass (built on CPU by rank 0)."""
    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [S] rows whose logits are needed

    def to(self, device: torch.device) -> "ModelInputs":
        """A copy whose tensors are on `device` (self when that is the CPU)."""
        if device.type == "cpu":
            return self
        meta = self.meta
        moved = AttentionMetadata(
            slot_mapping=meta.slot_mapping.to(device),
            decode_groups=[DecodeGroup(g.token_start, g.block_tables.to(device),
                                       None if g.key_mask is None else g.key_mask.to(device))
                           for g in meta.decode_groups],
            prefills=[PrefillChunk(c.token_start, c.num_tokens, c.context_len, c.block_table.to(device))
                      for c in meta.prefills])
        return ModelInputs(self.input_ids.to(device), self.positions.to(device), moved,
                           self.sample_indices.to(device))


class ModelWorker:
    def __init__(self, config: EngineConfig, tp: TensorParallel = SINGLE_PROCESS):
        self.config = config
        self.tp = tp
        self.device = _rank_device(config, tp)
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
            # whatever OMP_NUM_THREADS says (Ray sets it from an actor's num_cpus)
            torch.set_num_threads(cpu_threads_per_rank(config))
        self.num_threads = torch.get_num_threads()   # this thread's intra-op threads: the forward runs here
        self.model_config = ModelConfig.from_pretrained(config.model)
        mc = self.model_config
        self.max_model_len = resolve_max_model_len(config, mc)
        self.dtype = config.resolved_dtype(mc.torch_dtype)
        self.model = load_model(config.model, mc, max_positions=self.max_model_len, dtype=self.dtype,
                                device=self.device, tp=tp)
        attn = self.model.model.layers[0].self_attn
        self.kv_head_start = attn.qkv_proj.kv_head_start
        spec = KVCacheSpec(mc.num_layers, attn.num_local_kv_heads, mc.head_dim, config.block_size, self.dtype)
        num_blocks = self._num_kv_blocks(spec)
        # every rank must index the same block ids: agree on the smallest pool
        num_blocks = int(tp.all_reduce(torch.tensor([num_blocks], device=tp.comm_device), op="min").item())
        self.kv_cache = KVCache(spec, num_blocks, self.device)
        self.kv_layers = self.kv_cache.layer_views()
        # state that code above the engine keeps on each rank (e.g. a KV transport),
        # set and used through LLMEngine.collective_rpc
        self.attachments: dict[str, object] = {}

    @property
    def kv_heads(self) -> range:
        """Global ids of the KV heads whose K/V this rank's cache holds."""
        return range(self.kv_head_start, self.kv_head_start + self.kv_cache.spec.num_kv_heads)

    def _num_kv_blocks(self, spec: KVCacheSpec) -> int:
        config = self.config
        min_blocks = -(-self.max_model_len // spec.block_size)
        if config.num_kv_blocks is not None:
            num = config.num_kv_blocks
        elif self.device.type == "cuda":
            num = spec.num_blocks_for(gpu_kv_budget_bytes(self.device, config.gpu_memory_utilization))
        else:
            # no point reserving more than every sequence at full length could use
            num = min(spec.num_blocks_for(int(config.kv_cache_memory_gib * GIB)),
                      config.max_num_seqs * min_blocks)
        if num < min_blocks:
            raise ValueError(
                f"the KV cache holds {num} blocks of {spec.block_size} tokens, fewer than one sequence of "
                f"max_model_len={self.max_model_len} tokens needs ({min_blocks}); lower max_model_len or "
                "give the KV cache more memory (kv_cache_memory_gib / gpu_memory_utilization / num_kv_blocks)")
        return num

    def read_kv(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's K/V of the blocks: [layers, 2, n, block_size, local_kv_heads, D] (CPU)."""
        return self.kv_cache.read_blocks(block_ids).cpu()

    def write_kv(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Fills the blocks' K/V for this rank's heads from `data` (read_kv's layout)."""
        self.kv_cache.write_blocks(block_ids, data)

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs) -> torch.Tensor | None:
        """Forward pass; returns logits [S, vocab] (float32) on rank 0, None elsewhere
        or when nothing is sampled."""
        inputs = inputs.to(self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_layers, inputs.meta)
        if inputs.sample_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden[inputs.sample_indices])


def resolve_max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    limit = mc.max_position_embeddings
    if mc.sliding_window:
        limit = min(limit, mc.sliding_window)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len ({config.max_model_len}) is larger than the model supports "
                         f"({limit}); set max_model_len <= {limit}")
    return config.max_model_len


def _rank_device(config: EngineConfig, tp: TensorParallel) -> torch.device:
    device = config.resolved_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", tp.rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def cpu_threads_per_rank(config: EngineConfig) -> int:
    """Torch threads one CPU rank runs with: `config.cpu_threads` (at most the
    machine's cores), else the machine's cores shared among the ranks."""
    if config.cpu_threads is not None:
        return min(config.cpu_threads, os.cpu_count() or 1)
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


# ---- ranks other than 0 ---------------------------------------------------------------
STEP, STOP, KV_READ, KV_WRITE, RPC = "step", "stop", "kv_read", "kv_write", "rpc"


def follow(worker: ModelWorker) -> None:
    """Runs rank 0's commands until told to stop."""
    tp = worker.tp
    while True:
        command, payload = tp.broadcast_object()
        if command == STOP:
            return
        if command == STEP:
            worker.execute(payload)
        elif command == KV_READ:
            tp.gather_to_first(worker.read_kv(payload))
        elif command == KV_WRITE:
            block_ids, shards = payload
            worker.write_kv(block_ids, shards[tp.rank])
        elif command == RPC:
            fn, args = payload
            tp.gather_objects_to_first(run_rank_call(worker, fn, args))


def run_rank_call(worker: "ModelWorker", fn, args: tuple):
    """One rank's part of `LLMEngine.collective_rpc`: fn's result, or the
    exception it raised (returned, so that every rank still joins the gather)."""
    try:
        return fn(worker, *args)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        log.exception("collective call %s failed on rank %d", getattr(fn, "__name__", fn), worker.tp.rank)
        return RankCallError(f"rank {worker.tp.rank}: {type(exc).__name__}: {exc}")


class RankCallError(Exception):
    """A collective call failed on one rank."""


def follower_main(rank: int, size: int, port: int, parent_pid: int, config: EngineConfig,
                  backend: str) -> None:
    """Entry point of a spawned rank process."""
    from engine.tp_group import create_group, exit_when_parent_dies
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {rank}] %(levelname)s %(message)s")
    exit_when_parent_dies(parent_pid)
    device = config.resolved_device()
    try:
        tp = create_group(rank, size, "127.0.0.1", port, backend, device)
        follow(ModelWorker(config, tp))
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        sys.exit(1)
