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
import pickle
import signal
from dataclasses import dataclass

import torch

from engine.cpu_allocator import keep_freed_memory_in_heap
from engine.cpu_count import usable_cpus
from engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from engine.engine_config import EngineConfig
from engine.kv_cache import GIB, KVCache, KVCacheSpec, gpu_kv_budget_bytes
from engine.model import ModelConfig, load_model
from engine.model.attention_metadata import (
    AttentionMetadata,
    PagedBatch,
    PrefillChunk,
    lone_fresh_prompt_takes_sdpa,
    to_device,
)
from engine.model.cpu_gemm import pack_linear_weights, packing_supported, use_skinny_gemm
from engine.model.llama import use_fused_ops
from engine.model.parallel import SINGLE_PROCESS, TensorParallel
from engine.preflight import (
    attention_backend_problem,
    cpu_kv_blocks,
    kv_capacity_problem,
    tensor_parallel_problem,
)
from engine.sampler import Sampler, TokenScores, heaviest_rows, score_tokens
from engine.tiny_model import ensure_built_in_checkpoint

log = logging.getLogger(__name__)

# prompt rows scored per pass (SamplingParams.prompt_logprobs); on CUDA at most max_running_seqs: their logits
# and the softmax over them take no more than sampling a full batch, which the activation reserve measures
SCORE_ROWS_PER_PASS = 256


@dataclass(slots=True)
class ModelInputs:
    """What every rank needs for one forward pass (built on CPU by rank 0)."""
    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [S] rows whose logits are needed
    # prompt tokens to score (SamplingParams.prompt_logprobs): the rows whose logits predict them ...
    score_rows: torch.Tensor | None = None      # [R] int64
    score_targets: torch.Tensor | None = None   # [R] int64: ... and the prompt token each row predicts
    score_top_n: int = 0                        # alternatives to list per row (the most any request asks)

    def to(self, device: torch.device) -> "ModelInputs":
        """A copy whose tensors are on `device` (self when that is the CPU)."""
        if device.type == "cpu":
            return self
        scored = self.score_rows is not None
        return ModelInputs(to_device(self.input_ids, device), to_device(self.positions, device),
                           self.meta.to(device), to_device(self.sample_indices, device),
                           to_device(self.score_rows, device) if scored else None,
                           to_device(self.score_targets, device) if scored else None, self.score_top_n)

    @property
    def is_decode_only(self) -> bool:
        paged = self.meta.paged
        return paged is not None and paged.num_decodes == self.input_ids.shape[0]


@dataclass(slots=True)
class ForwardResult:
    """A forward pass's outputs on rank 0 (on other ranks both are None)."""
    logits: torch.Tensor | None               # [S, vocab] float32 of the sampled rows; None when S == 0
    prompt_scores: TokenScores | None = None  # of the score rows, in order; None when there are none


@dataclass(slots=True)
class TokenFill:
    """Input tokens known only on the device (sampled by a step still in flight):
    input_ids[rows[i]] = token_ids[i]."""
    rows: torch.Tensor           # [P] int64, on the CPU
    token_ids: torch.Tensor      # [P] int64, on the device

    def applied_to(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` (on the device) with the rows filled in place."""
        return input_ids.index_copy_(0, to_device(self.rows, input_ids.device), self.token_ids)


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
        ensure_built_in_checkpoint(config.model)    # a built-in model resolved on another node
        self.model_config = ModelConfig.from_pretrained(config.model)
        mc = self.model_config
        self.max_model_len = resolve_max_model_len(config, mc)
        self.dtype = config.resolved_dtype(mc.torch_dtype)
        if problem := (attention_backend_problem(config, self.device.type, self.dtype)
                       or tensor_parallel_problem(mc, tp.size)):
            raise ValueError(problem)
        self.attention_backend = config.resolved_attention_backend()
        if self.attention_backend == "triton":
            _require_triton()
        if self.attention_backend == "cpp" and not _cpp_kernels_run(self.device, self.dtype):
            if config.attention_backend == "cpp":
                raise ValueError("attention_backend 'cpp' needs a C++ compiler for its extension (see the "
                                 "log); use attention_backend 'torch'")
            self.attention_backend = "torch"
        self.model = load_model(config.model, mc, max_positions=self.max_model_len, dtype=self.dtype,
                                device=self.device, tp=tp)
        if config.fused_ops and self.device.type == "cuda":
            from engine.kernels import fused_ops
            use_fused_ops(self.model, fused_ops)
        elif config.fused_ops and _cpp_kernels_run(self.device, self.dtype):
            from engine.kernels import cpu_kernels
            use_fused_ops(self.model, cpu_kernels)
        if config.skinny_gemm and self.device.type == "cuda":
            from engine.kernels import gemv
            use_skinny_gemm(self.model, gemv.skinny_linear, gemv.ROWS_FASTER_THAN_CUBLAS)
        if config.cpu_weight_prepack and packing_supported(self.dtype, self.device):
            pack_linear_weights(self.model)
        attn = self.model.model.layers[0].self_attn
        self.kv_head_start = attn.qkv_proj.kv_head_start
        spec = KVCacheSpec(mc.num_layers, attn.num_local_kv_heads, mc.head_dim, config.block_size, self.dtype)
        self.graph_sizes = graph_batch_sizes(min(config.max_cuda_graph_batch_size, config.max_running_seqs)) \
            if config.uses_cuda_graphs() else []
        num_blocks = self._num_kv_blocks(spec)
        # every rank must index the same block ids: agree on the smallest pool
        num_blocks = int(tp.all_reduce(torch.tensor([num_blocks], device=tp.comm_device), op="min").item())
        self.kv_cache = KVCache(spec, num_blocks, self.device)
        self.kv_layers = self.kv_cache.layer_views()
        self.graphs = DecodeGraphs(self, self.graph_sizes) if self.graph_sizes else None
        # state that code above the engine keeps on each rank (e.g. a KV transport),
        # set and used through LLMEngine.collective_rpc
        self.attachments: dict[str, object] = {}

    @property
    def kv_heads(self) -> range:
        """Global ids of the KV heads whose K/V this rank's cache holds."""
        return range(self.kv_head_start, self.kv_head_start + self.kv_cache.spec.num_kv_heads)

    def _num_kv_blocks(self, spec: KVCacheSpec) -> int:
        config = self.config
        if self.device.type == "cuda" and config.num_kv_blocks is None:
            torch.cuda.empty_cache()   # what loading freed is free for the KV cache, not held by the allocator
            # profiled first: its passes run every collective and kernel a step runs, so the memory
            # that takes outside torch's allocator (no measured peak has it) is in use when the free
            # memory is read: NCCL's communicators and the buffers each of their algorithms sets up
            # on first use, cuBLAS's handles and workspaces, the kernels' code
            reserve = self._activation_reserve(spec)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            budget = gpu_kv_budget_bytes(self.device, config.gpu_memory_utilization)
            staging = int(config.kv_transfer_staging_gib * GIB)
            num = spec.num_blocks_for(max(0, budget - reserve - staging))
        else:
            num = cpu_kv_blocks(config, spec, self.max_model_len)
        if problem := kv_capacity_problem(num, spec.block_size, self.max_model_len, self.device.type):
            raise ValueError(problem)
        return num

    @torch.inference_mode()
    def _activation_reserve(self, spec: KVCacheSpec) -> int:
        """CUDA bytes the steps need beside weights and KV, measured on a scratch
        cache: the peak of the largest captured decode batch, whose graph pool
        stays allocated, plus the larger of the largest prefill step's peak and
        that of sampling the most rows a step can sample (max_running_seqs) with
        every option that allocates; a step samples after its forward pass."""
        # a step's whole budget: chunked prefill fills it from several prompts when one is shorter
        tokens = self.config.max_num_batched_tokens
        blocks = -(-tokens // spec.block_size)
        scratch = KVCache(spec, blocks, self.device)
        layers = scratch.layer_views()
        with_cache = torch.cuda.memory_allocated(self.device)
        prefill_peak, decode_peak = (
            self._forward_peak(self._profile_inputs(n, prefill=prefill), layers, with_cache)
            for n, prefill in ((tokens, True), (max(self.graph_sizes, default=0), False)))
        del scratch, layers
        torch.cuda.empty_cache()
        sampling_peak = self._sampling_peak(self.config.max_running_seqs)
        reserve = decode_peak + self._graph_logits_bytes() + max(prefill_peak, sampling_peak)
        log.info("activation reserve %.0f MiB (peaks: prefill %.0f, decode %.0f, sampling %.0f MiB; the smaller "
                 "graphs' logits %.0f MiB)", reserve / 2**20, prefill_peak / 2**20, decode_peak / 2**20,
                 sampling_peak / 2**20, self._graph_logits_bytes() / 2**20)
        return reserve

    def _graph_logits_bytes(self) -> int:
        """What the captured decode graphs keep beside the largest one's peak: each graph's
        output, float32 logits [B, vocab rows of every rank], stays allocated in the shared pool."""
        sizes = self.graph_sizes
        vocab_rows = -(-self.model_config.vocab_size // self.tp.size) * self.tp.size
        return 4 * vocab_rows * (sum(sizes) - max(sizes, default=0))

    def _forward_peak(self, inputs: ModelInputs | None, layers: list, baseline: int) -> int:
        """Peak CUDA bytes above `baseline` of one forward pass and its logits (0 for None)."""
        if inputs is None:
            return 0
        torch.cuda.reset_peak_memory_stats(self.device)
        inputs = inputs.to(self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, layers, inputs.meta)
        self.model.compute_logits(hidden[inputs.sample_indices])
        del hidden
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - baseline

    def _sampling_peak(self, num_rows: int) -> int:
        """Peak CUDA bytes of the logits of `num_rows` rows and the sampler's work on
        them (rank 0 samples; every rank measures, and the ranks keep the smallest
        KV pool)."""
        baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        hidden = torch.zeros(num_rows, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        logits = self.model.compute_logits(hidden)
        if logits is not None:
            Sampler()(logits, heaviest_rows(num_rows, logits.shape[-1], self.device))
        del hidden, logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - baseline
        torch.cuda.empty_cache()
        return peak

    def _profile_inputs(self, num_tokens: int, prefill: bool) -> ModelInputs | None:
        """A dummy step for `_activation_reserve`: one prompt of `num_tokens` (positions
        wrapping at max_model_len: a step's budget may hold several prompts), or
        `num_tokens` decodes of one key each, all in block 0 onwards."""
        if num_tokens == 0:
            return None
        bs = self.config.block_size
        positions = torch.arange(num_tokens) % self.max_model_len if prefill else \
            torch.zeros(num_tokens, dtype=torch.long)
        slots = torch.arange(num_tokens) if prefill else torch.zeros(num_tokens, dtype=torch.long)
        blocks = -(-num_tokens // bs)
        paged = None
        if self.attention_backend == "triton":
            if prefill:
                paged = PagedBatch(0, torch.arange(blocks, dtype=torch.int32)[None],
                                   torch.tensor([num_tokens], dtype=torch.int32),
                                   torch.tensor([0, num_tokens], dtype=torch.int32), num_tokens, 1,
                                   lone_fresh_prompt_takes_sdpa(num_tokens))
            else:
                paged = PagedBatch(num_tokens, torch.zeros(num_tokens, 1, dtype=torch.int32),
                                   torch.ones(num_tokens, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                   0, self.decode_splits(num_tokens, self.max_model_len))
        chunks = [PrefillChunk(0, num_tokens, num_tokens, torch.zeros(0, dtype=torch.long))] if prefill else []
        meta = AttentionMetadata(slots, [], chunks, paged)
        samples = torch.tensor([num_tokens - 1]) if prefill else torch.arange(num_tokens)
        return ModelInputs(torch.zeros(num_tokens, dtype=torch.long), positions, meta, samples)

    def decode_splits(self, batch: int, max_seq_len: int) -> int:
        """Programs the paged decode kernel splits each context over (1 off the Triton backend)."""
        if self.attention_backend != "triton":
            return 1
        from engine.kernels.paged_attention import decode_splits
        return decode_splits(batch, self.model.model.layers[0].self_attn.num_local_kv_heads, max_seq_len,
                             self.device)

    def adopt_calling_thread(self) -> None:
        """Sets the calling thread up to run this rank as the thread that built it
        was (the current CUDA device; on CPU, its OpenMP threads): for a worker
        built on another thread."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(self.num_threads)

    def read_kv(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's K/V of the blocks: [layers, 2, n, block_size, local_kv_heads, D] (CPU)."""
        return self.kv_cache.read_blocks(block_ids).cpu()

    def write_kv(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Fills the blocks' K/V for this rank's heads from `data` (read_kv's layout)."""
        self.kv_cache.write_blocks(block_ids, data)

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs, fill: TokenFill | None = None) -> ForwardResult:
        """Forward pass: the sampled rows' logits and the score rows' scores (rank 0).
        `fill` sets input tokens on the device first."""
        if self.graphs is not None and self.graphs.can_run(inputs):
            return ForwardResult(self.graphs.run(inputs, fill))
        inputs = inputs.to(self.device)
        input_ids = inputs.input_ids if fill is None else fill.applied_to(inputs.input_ids)
        hidden = self.model(input_ids, inputs.positions, self.kv_layers, inputs.meta)
        scores = self._score(hidden, inputs) if inputs.score_rows is not None else None
        if inputs.sample_indices.numel() == 0:
            return ForwardResult(None, scores)
        return ForwardResult(self.model.compute_logits(hidden[inputs.sample_indices]), scores)

    def _score(self, hidden: torch.Tensor, inputs: ModelInputs) -> TokenScores | None:
        """The score rows' prompt tokens scored, SCORE_ROWS_PER_PASS rows of logits at a time so
        that a long prompt chunk never holds [chunk, vocab] logits at once (every rank joins each
        pass's logits gather; rank 0 gets the scores). On CUDA at most max_running_seqs rows, the
        sampling the activation reserve was measured for; each pass reads the whole lm_head."""
        scores = None
        per_pass = SCORE_ROWS_PER_PASS if self.device.type == "cpu" else \
            min(SCORE_ROWS_PER_PASS, self.config.max_running_seqs)
        for start in range(0, inputs.score_rows.numel(), per_pass):
            rows = inputs.score_rows[start:start + per_pass]
            logits = self.model.compute_logits(hidden[rows])
            if logits is None:
                continue
            part = score_tokens(logits, inputs.score_targets[start:start + rows.numel()], inputs.score_top_n)
            if scores is None:
                scores = part
            else:
                scores.extend(part)
        return scores


def _require_triton() -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ValueError("attention_backend 'triton' needs the triton package (pip install triton), "
                         "or set attention_backend: torch") from None


def _cpp_kernels_run(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.float32:
        return False
    from engine.kernels import cpu_kernels
    return cpu_kernels.available()


def resolve_max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    """The engine's context (ModelConfig.resolve_context of the config's max_model_len)."""
    return mc.resolve_context(config.max_model_len)


def _rank_device(config: EngineConfig, tp: TensorParallel) -> torch.device:
    device = config.resolved_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", tp.rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def cpu_threads_per_rank(config: EngineConfig) -> int:
    """Torch threads one CPU rank runs with: `config.cpu_threads` (at most the
    cores this process may run on), else those cores shared among the ranks."""
    if config.cpu_threads is not None:
        return min(config.cpu_threads, usable_cpus())
    return max(1, usable_cpus() // config.tensor_parallel_size)


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
            try:
                fn, args = pickle.loads(payload)
            except Exception as exc:  # noqa: BLE001 - e.g. a function this process cannot import
                tp.gather_objects_to_first(RankCallError(f"rank {tp.rank} cannot load the call: "
                                                         f"{type(exc).__name__}: {exc}"))
                continue
            tp.gather_objects_to_first(run_rank_call(worker, fn, args))


def run_rank_call(worker: "ModelWorker", fn, args: tuple):
    """One rank's part of `LLMEngine.collective_rpc`: fn's result, or the
    exception it raised, or why the result cannot be sent (returned, so that
    every rank still joins the gather)."""
    try:
        result = fn(worker, *args)
        pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        return result
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        log.exception("collective call %s failed on rank %d", getattr(fn, "__name__", fn), worker.tp.rank)
        return RankCallError(f"rank {worker.tp.rank}: {type(exc).__name__}: {exc}")


class RankCallError(Exception):
    """A collective call failed on one rank."""


def follower_main(rank: int, size: int, port: int, parent_pid: int, report, config: EngineConfig,
                  backend: str, prefix: str) -> None:
    """Entry point of a spawned rank process; `report`: the writing end of a pipe for the
    error that ends it (rank 0 names it), `prefix`: the gang's keys in rank 0's store."""
    from engine.tp_group import create_group, exit_when_parent_dies
    # Ctrl-C in a terminal reaches the whole process group: rank 0 decides what it means (an
    # idle follower that took it died at rank 0's next command, ending the engine for good)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {rank}] %(levelname)s %(message)s")
    exit_when_parent_dies(parent_pid)
    device = config.resolved_device()
    try:
        tp = create_group(rank, size, "127.0.0.1", port, backend, device, prefix=prefix)
        follow(ModelWorker(config, tp))
    except Exception as exc:
        log.exception("tensor-parallel rank %d failed", rank)
        try:
            report.send(f"{type(exc).__name__}: {exc}"[:1000])
        except Exception:  # noqa: BLE001 - rank 0 gone: nobody to tell
            pass
        # at once: an orderly exit would first tear down this rank's groups, whose gloo
        # pairs wait on rank 0, which waits to see this process gone to say which rank failed
        logging.shutdown()
        os._exit(1)
