"""The C++ paged decode attention for CPU (engine/kernels/cpu_kernels.py)
against float64 attention over the same keys, and the engine on it."""

from __future__ import annotations

import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels
from tests.conftest import cpp_toolchain_present

pytestmark = pytest.mark.skipif(not cpp_toolchain_present(), reason="no C++ compiler or ninja to build it here")


def test_the_extension_builds():
    assert cpu_kernels.available(), "the C++ CPU kernels failed to build: see the log above"


def _reference(q, kv_cache, tables, lens, scale):
    # float64, one sequence at a time, keys gathered token by token
    batch, heads, _ = q.shape
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        pos = torch.arange(int(lens[b]))
        blocks = tables[b][pos // block_size]
        k = kv_cache[0][blocks, pos % block_size].double()        # [L, kv_heads, D]
        v = kv_cache[1][blocks, pos % block_size].double()
        for h in range(heads):
            kh = h // (heads // kv_heads)
            p = torch.softmax(k[:, kh] @ q[b, h].double() * scale, dim=0)
            out[b, h] = p @ v[:, kh]
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 64), (6, 1, 80), (4, 2, 128)])
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("batch,threads", [(5, None), (1, 2), (2, 2), (3, 2), (3, 3), (1, 4)])
def test_decode_attention_matches_float64_attention(heads, kv_heads, head_dim, block_size, batch, threads):
    """The same attention whether the sequences outnumber the threads or not
    (`threads` None: the current count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        _check_decode_attention(heads, kv_heads, head_dim, block_size, batch)
    finally:
        torch.set_num_threads(before)


def _check_decode_attention(heads, kv_heads, head_dim, block_size, batch):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim + block_size)
    num_blocks = 64
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    # ragged lengths on and off block boundaries; shuffled, non-contiguous blocks; padded table rows
    lens = torch.tensor([7 * block_size, block_size + 1, 1, 3 * block_size - 1, block_size], dtype=torch.long)[:batch]
    width = int(-(-lens.max() // block_size))
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for b, n in enumerate(lens.tolist()):
        need = -(-n // block_size)
        tables[b, :need] = order[used:used + need]
        used += need
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    cpu_kernels.paged_decode_attention(q, kv_cache, tables, lens, scale, out=out)
    torch.testing.assert_close(out.double(), _reference(q, kv_cache, tables, lens, scale), rtol=1e-5, atol=1e-5)


def test_keys_past_a_sequence_length_are_not_read():
    gen = torch.Generator().manual_seed(7)
    kv_cache = torch.randn(2, 8, 4, 2, 32, generator=gen)
    tables = torch.tensor([[3, 5, 1]])
    q = torch.randn(1, 4, 32, generator=gen)
    lens = torch.tensor([6])
    out = torch.empty_like(q)
    cpu_kernels.paged_decode_attention(q, kv_cache, tables, lens, 0.2, out=out)
    poisoned = kv_cache.clone()
    poisoned[:, 5, 2:] = 1e4            # slots 6 and 7 of the second block: past the length
    poisoned[:, 1] = float("nan")       # the third block: not reached at all
    again = torch.empty_like(q)
    cpu_kernels.paged_decode_attention(q, poisoned, tables, lens, 0.2, out=again)
    assert torch.equal(out, again)


def _attention_call(**changes):
    """A valid decode-attention call (2 sequences over a 6-block cache), with `changes` made."""
    args = dict(q=torch.randn(2, 4, 16), kv_cache=torch.randn(2, 6, 4, 2, 16), tables=torch.tensor([[0, 1], [2, 5]]),
                lens=torch.tensor([5, 8]), out=torch.empty(2, 4, 16))
    args.update(changes)
    return lambda: cpu_kernels.paged_decode_attention(args["q"], args["kv_cache"], args["tables"], args["lens"],
                                                      0.25, out=args["out"])


@pytest.mark.parametrize("changes,message", [
    ({"lens": torch.tensor([5, 9])}, "sequence 1 attends to 9 keys: 1 to its table's 8 expected"),
    ({"lens": torch.tensor([0, 8])}, "sequence 0 attends to 0 keys"),
    ({"tables": torch.tensor([[0, 1], [2, 6]])}, "sequence 1's block 1 is 6, not one of the cache's 6"),
    ({"tables": torch.tensor([[0, -1], [2, 5]])}, "sequence 0's block 1 is -1"),
    ({"tables": torch.tensor([[0, 1]])}, "int64 block_tables [B, max_blocks] expected"),
    ({"tables": torch.tensor([[0, 1], [2, 5]], dtype=torch.int32)}, "int64 block_tables"),
    ({"lens": torch.tensor([5])}, "int64 seq_lens [B] expected"),
    ({"out": torch.empty(2, 4, 8)}, "q and out [B, H, D] of one shape expected"),
    ({"kv_cache": torch.randn(2, 6, 4, 3, 16)}, "H a multiple of KVH"),
    ({"kv_cache": torch.randn(2, 6, 4, 2, 8)}, "with D as q's"),
])
def test_decode_attention_refuses_operands_it_would_read_out_of_bounds(changes, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        _attention_call(**changes)()
    _attention_call()()        # (the valid call, for contrast)


def test_the_fused_ops_refuse_operands_of_the_wrong_shape():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=re.escape("contiguous float32 weight [8] expected")):
        cpu_kernels.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match=re.escape("out [3, 8] expected")):
        cpu_kernels.fused_add_rms_norm(x, torch.randn(2, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match=re.escape("x [T, 2I] expected")):
        cpu_kernels.silu_and_mul(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match=re.escape("contiguous float32 x and out [T, N] expected")):
        cpu_kernels.rms_norm(x.double(), torch.ones(8), 1e-5)
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    cos = sin = torch.randn(16, 8)
    with pytest.raises(RuntimeError, match=re.escape("position 16 is past the 16-position tables")):
        cpu_kernels.apply_rotary(q, k, cos, sin, torch.tensor([3, 16]))
    with pytest.raises(RuntimeError, match=re.escape("int64 positions [T] expected")):
        cpu_kernels.apply_rotary(q, k, cos, sin, torch.tensor([3]))
    with pytest.raises(RuntimeError, match=re.escape("cos and sin [positions, D] expected")):
        cpu_kernels.apply_rotary(q, k, torch.randn(16, 6), torch.randn(16, 6), torch.tensor([3, 4]))
    cpu_kernels.apply_rotary(q, k, cos, sin, torch.tensor([3, 15]))      # (in range)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mqa"])
def test_the_engine_on_the_cpp_backend_gives_the_torch_backends_tokens(preset, model_dirs):
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 3, 8 + i, 11, 64][: 2 + i % 7] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for backend in ("cpp", "torch"):
        llm = LLM(str(model_dirs[preset]), max_model_len=256, dtype="float32", attention_backend=backend,
                  block_size=5)
        assert llm.engine.worker.attention_backend == backend
        tokens[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens["cpp"] == tokens["torch"]


def test_auto_falls_back_to_torch_where_the_kernel_cannot_run_and_an_explicit_cpp_is_refused(model_dirs):
    # the kernel is float32-only: bfloat16 on CPU takes the gather + SDPA path
    llm = LLM(str(model_dirs["tiny"]), max_model_len=128, dtype="bfloat16")
    assert llm.engine.worker.attention_backend == "torch"
    with pytest.raises(ValueError, match="attention_backend 'cpp' needs float32 on CPU"):
        LLM(str(model_dirs["tiny"]), max_model_len=128, dtype="bfloat16", attention_backend="cpp")


# ---- fused small ops against the model's own eager paths ----------------------------------------
def _rows(t: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(t, n, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("tokens", [1, 37])
def test_rms_norm_and_fused_add_rms_norm_match_the_eager_norm(tokens):
    from engine.model.llama import RMSNorm
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = _rows(1, 96, 1)[0]
    x, residual = _rows(tokens, 96, 2), _rows(tokens, 96, 3)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-5, atol=1e-5)
    want_out, want_residual = norm(x, residual.clone())
    out, new_residual = cpu_kernels.fused_add_rms_norm(x, residual, norm.weight, 1e-5)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(new_residual, want_residual)        # the sum itself is exact


def test_silu_and_mul_matches_silu_times_up():
    x = _rows(5, 2 * 70, 4)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_and_mul(x), torch.nn.functional.silu(gate) * up,
                               rtol=1e-5, atol=1e-6)


def test_silu_and_mul_of_outlier_gates_is_finite():
    # an outlier neuron's gate far below -88: exp(-g) overflowed, and the fast-math division gave NaN,
    # which then spread through the hidden state to every logit
    gate = torch.tensor([[-1000.0, -300.0, -89.0, -88.0, -20.0, 0.0, 20.0, 89.0, 300.0]])
    up = torch.full_like(gate, 2.0)
    out = cpu_kernels.silu_and_mul(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-30)


def test_rotary_matches_the_eager_rotary_on_strided_views():
    from engine.model.model_config import ModelConfig
    from engine.model.rotary import RotaryEmbedding
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=64,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, rope_type="default", rope_params={})
    rope = RotaryEmbedding(config, 256)
    qkv = _rows(6, (4 + 2 + 2) * 32, 5)
    q = qkv[:, :128].view(6, 4, 32)                       # strided rows, as the model's q/k views are
    k = qkv[:, 128:192].view(6, 2, 32)
    positions = torch.tensor([0, 1, 17, 100, 200, 255])
    before = qkv.clone()
    got_q, got_k = cpu_kernels.apply_rotary(q, k, rope.cos, rope.sin, positions)
    want_q, want_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(qkv, before)                        # not in place


def test_the_engine_with_fused_cpu_ops_gives_the_eager_engines_tokens(model_dirs):
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 3, 8 + i, 11][: 2 + i % 6] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = {}
    for fused in (True, False):
        llm = LLM(str(model_dirs["tiny-qwen2"]), max_model_len=256, dtype="float32", fused_ops=fused)
        norm = llm.engine.worker.model.model.norm
        assert (norm.fused is cpu_kernels) == fused
        tokens[fused] = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens[True] == tokens[False]
