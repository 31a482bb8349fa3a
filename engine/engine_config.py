"""Engine options: plain typed values, validated once here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class EngineConfig:
    model: str                                  # checkpoint directory (HuggingFace format)
    tokenizer: str | None = None                # defaults to `model`
    dtype: str = "auto"                         # auto: float32 on CPU, the checkpoint's 16-bit type on CUDA
    device: str = "auto"                        # auto: cuda if available, else cpu
    max_model_len: int | None = None            # default: the model's context (ModelConfig.default_context)
    block_size: int = 16
    num_kv_blocks: int | None = None            # fixed pool size; overrides the memory budget
    kv_cache_memory_gib: float = 1.0            # CPU: KV budget
    gpu_memory_utilization: float = 0.90        # CUDA: fraction of the device the process may use
    kv_transfer_staging_gib: float = 0.0        # CUDA: of that, left free beside the KV cache for KV hand-off
                                                # buffers (a disaggregated worker's)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0                               # for unseeded sampling
    tensor_parallel_size: int = 1               # ranks the model is sharded over
    tp_backend: str = "auto"                    # auto: nccl for CUDA tensors, gloo for CPU tensors
    cpu_threads: int | None = None              # CPU: torch threads per rank; default: cores // TP
    # CPU, TP 1: a file through which engines on one machine lend idle cores to busy ones
    # (engine/core_lending.py; "auto": this user's for the cores the process may run on);
    # None: the engine keeps its cpu_threads
    cpu_core_ledger: str | None = None
    # CPU: linear weights also kept packed for oneDNN and, float32, in panels for the few-row kernel
    # (engine/model/cpu_gemm.py); the path per batch size is measured at load
    cpu_weight_prepack: bool = True
    # attention kernels: "triton" reads K/V in place from the cache blocks (default on CUDA);
    # "cpp": decode attention in C++ reading the blocks in place (default on CPU, float32, where
    # the extension builds); "torch" gathers each sequence's blocks and runs SDPA
    attention_backend: str = "auto"
    enforce_eager: bool = False                 # CUDA: no CUDA graphs (they need attention_backend triton)
    max_cuda_graph_batch_size: int = 256        # CUDA: decode batches up to this replay a captured graph
    fused_ops: bool = True                      # fused RMSNorm+residual, SiLU-and-mul, rotary:
                                                # Triton on CUDA, C++ on CPU (float32)
    skinny_gemm: bool = True                    # CUDA: one-row matmuls (batch-1 decode) through a Triton GEMV
    # the next step is scheduled and launched while the device runs the current one; its
    # outputs come back one step() call later. auto: on for CUDA with tensor_parallel_size 1
    async_scheduling: bool | str = "auto"

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_model_len", "block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size", "cpu_threads", "max_cuda_graph_batch_size"):
            positive(name)
        if self.max_model_len == 1:
            raise ValueError("max_model_len must be at least 2: a prompt of one token and one output token; "
                             "with 1 every request would be refused")
        # (the string "false" is true: a flag read from a file or a command line must arrive as a bool)
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "cpu_weight_prepack", "enforce_eager",
                     "fused_ops", "skinny_gemm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -2**63 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer within 64 bits, got {self.seed!r}")
        for name in ("gpu_memory_utilization", "kv_cache_memory_gib", "kv_transfer_staging_gib"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not isinstance(self.device, str):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.kv_transfer_staging_gib < 0:
            raise ValueError(f"kv_transfer_staging_gib must be >= 0, got {self.kv_transfer_staging_gib}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.device.startswith("cuda:") and self.tensor_parallel_size > 1:
            raise ValueError(f"device {self.device!r} would put every rank on one GPU; use device='cuda' with "
                             "tensor_parallel_size > 1 (rank r uses cuda:r)")
        if self.attention_backend not in ("auto", "torch", "triton", "cpp"):
            raise ValueError(f"attention_backend must be auto, torch, triton or cpp, got {self.attention_backend!r}")
        # (1 == True: an int would pass `in` and then miss the `is True` below)
        if not (isinstance(self.async_scheduling, bool) or self.async_scheduling == "auto"):
            raise ValueError(f"async_scheduling must be auto, true or false, got {self.async_scheduling!r}")
        if self.async_scheduling is True and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size 1 (the other ranks would need each "
                             "step's sampled tokens); set async_scheduling to auto or false")
        if self.tp_backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"tp_backend must be auto, gloo or nccl, got {self.tp_backend!r}")

    def check_devices(self) -> None:
        """Raises ValueError unless this process sees the devices the engine needs
        (checked where the engine starts, not where the config is written: a
        deployment is often built on a machine without the workers' GPUs)."""
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device is cuda but no CUDA device is visible; use device='cpu'")
        if self.tensor_parallel_size > 1 and self.resolved_device().type == "cuda" and \
                self.tensor_parallel_size > torch.cuda.device_count():   # device auto too
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) is more than the "
                             f"{torch.cuda.device_count()} visible CUDA device(s)")

    @property
    def max_running_seqs(self) -> int:
        """The most sequences that run at once: max_num_seqs, but no more than a step
        has tokens (each running sequence takes one of every step; engine/scheduler.py)."""
        return min(self.max_num_seqs, self.max_num_batched_tokens)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_attention_backend(self) -> str:
        """triton on CUDA, cpp on CPU, unless set (the worker falls back from an
        automatic cpp to torch where the kernel cannot run). triton on CPU runs
        only under Triton's interpreter (TRITON_INTERPRET=1), for tests."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.resolved_device().type == "cuda" else "cpp"

    def uses_async_scheduling(self) -> bool:
        if self.async_scheduling == "auto":
            return self.resolved_device().type == "cuda" and self.tensor_parallel_size == 1
        return self.async_scheduling

    def uses_cuda_graphs(self) -> bool:
        return (self.resolved_device().type == "cuda" and not self.enforce_eager
                and self.resolved_attention_backend() == "triton")

    def resolved_dtype(self, checkpoint_dtype: str) -> torch.dtype:
        from engine.dtypes import parse_dtype
        if self.dtype != "auto":
            return parse_dtype(self.dtype)
        if self.resolved_device().type == "cpu":
            return torch.float32
        ckpt = parse_dtype(checkpoint_dtype)
        return torch.bfloat16 if ckpt == torch.float32 else ckpt
