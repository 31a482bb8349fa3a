"""How a model fits on GPUs before any are touched: weights and KV cache per
rank, how many tokens and sequences the KV cache holds, and the decode-step
floor set by memory bandwidth.

Pure arithmetic on a `ModelConfig`; nothing is allocated. Sizes follow the
model's tensor-parallel sharding exactly (engine/model/linear.py,
engine/model/embedding.py): attention heads and MLP columns split evenly over
`tp` ranks; KV heads split evenly, or one KV head per rank when there are
fewer KV heads than ranks; the vocabulary padded to `ceil(vocab / tp)` rows
per rank; RMSNorm weights and the o_proj / down_proj biases on every rank.

A replica is one tensor-parallel gang of `tp` ranks, one GPU per rank. Every
rank holds every token's K and V for its own heads, so the per-rank token
capacity is the replica's capacity.

Problems and suggestions are phrased for the `pdserve plan` command line and
name the flag to change (--tp, --max-model-len, --dtype,
--gpu-memory-utilization).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from engine.dtypes import dtype_size, parse_dtype
from engine.kv_cache import GIB
from engine.model.model_config import ModelConfig

TP_CANDIDATES = (1, 2, 4, 8, 16)
# Suggested max_model_len values are multiples of this, so they read as round numbers.
MAX_MODEL_LEN_STEP = 256
# Above this the allocator's fragmentation and NCCL's buffers tend to run out of room.
MAX_SUGGESTED_UTILIZATION = 0.95


@dataclass(frozen=True)
class GpuType:
    name: str
    hbm_bytes_per_s: float
    memory_gib: float


GPU_TYPES: Mapping[str, GpuType] = MappingProxyType({
    "H100-SXM": GpuType("H100-SXM", 3.35e12, 80.0),
    "H200": GpuType("H200", 4.8e12, 141.0),
    "A100-80GB": GpuType("A100-80GB", 2.0e12, 80.0),
})
# lower-case short name -> GPU_TYPES key
GPU_ALIASES: Mapping[str, str] = MappingProxyType({"h100": "H100-SXM", "h200": "H200", "a100": "A100-80GB"})


def resolve_gpu_type(name: str) -> GpuType:
    """The GpuType for a GPU_TYPES name or a GPU_ALIASES alias, case-insensitively;
    ValueError naming --gpu-type otherwise."""
    key = name.lower()
    canonical = GPU_ALIASES.get(key) or next((c for c in GPU_TYPES if c.lower() == key), None)
    if canonical is None:
        known = ", ".join(f"{c} ({a})" for a, c in GPU_ALIASES.items())
        raise ValueError(f"--gpu-type: unknown GPU type {name!r}; choose one of {known}")
    return GPU_TYPES[canonical]


def resolve_dtype(model: ModelConfig, dtype: str) -> str:
    """Canonical name (float32 / float16 / bfloat16) of the dtype the weights and
    KV cache take on GPU: `auto` is the checkpoint's, with float32 checkpoints
    run in bfloat16, as the engine does on CUDA."""
    try:
        name = str(parse_dtype(model.torch_dtype if dtype == "auto" else dtype)).removeprefix("torch.")
    except ValueError:
        if dtype == "auto":
            raise ValueError(f"the checkpoint's torch_dtype {model.torch_dtype!r} is not supported; "
                             "pass --dtype float32, float16 or bfloat16") from None
        raise ValueError(f"--dtype must be auto, float32, float16 or bfloat16 (or fp16, bf16); "
                         f"got {dtype!r}") from None
    return "bfloat16" if dtype == "auto" and name == "float32" else name


def tp_problem(model: ModelConfig, tp: int) -> str | None:
    """Why the model cannot be sharded over `tp` ranks, or None if it can."""
    if tp < 1:
        return f"--tp must be >= 1, got {tp}"
    if model.num_heads % tp:
        return f"num_attention_heads ({model.num_heads}) is not divisible by --tp {tp}"
    if model.num_kv_heads >= tp and model.num_kv_heads % tp:
        return f"num_key_value_heads ({model.num_kv_heads}) is not divisible by --tp {tp}"
    if model.num_kv_heads < tp and tp % model.num_kv_heads:
        return (f"--tp {tp} is larger than num_key_value_heads ({model.num_kv_heads}) "
                "and not a multiple of it")
    if model.intermediate_size % tp:
        return f"intermediate_size ({model.intermediate_size}) is not divisible by --tp {tp}"
    return None


def valid_tps(model: ModelConfig) -> list[int]:
    return [tp for tp in TP_CANDIDATES if tp_problem(model, tp) is None]


def local_kv_heads(model: ModelConfig, tp: int) -> int:
    """KV heads one rank holds: an even share, or one replicated head."""
    return max(1, model.num_kv_heads // tp)


def rank_parameters(model: ModelConfig, tp: int) -> int:
    """Elements one rank holds, as the model shards them. With tp=1 this is
    the whole model's parameter count (a tied lm_head counted once)."""
    h, d, inter = model.hidden_size, model.head_dim, model.intermediate_size // tp
    heads, kv_heads = model.num_heads // tp, local_kv_heads(model, tp)
    vocab_rows = -(-model.vocab_size // tp)
    embeddings = vocab_rows * h * (1 if model.tie_word_embeddings else 2)
    qkv = h * (heads + 2 * kv_heads) * d + (heads + 2 * kv_heads) * d * model.qkv_bias
    o_proj = heads * d * h + h * model.o_bias
    mlp = 3 * h * inter + (2 * inter + h) * model.mlp_bias
    norms = 2 * h
    return embeddings + model.num_layers * (qkv + o_proj + mlp + norms) + h


def kv_bytes_per_token(model: ModelConfig, tp: int, dtype: str) -> int:
    """K and V of one token on one rank; tp=1 gives the whole model's."""
    return 2 * model.num_layers * local_kv_heads(model, tp) * model.head_dim * dtype_size(dtype)


@dataclass(frozen=True)
class Plan:
    """Memory and bandwidth arithmetic for one replica; sizes in bytes."""
    architecture: str
    tp: int
    dtype: str
    gpu_type: str
    gpu_memory_gib: float
    gpu_memory_utilization: float
    overhead_gib: float
    block_size: int
    max_model_len: int
    parameters: int                      # whole model
    weight_bytes_total: int              # whole model, no replication
    weight_bytes_per_rank: int           # one rank's shards, replicated parts and vocab padding included
    kv_bytes_per_token: int              # whole model, K and V
    kv_bytes_per_token_per_rank: int
    kv_budget_bytes_per_rank: int        # negative when the weights alone do not fit
    kv_tokens_capacity: int              # whole blocks; the replica's capacity
    max_concurrent_sequences: int        # sequences of max_model_len that fit at once
    decode_floor_ms_batch1: float        # weights + one max_model_len sequence's KV, read once
    decode_floor_ms_weights_only: float
    fits: bool
    kv_transfer_staging_gib: float = 0.0  # left free for KV hand-off buffers (prefill and decode replicas)
    problems: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Fit:
    weight_bytes: int
    kv_bytes: int
    budget: int
    capacity: int
    max_model_len: int
    block_size: int

    @property
    def blocks_per_sequence(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def sequences(self) -> int:
        # A sequence occupies whole blocks, so count blocks, not tokens.
        return self.capacity // self.block_size // self.blocks_per_sequence

    @property
    def fits(self) -> bool:
        return self.sequences >= 1


def _fit(model: ModelConfig, tp: int, dtype: str, gpu_memory_gib: float, utilization: float,
         overhead_gib: float, max_model_len: int, block_size: int) -> _Fit:
    weight_bytes = rank_parameters(model, tp) * dtype_size(dtype)
    kv_bytes = kv_bytes_per_token(model, tp, dtype)
    budget = math.floor((gpu_memory_gib * utilization - overhead_gib) * GIB) - weight_bytes
    capacity = max(0, budget) // kv_bytes // block_size * block_size
    return _Fit(weight_bytes, kv_bytes, budget, capacity, max_model_len, block_size)


def plan(model: ModelConfig, *, tp: int, gpu_memory_gib: float, gpu_memory_utilization: float = 0.9,
         dtype: str = "auto", max_model_len: int | None = None, gpu_type: str = "H100-SXM",
         overhead_gib: float = 1.0, block_size: int = 16, kv_transfer_staging_gib: float = 0.0) -> Plan:
    """Sizes one replica of `model` over `tp` GPUs of `gpu_memory_gib` each.

    The KV budget per rank is gpu_memory_gib * gpu_memory_utilization minus the
    rank's weights minus `overhead_gib` (activations, CUDA context, workspace)
    minus `kv_transfer_staging_gib` (the hand-off buffers a prefill or decode
    replica leaves free: kv_transfer.staging_mib; 0 for a colocated one).
    The decode floors are the time to read the rank's weights (and one full
    `max_model_len` sequence's KV) once from HBM at `gpu_type`'s bandwidth; the
    tensor-parallel all-reduces are not included, so real steps are slower.

    Raises ValueError, naming the flag, for a tp the head counts do not allow,
    an unknown dtype or GPU type, or a max_model_len the model does not support.
    """
    gpu = resolve_gpu_type(gpu_type)
    problem = tp_problem(model, tp)
    if problem:
        raise ValueError(f"{problem}; valid --tp values: {', '.join(map(str, valid_tps(model)))}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    if gpu_memory_gib <= 0:
        raise ValueError(f"--gpu-memory-gib must be > 0, got {gpu_memory_gib}")
    if overhead_gib < 0:
        raise ValueError(f"--overhead-gib must be >= 0, got {overhead_gib}")
    if kv_transfer_staging_gib < 0:
        raise ValueError(f"--kv-transfer-staging-mib must be >= 0, got {kv_transfer_staging_gib * 1024:g}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    limit = model.longest_context      # as the engine accepts it (ModelConfig.resolve_context)
    if max_model_len is None:
        max_model_len = model.default_context     # as the engine takes it
    elif not 1 <= max_model_len <= limit:
        raise ValueError(f"--max-model-len must be in [1, {limit}] for this model, got {max_model_len}")
    dtype = resolve_dtype(model, dtype)

    reserved_gib = overhead_gib + kv_transfer_staging_gib     # per rank, besides weights and KV
    fit = _fit(model, tp, dtype, gpu_memory_gib, gpu_memory_utilization, reserved_gib, max_model_len, block_size)
    problems: list[str] = []
    suggestions: list[str] = []
    if not fit.fits:
        problems.append(_problem(fit, gpu_memory_gib, gpu_memory_utilization, overhead_gib, kv_transfer_staging_gib))
        suggestions = _suggestions(model, tp, dtype, gpu_memory_gib, gpu_memory_utilization, reserved_gib,
                                   max_model_len, block_size, fit)
    ms_per_byte = 1e3 / gpu.hbm_bytes_per_s
    return Plan(
        architecture=model.architecture, tp=tp, dtype=dtype, gpu_type=gpu.name,
        gpu_memory_gib=gpu_memory_gib, gpu_memory_utilization=gpu_memory_utilization,
        overhead_gib=overhead_gib, block_size=block_size, max_model_len=max_model_len,
        parameters=rank_parameters(model, 1),
        weight_bytes_total=rank_parameters(model, 1) * dtype_size(dtype),
        weight_bytes_per_rank=fit.weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token(model, 1, dtype),
        kv_bytes_per_token_per_rank=fit.kv_bytes,
        kv_budget_bytes_per_rank=fit.budget,
        kv_tokens_capacity=fit.capacity,
        max_concurrent_sequences=fit.sequences,
        decode_floor_ms_batch1=(fit.weight_bytes + fit.kv_bytes * max_model_len) * ms_per_byte,
        decode_floor_ms_weights_only=fit.weight_bytes * ms_per_byte,
        fits=fit.fits, kv_transfer_staging_gib=kv_transfer_staging_gib, problems=problems, suggestions=suggestions,
    )


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _problem(fit: _Fit, gpu_memory_gib: float, utilization: float, overhead_gib: float,
             staging_gib: float) -> str:
    available = fit.budget + fit.weight_bytes
    if fit.budget <= 0:
        return (f"weights need {_gib(fit.weight_bytes)} per rank but only {gpu_memory_gib:g} GiB × "
                f"{utilization:g} − {_reserved(overhead_gib, staging_gib)} = {_gib(available)} is available: "
                f"short by {_gib(fit.weight_bytes - available)}")
    needed = fit.blocks_per_sequence * fit.block_size * fit.kv_bytes
    return (f"the KV cache holds {fit.capacity:,} tokens, fewer than one max_model_len={fit.max_model_len:,} "
            f"sequence: its KV needs {_gib(needed)} per rank, {_gib(fit.budget)} is left after the weights, "
            f"short by {_gib(needed - fit.budget)}")


def _reserved(overhead_gib: float, staging_gib: float) -> str:
    text = f"{overhead_gib:g} GiB overhead"
    return text + (f" − {staging_gib:g} GiB hand-off buffers" if staging_gib else "")


def _describe(fit: _Fit) -> str:
    noun = "sequence" if fit.sequences == 1 else "sequences"
    return (f"{_gib(fit.weight_bytes)} weights per rank, KV cache for {fit.capacity:,} tokens "
            f"({fit.sequences:,} {noun} of {fit.max_model_len:,})")


def _suggestions(model: ModelConfig, tp: int, dtype: str, gpu_memory_gib: float, utilization: float,
                 overhead_gib: float, max_model_len: int, block_size: int, fit: _Fit) -> list[str]:
    """What would fit, changing one flag at a time (two for --dtype when it alone is not enough)."""
    def at(tp_: int = tp, dtype_: str = dtype, utilization_: float = utilization) -> _Fit:
        return _fit(model, tp_, dtype_, gpu_memory_gib, utilization_, overhead_gib, max_model_len, block_size)

    out: list[str] = []
    smallest_tp = next((t for t in valid_tps(model) if t != tp and at(t).fits), None)
    if smallest_tp is not None:
        out.append(f"--tp {smallest_tp}: {_describe(at(smallest_tp))}")

    longest = fit.capacity // MAX_MODEL_LEN_STEP * MAX_MODEL_LEN_STEP
    if longest >= MAX_MODEL_LEN_STEP:
        out.append(f"--max-model-len {longest}: {_describe(replace(fit, max_model_len=longest))}")

    needed = fit.weight_bytes + math.ceil(overhead_gib * GIB) + fit.blocks_per_sequence * block_size * fit.kv_bytes
    raised = math.ceil(needed / (gpu_memory_gib * GIB) * 100) / 100
    if raised <= MAX_SUGGESTED_UTILIZATION and not at(utilization_=raised).fits:
        raised = round(raised + 0.01, 2)   # floor-to-block rounding can leave it a hair short
    if utilization < raised <= MAX_SUGGESTED_UTILIZATION and at(utilization_=raised).fits:
        out.append(f"--gpu-memory-utilization {raised:.2f}: {_describe(at(utilization_=raised))}")

    if dtype == "float32":
        if at(dtype_="bfloat16").fits:
            out.append(f"--dtype bfloat16: {_describe(at(dtype_='bfloat16'))}")
        else:
            half_tp = next((t for t in valid_tps(model) if at(t, "bfloat16").fits), None)
            if half_tp is not None:
                out.append(f"--dtype bfloat16 --tp {half_tp}: {_describe(at(half_tp, 'bfloat16'))}")
    return out


def format_plan(p: Plan) -> str:
    """A human-readable table of the plan, then its problems and suggestions."""
    rows = [
        ("model", f"{p.architecture}, {p.parameters / 1e9:.2f} B parameters"),
        ("replica", f"--tp {p.tp} × {p.gpu_type} ({p.gpu_memory_gib:g} GiB), {p.dtype}"),
        ("memory per rank", f"{p.gpu_memory_gib:g} GiB × {p.gpu_memory_utilization:g} "
                            f"− {_reserved(p.overhead_gib, p.kv_transfer_staging_gib)}"),
        ("weights, whole model", f"{_gib(p.weight_bytes_total)} ({p.weight_bytes_total:,} B)"),
        ("weights per rank", f"{_gib(p.weight_bytes_per_rank)} ({p.weight_bytes_per_rank:,} B)"),
        ("KV per token, whole model", f"{p.kv_bytes_per_token:,} B"),
        ("KV per token per rank", f"{p.kv_bytes_per_token_per_rank:,} B"),
        ("KV budget per rank", f"{_gib(p.kv_budget_bytes_per_rank)}"),
        ("KV capacity", f"{p.kv_tokens_capacity:,} tokens ({p.kv_tokens_capacity // p.block_size:,} "
                        f"blocks of {p.block_size})"),
        ("max_model_len", f"{p.max_model_len:,}"),
        ("concurrent sequences", f"{p.max_concurrent_sequences:,} at max_model_len"),
        ("decode floor, weights only", f"{p.decode_floor_ms_weights_only:.2f} ms/step"),
        ("decode floor, 1 seq at full len", f"{p.decode_floor_ms_batch1:.2f} ms/step"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append(f"(decode floors: HBM reads only at {p.gpu_type} bandwidth; all-reduce time not included)")
    lines.append(f"fits: {'yes' if p.fits else 'no'}")
    lines += [f"problem: {text}" for text in p.problems]
    lines += [f"would fit: {text}" for text in p.suggestions]
    if not p.fits and not p.suggestions:
        lines.append("would fit: nothing found by changing --tp, --max-model-len, "
                     "--gpu-memory-utilization or --dtype alone")
    return "\n".join(lines)
