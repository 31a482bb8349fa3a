"""Skinny matrix products for decode: y = x W^T with few rows in x.

A decode step of a small batch multiplies a handful of activation rows by every
weight matrix of the model: the time is the weight bytes over memory bandwidth,
and the kernel's only job is to keep enough loads in flight to stream W at the
copy rate. Each program owns BLOCK_N output features (rows of W) and a slice of
K; it streams its [BLOCK_N, BLOCK_K] tiles of W with 16-byte loads along K,
multiplies them with the M activation rows in fp32 registers and reduces over K.
With SPLIT_K > 1 the K slices of one feature are summed in an fp32 buffer by
atomics (for matrices with few output features, e.g. a down projection), then
cast to the output dtype.

    x: [M, K] (row-major, M <= MAX_ROWS)   W: [N, K] (row-major, nn.Linear layout)
    y: [M, N] in x's dtype, fp32 accumulation

`skinny_linear(x, w)` picks a tile configuration per (N, K, padded M) from the
device's table in `CONFIGS_BY_GPU` (measured on an H100 and an H200 with
bench/gpu_gemv.py) or a default.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_ROWS = 16   # the largest x the kernel takes
# the engine routes matmuls of up to this many rows here: at 1 row the whole decode
# step's matmuls took 5.04 ms against cuBLAS's 5.54 (the copy floor: 5.00) (H100, Llama-3-8B shapes,
# bench/gpu_gemv.py); at 8 rows this kernel was 3.8x slower than cuBLAS
ROWS_FASTER_THAN_CUBLAS = 1


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, EVEN: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    for k in range(k_begin, k_begin + k_per_split, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN:
            w = tl.load(w_rows + offs_k[None, :])                                   # [BN, BK]
            x = tl.load(x_rows + offs_k[None, :], mask=offs_m[:, None] < M, other=0.0)  # [BM, BK]
        else:
            k_ok = offs_k[None, :] < K
            w = tl.load(w_rows + offs_k[None, :], mask=(offs_n[:, None] < N) & k_ok, other=0.0)
            x = tl.load(x_rows + offs_k[None, :], mask=(offs_m[:, None] < M) & k_ok, other=0.0)
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]          # [BM, BN, BK]
        acc += tl.sum(prod, axis=2)
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y, acc, mask=mask)


# (N, K, BLOCK_M) -> (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), the fastest of
# bench/gpu_gemv.py's search per GPU (Llama-3-8B shapes: qkv, o, gate_up, down, lm_head)
TileConfigs = dict[tuple[int, int, int], tuple[int, int, int, int, int]]
CONFIGS_BY_GPU: dict[str, TileConfigs] = {
    # a batch-1 decode step's matmuls: 5.04 ms against cuBLAS's 5.54 (copy floor 5.00)
    "H100": {
        (4096, 4096, 1): (2, 2048, 1, 4, 2),
        (4096, 14336, 1): (2, 2048, 1, 4, 4),
        (6144, 4096, 1): (4, 2048, 1, 8, 4),
        (28672, 4096, 1): (2, 2048, 1, 4, 3),
        (128256, 4096, 1): (2, 2048, 1, 4, 2),
    },
    # 3.85 ms against cuBLAS's 4.09 (copy floor 3.56); the H100's tiles took 4.00 ms there
    "H200": {
        (4096, 4096, 1): (2, 2048, 1, 4, 4),
        (4096, 14336, 1): (4, 1024, 1, 4, 2),
        (6144, 4096, 1): (2, 2048, 1, 4, 2),
        (28672, 4096, 1): (8, 2048, 1, 4, 2),
        (128256, 4096, 1): (8, 2048, 1, 4, 4),
    },
}
DEFAULT_CONFIG = (2, 2048, 1, 4, 3)   # the most frequent winner


@functools.lru_cache(maxsize=None)
def tile_configs(device: torch.device) -> TileConfigs:
    """The tile table of `device`'s GPU (matched by name, e.g. "NVIDIA H200"); the H100's
    for any other GPU, and on CPU (Triton's interpreter)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((table for gpu, table in CONFIGS_BY_GPU.items() if gpu in name), CONFIGS_BY_GPU["H100"])


def padded_rows(m: int) -> int:
    """The kernel's BLOCK_M for m rows: the next power of two (one compile each)."""
    return max(1, triton.next_power_of_2(m))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int, int] | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T for x [M, K] with M <= MAX_ROWS (both CUDA, same dtype, last dim contiguous)."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {m}")
    if w.stride(1) != 1:
        raise ValueError("skinny_linear needs w contiguous along K")
    x = x if x.stride(1) == 1 else x.contiguous()
    block_m = padded_rows(m)
    block_n, block_k, split_k, warps, stages = config or tile_configs(x.device).get((n, k, block_m), DEFAULT_CONFIG)
    even = n % block_n == 0 and k % (block_k * split_k) == 0
    grid = (triton.cdiv(n, block_n), split_k)
    if split_k == 1:
        y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
        _skinny_gemm_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=1, EVEN=even,
                                  num_warps=warps, num_stages=stages)
        return y
    acc = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    _skinny_gemm_kernel[grid](x, w, acc, m, n, k, x.stride(0), w.stride(0), acc.stride(0),
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, EVEN=even,
                              num_warps=warps, num_stages=stages)
    if out is not None:
        return out.copy_(acc)
    return acc.to(x.dtype)
