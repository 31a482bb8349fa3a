"""Fused Triton kernels (engine/kernels/fused_ops.py) against the eager torch
ops they replace. Without a GPU the kernels run under Triton's CPU interpreter,
which must be switched on before triton is imported; shapes are kept small
because the interpreter is slow.

16-bit outputs are held to the reference computed by the same torch ops in the
same dtype: within 1-2 ulps everywhere, and bit-identical for (nearly) every
element where the kernels claim to reproduce torch's rounding."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from engine.kernels import fused_ops  # noqa: E402
from engine.kernels.fused_ops import (  # noqa: E402
    apply_rotary,
    fused_add_rms_norm,
    rms_norm,
    silu_and_mul,
)
from engine.model.model_config import ModelConfig  # noqa: E402
from engine.model.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------- references

def ref_rms_norm(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def ref_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def ref_rotary(rope, positions, q, k):
    """engine/model/rotary.py's eager RoPE, written out here so that the
    reference never dispatches to the kernel under test."""
    cos = rope.cos[positions].unsqueeze(1).to(q.dtype)
    sin = rope.sin[positions].unsqueeze(1).to(q.dtype)

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotary_module(head_dim, max_positions=512, rope_type="default", rope_params=None):
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=64,
        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_type=rope_type, rope_params=rope_params or {})
    # only its cos/sin tables are used (built exactly as the engine builds them)
    return RotaryEmbedding(config, max_positions).to(DEVICE)


# ---------------------------------------------------------------- helpers

def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)


def poisoned(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_matches(out, ref, *, min_exact=0.99):
    """fp32: within 1e-5 relative; 16-bit: within 1-2 ulps everywhere and
    bit-identical for at least `min_exact` of the elements."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return
    tol = {torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 1e-3)}[ref.dtype]
    torch.testing.assert_close(out, ref, rtol=tol[0], atol=tol[1])
    exact = (out == ref).float().mean().item()
    assert exact >= min_exact, f"only {exact:.2%} of elements bit-identical to torch"


# ---------------------------------------------------------------- rms_norm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [80, 1000, 1024])
def test_rms_norm(dtype, hidden):
    x = randn(5, hidden, dtype=dtype, seed=hidden, scale=2.0)
    w = 1.0 + randn(hidden, dtype=dtype, seed=1, scale=0.5)
    out = rms_norm(x, w, 1e-6)
    assert_matches(out, ref_rms_norm(x, w, 1e-6))


def test_rms_norm_eps_and_weight_matter():
    # variance ~1e-6 so eps = 1e-5 vs 1e-6 changes the result a lot; a test
    # that passed with the wrong eps or without the weight would be worthless
    x = randn(4, 96, dtype=torch.bfloat16, seed=3, scale=1e-3)
    w = randn(96, dtype=torch.bfloat16, seed=4)
    out = rms_norm(x, w, 1e-5)
    assert_matches(out, ref_rms_norm(x, w, 1e-5))
    assert (out != ref_rms_norm(x, w, 1e-6)).float().mean() > 0.5
    assert (out != ref_rms_norm(x, torch.ones_like(w), 1e-5)).float().mean() > 0.5


def test_rms_norm_fp32_weight_promotes():
    # the engine's RMSNorm weight may stay fp32 while activations are bf16:
    # torch then returns fp32 (bf16-rounded normalised x times fp32 weight)
    x = randn(3, 80, dtype=torch.bfloat16, seed=5)
    w = randn(80, dtype=torch.float32, seed=6)
    out = rms_norm(x, w, 1e-5)
    ref = ref_rms_norm(x, w, 1e-5)
    assert out.dtype == torch.float32
    assert_matches(out, ref)


def test_rms_norm_strided_input_and_preallocated_out():
    big = randn(6, 300, dtype=torch.bfloat16, seed=7)
    x = big[:, 50:250]                                   # row stride 300
    w = randn(200, dtype=torch.bfloat16, seed=8)
    out_big = poisoned(6, 400, dtype=torch.bfloat16)
    out = out_big[:, 100:300]
    res = rms_norm(x, w, 1e-6, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert_matches(out, ref_rms_norm(x, w, 1e-6))
    assert out_big[:, :100].isnan().all() and out_big[:, 300:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("looped", [False, True])
def test_rms_norm_in_place(monkeypatch, dtype, looped):
    if looped:
        monkeypatch.setattr(fused_ops, "MAX_ROW_BLOCK", 64)  # 200 = 3 full chunks + a partial
    x = randn(4, 200, dtype=dtype, seed=9)
    w = randn(200, dtype=dtype, seed=10)
    ref = ref_rms_norm(x, w, 1e-6)
    assert_matches(rms_norm(x, w, 1e-6), ref)
    out = rms_norm(x, w, 1e-6, out=x)
    assert out.data_ptr() == x.data_ptr()
    assert_matches(x, ref)


# ---------------------------------------------------------------- fused_add_rms_norm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [80, 1000])
def test_fused_add_rms_norm(dtype, hidden):
    x = randn(5, hidden, dtype=dtype, seed=11)
    r = randn(5, hidden, dtype=dtype, seed=12, scale=3.0)
    w = randn(hidden, dtype=dtype, seed=13)
    x0, r0 = x.clone(), r.clone()
    normed, new_res = fused_add_rms_norm(x, r, w, 1e-5)
    ref_res = x + r
    assert torch.equal(new_res, ref_res)                 # exactly torch's dtype add
    assert_matches(normed, ref_rms_norm(ref_res, w, 1e-5))
    assert torch.equal(x, x0) and torch.equal(r, r0)     # not in place
    assert normed.data_ptr() not in (x.data_ptr(), r.data_ptr())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("looped", [False, True])
def test_fused_add_rms_norm_preallocated_and_in_place(monkeypatch, dtype, looped):
    if looped:
        monkeypatch.setattr(fused_ops, "MAX_ROW_BLOCK", 64)
    x = randn(4, 200, dtype=dtype, seed=14)
    r = randn(4, 200, dtype=dtype, seed=15)
    w = randn(200, dtype=dtype, seed=16)
    ref_res = x + r
    ref = ref_rms_norm(ref_res, w, 1e-6)

    out, res_out = poisoned(4, 200, dtype=dtype), poisoned(4, 200, dtype=dtype)
    fused_add_rms_norm(x, r, w, 1e-6, out=out, residual_out=res_out)
    assert torch.equal(res_out, ref_res)
    assert_matches(out, ref)

    # vLLM-style in place: x becomes the normed output, residual the sum
    fused_add_rms_norm(x, r, w, 1e-6, out=x, residual_out=r)
    assert torch.equal(r, ref_res)
    assert_matches(x, ref)


def test_fused_add_rms_norm_rejects_shared_outputs():
    x = randn(2, 80, dtype=torch.float32, seed=17)
    with pytest.raises(ValueError, match="out and residual_out must be different tensors"):
        fused_add_rms_norm(x, x.clone(), torch.ones(80, device=DEVICE), 1e-6,
                           out=x, residual_out=x)


# ---------------------------------------------------------------- silu_and_mul

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [80, 1000])
def test_silu_and_mul(dtype, n):
    x = randn(5, 2 * n, dtype=dtype, seed=n, scale=3.0)
    out = silu_and_mul(x)
    ref = ref_silu_and_mul(x)
    assert out.shape == (5, n)
    assert_matches(out, ref)
    swapped = F.silu(x[:, n:]) * x[:, :n]
    assert (out != swapped).float().mean() > 0.9         # gate/up order matters


def test_silu_and_mul_of_outlier_gates_is_finite():
    gate = torch.tensor([[-1000.0, -300.0, -89.0, -88.0, -20.0, 0.0, 20.0, 89.0, 300.0]], device=DEVICE)
    up = torch.full_like(gate, 2.0)
    out = silu_and_mul(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-30)


def test_silu_and_mul_column_blocks_strided_and_preallocated(monkeypatch):
    monkeypatch.setattr(fused_ops, "SILU_BLOCK", 64)      # n = 200: 4 column blocks
    big = randn(3, 500, dtype=torch.bfloat16, seed=18, scale=3.0)
    x = big[:, 50:450]                                   # row stride 500
    out = poisoned(3, 200, dtype=torch.bfloat16)
    assert silu_and_mul(x, out=out).data_ptr() == out.data_ptr()
    ref = ref_silu_and_mul(x)
    assert_matches(out, ref)
    silu_and_mul(x, out=x[:, :200])                      # in place into the gate half
    assert torch.equal(x[:, :200], out)


# ---------------------------------------------------------------- apply_rotary

def fused_qkv(T, heads, kv_heads, head_dim, dtype, seed):
    """q, k, v as strided views of one [T, (H + 2 KV) * D] projection output."""
    qkv = randn(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :q_size].view(T, heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(T, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(T, kv_heads, head_dim)
    return qkv, q, k, v


RAGGED_POSITIONS = [7, 3, 300, 0, 3, 511]                # non-monotonic, repeated


@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary(head_dim, dtype):
    rope = rotary_module(head_dim)
    positions = torch.tensor(RAGGED_POSITIONS, device=DEVICE)
    qkv, q, k, _ = fused_qkv(len(positions), 4, 2, head_dim, dtype, seed=head_dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    qkv0 = qkv.clone()
    q_out, k_out = apply_rotary(q, k, rope.cos, rope.sin, positions)
    q_ref, k_ref = ref_rotary(rope, positions, q, k)
    # no reduction or transcendental: every rounding step is torch's
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(qkv, qkv0)                        # not in place


def test_rotary_reference_is_the_engines_eager_path():
    rope = rotary_module(80)
    rope.fused = None                                    # the eager torch path
    positions = torch.tensor(RAGGED_POSITIONS, device=DEVICE)
    _, q, k, _ = fused_qkv(len(positions), 4, 2, 80, torch.bfloat16, seed=24)
    for got, want in zip(rope(positions, q, k), ref_rotary(rope, positions, q, k)):
        assert torch.equal(got, want)


def test_apply_rotary_catches_position_and_half_bugs():
    rope = rotary_module(64)
    positions = torch.tensor(RAGGED_POSITIONS, device=DEVICE)
    _, q, k, _ = fused_qkv(len(positions), 4, 2, 64, torch.bfloat16, seed=19)
    q_out, _ = apply_rotary(q, k, rope.cos, rope.sin, positions)
    shifted, _ = ref_rotary(rope, (positions + 1) % 512, q, k)
    assert (q_out != shifted).float().mean() > 0.5
    half = 32
    c = rope.cos[positions].unsqueeze(1).to(q.dtype)
    s = rope.sin[positions].unsqueeze(1).to(q.dtype)
    wrong_rotate = torch.cat((q[..., half:], -q[..., :half]), dim=-1)
    assert (q_out != q * c + wrong_rotate * s).float().mean() > 0.4


def test_apply_rotary_llama3_fp16_int32_positions():
    rope = rotary_module(128, max_positions=512, rope_type="llama3", rope_params={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    positions = torch.tensor([511, 17, 64, 2], device=DEVICE, dtype=torch.int32)
    _, q, k, _ = fused_qkv(4, 2, 1, 128, torch.float16, seed=20)
    q_out, k_out = apply_rotary(q, k, rope.cos, rope.sin, positions)
    q_ref, k_ref = ref_rotary(rope, positions.long(), q, k)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_apply_rotary_head_tiles_preallocated_and_in_place(monkeypatch, head_dim):
    monkeypatch.setattr(fused_ops, "ROTARY_TILE", 128)    # 2 heads per tile: loop + head mask
    rope = rotary_module(head_dim)
    positions = torch.tensor(RAGGED_POSITIONS[:4], device=DEVICE)
    T, H, KV = 4, 5, 3
    _, q, k, v = fused_qkv(T, H, KV, head_dim, torch.bfloat16, seed=21)
    q_ref, k_ref = ref_rotary(rope, positions, q, k)

    # preallocated, poisoned, strided outputs (views of one buffer)
    buf = poisoned(T, (H + KV) * head_dim + 8, dtype=torch.bfloat16)
    q_out = buf[:, :H * head_dim].view(T, H, head_dim)
    k_out = buf[:, H * head_dim:(H + KV) * head_dim].view(T, KV, head_dim)
    apply_rotary(q, k, rope.cos, rope.sin, positions, q_out=q_out, k_out=k_out)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert buf[:, (H + KV) * head_dim:].isnan().all()

    # in place on the fused qkv views; v untouched
    v0 = v.clone()
    apply_rotary(q, k, rope.cos, rope.sin, positions, q_out=q, k_out=k)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v, v0)


def test_apply_rotary_head_major_views():
    # head stride != head_dim: q, k and the outputs laid out [heads, T, D]
    rope = rotary_module(32)
    positions = torch.tensor(RAGGED_POSITIONS, device=DEVICE)
    T = len(positions)
    q = randn(4, T, 32, dtype=torch.bfloat16, seed=22).transpose(0, 1)
    k = randn(2, T, 32, dtype=torch.bfloat16, seed=23).transpose(0, 1)
    q_out = poisoned(4, T, 32, dtype=torch.bfloat16).transpose(0, 1)
    k_out = poisoned(2, T, 32, dtype=torch.bfloat16).transpose(0, 1)
    apply_rotary(q, k, rope.cos, rope.sin, positions, q_out=q_out, k_out=k_out)
    q_ref, k_ref = ref_rotary(rope, positions, q, k)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_empty_batch():
    x = torch.empty(0, 80, device=DEVICE)
    w = torch.ones(80, device=DEVICE)
    assert rms_norm(x, w, 1e-6).shape == (0, 80)
    assert fused_add_rms_norm(x, x, w, 1e-6)[0].shape == (0, 80)
    assert silu_and_mul(x).shape == (0, 40)
    rope = rotary_module(16)
    q = torch.empty(0, 2, 16, device=DEVICE)
    pos = torch.empty(0, dtype=torch.long, device=DEVICE)
    assert apply_rotary(q, q, rope.cos, rope.sin, pos)[0].shape == (0, 2, 16)
