"""Fused Triton kernels for the small, memory-bound ops of a Llama decoder layer.

Each op below replaces a chain of eager torch ops that each read and write the
whole activation tensor (and each cost a kernel launch) with one kernel that
reads its inputs once and writes its outputs once. On the decode path the
tensors are tiny and launch count dominates; on prefill the passes over memory
do. The arithmetic reproduces the eager reference's rounding steps (casts to
the model dtype at the same points), so bf16/fp16 results match the torch
model bit for bit except where a reduction order or a transcendental differs
in its last fp32 bit (see each op).

    rms_norm            x.float() -> pow(2) -> mean -> +eps -> rsqrt -> mul
                        -> .to(dtype) -> * weight        (8 eager kernels -> 1)
    fused_add_rms_norm  x + residual, then rms_norm of the sum  (9 -> 1)
    silu_and_mul        silu(gate) * up on a fused [T, 2n] gate_up output
                        (2 -> 1, and no [T, n] silu temporary)
    apply_rotary        NeoX (rotate-half) RoPE of q and k, cos/sin looked up
                        by position; q and k may be strided views into a fused
                        qkv output (gathers, casts, negs, cats, muls, adds for
                        both tensors: ~16 -> 1)

All functions take torch tensors on any device Triton can launch on (CUDA; or
CPU when TRITON_INTERPRET=1 is set before triton is imported, which the tests
use). Inputs must have a unit stride in their last dimension; other strides
are passed to the kernels, so views need no copy. Every function returns new
tensors unless preallocated outputs are passed; the docstrings say which
outputs may alias inputs. Computation is in fp32 registers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Triton's CPU interpreter truncates fp32 -> bf16 casts instead of rounding to
# nearest-even as the GPU's cvt.rn does; under it, _to_dtype rounds by hand.
_INTERPRET = tl.constexpr(_interpreting())

__all__ = [
    "apply_rotary",
    "benchmark_fused_ops",
    "fused_add_rms_norm",
    "rms_norm",
    "silu_and_mul",
]

# Sizes that bound loops (hidden, head counts) are tl.constexpr: they are fixed
# per model, so this costs one compile each, and Triton's CPU interpreter
# cannot take a runtime scalar as a loop bound (with NumPy 2).

# Rows up to this many elements are normalised from registers in one pass;
# longer rows loop over chunks of this size (two passes over the row).
MAX_ROW_BLOCK = 16384
# Elements per program for silu_and_mul (grid = tokens x column blocks).
SILU_BLOCK = 2048
# Upper bound on heads x head_dim/2 elements a rotary program holds at once.
ROTARY_TILE = 2048


@triton.jit
def _to_dtype(x, ty: tl.constexpr):
    """fp32 -> ty rounded to nearest-even, like torch's .to(dtype)."""
    if _INTERPRET:  # noqa: SIM102 (both conditions are compile-time constants)
        if ty == tl.bfloat16:
            u = x.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            is_nan = x != x  # noqa: PLR0124
            x = tl.where(is_nan, x, u.to(tl.float32, bitcast=True))
    return x.to(ty)


# ----------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,          # x [T, hidden], weight [hidden], out [T, hidden]
    x_row_stride, out_row_stride,
    eps, HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    in_ty = x_ptr.dtype.element_ty
    out_ty = out_ptr.dtype.element_ty
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < HIDDEN
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # normalise in fp32, round to the input dtype, then scale by the weight
        y = _to_dtype(x * rstd, in_ty).to(tl.float32) * w
        tl.store(out_row + cols, _to_dtype(y, out_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, HIDDEN, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / HIDDEN + eps)
        for start in range(0, HIDDEN, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < HIDDEN
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = _to_dtype(x * rstd, in_ty).to(tl.float32) * w
            tl.store(out_row + cols, _to_dtype(y, out_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr,          # x, residual [T, hidden]; weight [hidden]
    out_ptr, res_out_ptr,           # normed, new residual [T, hidden]
    x_row_stride, res_row_stride, out_row_stride, res_out_row_stride,
    eps, HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    res_row = res_ptr + row * res_row_stride
    out_row = out_ptr + row * out_row_stride
    res_out_row = res_out_ptr + row * res_out_row_stride
    sum_ty = res_out_ptr.dtype.element_ty
    out_ty = out_ptr.dtype.element_ty
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < HIDDEN
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
        # the residual sum is rounded to the model dtype, as torch's x + residual
        s = _to_dtype(x + r, sum_ty)
        tl.store(res_out_row + cols, s, mask=mask)
        s = s.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(s * s, axis=0) / HIDDEN + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = _to_dtype(s * rstd, sum_ty).to(tl.float32) * w
        tl.store(out_row + cols, _to_dtype(y, out_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, HIDDEN, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < HIDDEN
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
            s = _to_dtype(x + r, sum_ty)
            tl.store(res_out_row + cols, s, mask=mask)
            s = s.to(tl.float32)
            acc += s * s
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / HIDDEN + eps)
        # make this program's residual stores visible to all of its threads
        # before reading them back (the outputs may alias x or residual, so
        # the sum cannot be recomputed from the inputs)
        tl.debug_barrier()
        for start in range(0, HIDDEN, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < HIDDEN
            s = tl.load(res_out_row + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = _to_dtype(s * rstd, sum_ty).to(tl.float32) * w
            tl.store(out_row + cols, _to_dtype(y, out_ty), mask=mask)


def _row_launch(hidden: int) -> tuple[int, bool, int]:
    """(BLOCK, SINGLE_PASS, num_warps) for a one-program-per-row kernel."""
    block = min(triton.next_power_of_2(hidden), MAX_ROW_BLOCK)
    num_warps = min(max(block // 512, 4), 16)
    return block, block >= hidden, num_warps


def _check_2d(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(f"{name} must be 2-D with a unit last-dim stride, got "
                         f"shape {tuple(t.shape)} strides {t.stride()}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def _check_out(name: str, out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> None:
    _check_2d(name, out, shape)
    if out.dtype != dtype or out.device != device:
        raise ValueError(f"{name} must be {dtype} on {device}, got {out.dtype} on {out.device}")


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{x.shape[-1]}], got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of x [T, hidden] with weight [hidden].

    Computes the transformers/engine reference step for step
        x32 = x.float(); x32 = x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)
    i.e. normalised in fp32, rounded to x.dtype, then multiplied by the weight
    with the product rounded to the result dtype, which is torch's promotion of
    (weight.dtype, x.dtype) (x.dtype when they agree). Only the fp32 sum of
    squares is accumulated in a different order than torch's.

    Returns a new [T, hidden] tensor, or writes into `out` (same shape, the
    result dtype; may be x itself: each row is read before it is written).
    """
    _check_2d("x", x)
    _check_weight(weight, x)
    T, hidden = x.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty((T, hidden), dtype=out_dtype, device=x.device)
    else:
        _check_out("out", out, (T, hidden), out_dtype, x.device)
    if T == 0:
        return out
    block, single, num_warps = _row_launch(hidden)
    _rms_norm_kernel[(T,)](
        x, weight, out, x.stride(0), out.stride(0), float(eps),
        HIDDEN=hidden, BLOCK=block, SINGLE_PASS=single, num_warps=num_warps,
    )
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, *, out: torch.Tensor | None = None,
                       residual_out: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual, weight, eps), x + residual) in one pass.

    x and residual: [T, hidden], same dtype. The new residual is x + residual
    rounded to that dtype exactly as torch's `x + residual`; the normed output
    is `rms_norm` of that rounded sum (same contract and result dtype as
    `rms_norm`).

    Not in place by default: returns two new tensors (normed, new_residual) and
    leaves x and residual untouched. Preallocated outputs may be passed instead;
    `residual_out` (dtype of x) and `out` must be distinct tensors, but either
    may alias x or residual (e.g. out=x, residual_out=residual for the vLLM-
    style in-place update): every element is read before it is overwritten.
    """
    _check_2d("x", x)
    _check_2d("residual", residual, tuple(x.shape))
    if residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError("x and residual must have the same dtype and device")
    _check_weight(weight, x)
    T, hidden = x.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty((T, hidden), dtype=out_dtype, device=x.device)
    else:
        _check_out("out", out, (T, hidden), out_dtype, x.device)
    if residual_out is None:
        residual_out = torch.empty((T, hidden), dtype=x.dtype, device=x.device)
    else:
        _check_out("residual_out", residual_out, (T, hidden), x.dtype, x.device)
    if T > 0 and out.data_ptr() == residual_out.data_ptr():
        raise ValueError("out and residual_out must be different tensors")
    if T == 0:
        return out, residual_out
    block, single, num_warps = _row_launch(hidden)
    _fused_add_rms_norm_kernel[(T,)](
        x, residual, weight, out, residual_out,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        float(eps),
        HIDDEN=hidden, BLOCK=block, SINGLE_PASS=single, num_warps=num_warps,
    )
    return out, residual_out


# ----------------------------------------------------------------------------
# SiLU-and-mul (SwiGLU activation)
# ----------------------------------------------------------------------------

@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr,                 # x [T, 2n] = [gate | up], out [T, n]
    x_row_stride, out_row_stride, n,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    x_row = x_ptr + row * x_row_stride
    out_ty = out_ptr.dtype.element_ty
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + n + cols, mask=mask, other=0.0).to(tl.float32)
    # torch: silu in fp32 rounded to the dtype, then a dtype multiply; exp's argument capped below
    # FLT_MAX's log (a gate of -300 then gives ~-2e-36, not an approximate division by inf)
    act = _to_dtype(gate / (1.0 + tl.exp(tl.minimum(-gate, 88.0))), out_ty).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, _to_dtype(act * up, out_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.silu(gate) * up for x [T, 2n] = cat(gate, up, dim=-1); returns [T, n].

    Same dtype as x. silu is computed in fp32 and rounded to x.dtype before
    the multiply, whose product is rounded to x.dtype, as torch's eager ops do;
    only exp's last fp32 bit may differ from torch's, so 16-bit results match
    bit for bit except for rare 1-ulp differences.

    Returns a new tensor, or writes into `out` ([T, n], x.dtype; may be the
    view x[:, :n]: each element is read before the same program writes it).
    """
    _check_2d("x", x)
    T, two_n = x.shape
    if two_n % 2:
        raise ValueError(f"last dim of x must be even (gate | up), got {two_n}")
    n = two_n // 2
    if out is None:
        out = torch.empty((T, n), dtype=x.dtype, device=x.device)
    else:
        _check_out("out", out, (T, n), x.dtype, x.device)
    if T == 0 or n == 0:
        return out
    block = min(triton.next_power_of_2(n), SILU_BLOCK)
    grid = (T, triton.cdiv(n, block))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), n,
        BLOCK=block, num_warps=4 if block <= 1024 else 8,
    )
    return out


# ----------------------------------------------------------------------------
# Rotary position embedding (NeoX / rotate-half)
# ----------------------------------------------------------------------------

@triton.jit
def _rope_heads(
    src, dst,                       # this token's [heads, D] rows of the input / output
    src_head_stride, dst_head_stride,
    c1, c2, s1, s2,                 # [1, HALF_BLOCK] cos/sin halves, rounded to dtype
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, HEAD_BLOCK: tl.constexpr,
):
    ty = dst.dtype.element_ty
    d = tl.arange(0, HALF_BLOCK)[None, :]
    for h0 in range(0, NUM_HEADS, HEAD_BLOCK):
        h = h0 + tl.arange(0, HEAD_BLOCK)[:, None]
        mask = (h < NUM_HEADS) & (d < HALF)
        src_h = src + h * src_head_stride
        dst_h = dst + h * dst_head_stride
        x1 = tl.load(src_h + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src_h + HALF + d, mask=mask, other=0.0).to(tl.float32)
        # reference: x * cos + rotate_half(x) * sin, every product and the sum
        # rounded to the model dtype; rotate_half(x) = cat(-x2, x1)
        o1 = _to_dtype(x1 * c1, ty).to(tl.float32) + _to_dtype(-x2 * s1, ty).to(tl.float32)
        o2 = _to_dtype(x2 * c2, ty).to(tl.float32) + _to_dtype(x1 * s2, ty).to(tl.float32)
        tl.store(dst_h + d, _to_dtype(o1, ty), mask=mask)
        tl.store(dst_h + HALF + d, _to_dtype(o2, ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr,     # q [T, H, D], k [T, KV, D] and outputs
    cos_ptr, sin_ptr, pos_ptr,              # cos/sin [max_pos, D] fp32, positions [T]
    q_tok_stride, q_head_stride, k_tok_stride, k_head_stride,
    qo_tok_stride, qo_head_stride, ko_tok_stride, ko_head_stride,
    cos_row_stride, sin_row_stride,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
    Q_HEAD_BLOCK: tl.constexpr, K_HEAD_BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    ty = q_out_ptr.dtype.element_ty
    d = tl.arange(0, HALF_BLOCK)[None, :]
    dmask = d < HALF
    cos_row = cos_ptr + pos * cos_row_stride
    sin_row = sin_ptr + pos * sin_row_stride
    # both halves of the table are read (not assumed equal); like the
    # reference, cos/sin are rounded to the model dtype before use
    c1 = _to_dtype(tl.load(cos_row + d, mask=dmask, other=0.0), ty).to(tl.float32)
    c2 = _to_dtype(tl.load(cos_row + HALF + d, mask=dmask, other=0.0), ty).to(tl.float32)
    s1 = _to_dtype(tl.load(sin_row + d, mask=dmask, other=0.0), ty).to(tl.float32)
    s2 = _to_dtype(tl.load(sin_row + HALF + d, mask=dmask, other=0.0), ty).to(tl.float32)
    _rope_heads(q_ptr + tok * q_tok_stride, q_out_ptr + tok * qo_tok_stride,
                q_head_stride, qo_head_stride, c1, c2, s1, s2,
                NUM_Q_HEADS, HALF, HALF_BLOCK, Q_HEAD_BLOCK)
    _rope_heads(k_ptr + tok * k_tok_stride, k_out_ptr + tok * ko_tok_stride,
                k_head_stride, ko_head_stride, c1, c2, s1, s2,
                NUM_KV_HEADS, HALF, HALF_BLOCK, K_HEAD_BLOCK)


def _check_heads(name: str, t: torch.Tensor, T: int | None = None) -> None:
    if t.dim() != 3 or t.stride(-1) != 1:
        raise ValueError(f"{name} must be 3-D [T, heads, head_dim] with a unit last-dim "
                         f"stride, got shape {tuple(t.shape)} strides {t.stride()}")
    if T is not None and t.shape[0] != T:
        raise ValueError(f"{name} has {t.shape[0]} tokens, expected {T}")


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, *, q_out: torch.Tensor | None = None,
                 k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style RoPE of q [T, H, D] and k [T, KV, D] at `positions` [T].

    cos/sin: [max_positions, D] fp32 tables (engine/model/rotary.py); positions:
    int32/int64, each < max_positions (not checked on the device). Matches
    engine.model.rotary.RotaryEmbedding.forward bit for bit:
        c = cos[positions].unsqueeze(1).to(q.dtype); s = likewise
        q * c + rotate_half(q) * s      (every product and sum rounded to q.dtype)
    q and k must share a dtype; they may be strided views (e.g. of a fused qkv
    output) as long as their last-dim stride is 1. D must be even.

    Not in place by default: returns new contiguous (q_out, k_out) of q's dtype.
    Preallocated q_out/k_out (same shapes and dtype, any strides with unit last
    stride) may be passed and may be q and k themselves (in place): each token's
    heads are read before they are written.
    """
    _check_heads("q", q)
    T, num_q_heads, D = q.shape
    _check_heads("k", k, T)
    if k.shape[2] != D or k.dtype != q.dtype or k.device != q.device:
        raise ValueError("k must match q's head_dim, dtype and device")
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != D or table.stride(-1) != 1:
            raise ValueError(f"{name} must be [max_positions, {D}] with unit last stride")
        if table.dtype != torch.float32 or table.device != q.device:
            raise ValueError(f"{name} must be float32 on {q.device}")
    if positions.shape != (T,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 [{T}]")
    num_kv_heads = k.shape[1]
    if q_out is None:
        q_out = torch.empty((T, num_q_heads, D), dtype=q.dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty((T, num_kv_heads, D), dtype=k.dtype, device=k.device)
    for name, o, ref in (("q_out", q_out, q), ("k_out", k_out, k)):
        _check_heads(name, o, T)
        if o.shape != ref.shape or o.dtype != ref.dtype or o.device != ref.device:
            raise ValueError(f"{name} must match the shape, dtype and device of its input")
    if T == 0:
        return q_out, k_out
    half = D // 2
    half_block = triton.next_power_of_2(half)
    heads_per_tile = max(1, ROTARY_TILE // half_block)
    _rotary_kernel[(T,)](
        q, k, q_out, k_out, cos, sin, positions.to(q.device),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, HALF_BLOCK=half_block,
        Q_HEAD_BLOCK=min(triton.next_power_of_2(num_q_heads), heads_per_tile),
        K_HEAD_BLOCK=min(triton.next_power_of_2(num_kv_heads), heads_per_tile),
        num_warps=4,
        # no fma contraction of x * cos + rot * sin: fp32 then matches torch's
        # separately rounded products too (16-bit products are rounded anyway)
        enable_fp_fusion=False,
    )
    return q_out, k_out


# ----------------------------------------------------------------------------
# Benchmark: fused kernels vs. the eager torch ops they replace (CUDA only)
# ----------------------------------------------------------------------------

def benchmark_fused_ops(device, dtype, num_tokens_list=(1, 64, 2048), hidden=4096,
                        intermediate=14336, heads=32, kv_heads=8, head_dim=128,
                        ) -> list[dict]:
    """Time each fused op against its unfused torch equivalent on `device`.

    Uses triton.testing.do_bench (median of repeated runs, ms) on random
    inputs. Returns one row per (op, num_tokens):
        {"op", "num_tokens", "torch_ms", "triton_ms", "speedup"}
    with speedup = torch_ms / triton_ms. Requires a CUDA device.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(f"benchmark_fused_ops needs a CUDA device, got {device}")
    import torch.nn.functional as F

    eps = 1e-5
    max_positions = 8192
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos_table, sin_table = emb.cos(), emb.sin()
    weight = 1.0 + 0.1 * randn(hidden)

    def torch_rms_norm(x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def torch_add_rms_norm(x, r):
        s = x + r
        return torch_rms_norm(s), s

    def rotate_half(t):
        h = t.shape[-1] // 2
        return torch.cat((-t[..., h:], t[..., :h]), dim=-1)

    def torch_rotary(q, k, positions):
        c = cos_table[positions].unsqueeze(1).to(q.dtype)
        s = sin_table[positions].unsqueeze(1).to(q.dtype)
        return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

    rows = []

    def record(op, T, torch_fn, triton_fn):
        torch_fn(), triton_fn()  # compile / warm up outside the timing
        torch_ms = triton.testing.do_bench(torch_fn, return_mode="median")
        triton_ms = triton.testing.do_bench(triton_fn, return_mode="median")
        rows.append({"op": op, "num_tokens": T, "torch_ms": torch_ms,
                     "triton_ms": triton_ms, "speedup": torch_ms / triton_ms})

    def bench_tokens(T):
        x, r = randn(T, hidden), randn(T, hidden)
        record("rms_norm", T, lambda: torch_rms_norm(x), lambda: rms_norm(x, weight, eps))
        record("fused_add_rms_norm", T, lambda: torch_add_rms_norm(x, r),
               lambda: fused_add_rms_norm(x, r, weight, eps))

        gate_up = randn(T, 2 * intermediate)
        record("silu_and_mul", T,
               lambda: F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:],
               lambda: silu_and_mul(gate_up))

        qkv = randn(T, (heads + 2 * kv_heads) * head_dim)
        q = qkv[:, :heads * head_dim].view(T, heads, head_dim)
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
        positions = torch.randint(0, max_positions, (T,), generator=gen, device=device)
        record("apply_rotary", T, lambda: torch_rotary(q, k, positions),
               lambda: apply_rotary(q, k, cos_table, sin_table, positions))

    for T in num_tokens_list:
        bench_tokens(T)
    return rows
