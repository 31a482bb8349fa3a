"""The Triton paged-attention kernels against plain attention in float64.

On a machine without CUDA they run under Triton's interpreter, on CPU tensors.
Every case draws fresh random shapes: ragged lengths, lengths on and off block
boundaries, shuffled (non-contiguous) block tables, GQA and MQA, the head dims
real models use.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from engine.kernels.paged_attention import (  # noqa: E402
    decode_splits,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (heads, kv_heads, head_dim): MHA, GQA, MQA, and the head dims of real models
SHAPES = [(4, 4, 64), (8, 2, 80), (4, 1, 96), (8, 2, 128), (2, 1, 16)]


def _random_cache(gen, num_blocks, block_size, kv_heads, head_dim, dtype):
    return torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)


def _block_tables(gen, lens, block_size, num_blocks):
    """Each sequence gets distinct random blocks (not in order); rows padded with
    a block the sequence does not own."""
    need = [-(-n // block_size) for n in lens]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need) + 1
    tables, at = [], 0
    for n in need:
        row = perm[at:at + n]
        at += n
        tables.append(row + [perm[-1]] * (width - n))
    return torch.tensor(tables, dtype=torch.int32, device=DEVICE)


def _keys(cache, table, length, block_size):
    # -> k, v of one sequence: [length, kv_heads, D] float64
    idx = torch.arange(length, device=table.device)
    blocks = table[idx // block_size].long()
    slots = idx % block_size
    return cache[0][blocks, slots].double(), cache[1][blocks, slots].double()


def _reference(q, k, v, q_positions, scale):
    # q: [n, heads, D]; k, v: [L, kv_heads, D]; query i sees keys 0..q_positions[i]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    mask = torch.arange(k.shape[0], device=q.device)[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def _tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_reference(shape, dtype):
    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(hash((shape, str(dtype))) % 2**31)
    block_size = [16, 8, 5][torch.randint(0, 3, (1,), generator=gen).item()]
    batch = 5
    # ragged: one on a block boundary, one short, the rest random
    lens = [block_size * 3, 1] + torch.randint(2, 300, (batch - 2,), generator=gen).tolist()
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    cache = _random_cache(gen, num_blocks, block_size, kv_heads, head_dim, dtype)
    tables = _block_tables(gen, lens, block_size, num_blocks)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(DEVICE, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, cache, tables, seq_lens, scale, num_splits=splits, out=out)
        assert not out.isnan().any(), "every output element is written"
        for b, n in enumerate(lens):
            k, v = _keys(cache, tables[b], n, block_size)
            ref = _reference(q[b:b + 1], k, v, torch.tensor([n - 1], device=DEVICE), scale)
            assert _rel_err(out[b:b + 1], ref) < _tolerance(dtype), (b, n, splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_prefill_after_cached_prefix_matches_reference(shape, dtype):
    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(7 + hash((shape, str(dtype))) % 2**31)
    block_size = 16
    # (cached prefix, chunk): fresh prompt, prefix on a block boundary, prefix off it, 1-token chunk
    work = [(0, 37), (32, 20), (21, 70), (50, 1)]
    lens = [p + n for p, n in work]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    cache = _random_cache(gen, num_blocks, block_size, kv_heads, head_dim, dtype)
    tables = _block_tables(gen, lens, block_size, num_blocks)
    starts = [0]
    for _, n in work:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, head_dim, generator=gen).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    paged_prefill_attention(q, cache, tables, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                            torch.tensor(lens, dtype=torch.int32, device=DEVICE), max(n for _, n in work),
                            scale, out=out)
    assert not out.isnan().any()
    for i, (prefix, n) in enumerate(work):
        k, v = _keys(cache, tables[i], prefix + n, block_size)
        positions = torch.arange(prefix, prefix + n, device=DEVICE)
        ref = _reference(q[starts[i]:starts[i + 1]], k, v, positions, scale)
        assert _rel_err(out[starts[i]:starts[i + 1]], ref) < _tolerance(dtype), (prefix, n)


def test_prefill_is_causal_within_the_chunk():
    """A later key's value must not leak into an earlier query: change the last
    key and only the last query's output may move."""
    gen = torch.Generator().manual_seed(3)
    cache = _random_cache(gen, 4, 16, 2, 64, torch.float32)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(40, 4, 64, generator=gen).to(DEVICE)
    args = (torch.tensor([0, 40], dtype=torch.int32, device=DEVICE),
            torch.tensor([40], dtype=torch.int32, device=DEVICE), 40, 0.125)
    before = paged_prefill_attention(q, cache, table, *args)
    cache[1, 3, 40 - 32 - 1] += 10.0            # V of position 39 (block 3, slot 7)
    after = paged_prefill_attention(q, cache, table, *args)
    assert torch.equal(before[:39], after[:39])
    assert not torch.allclose(before[39], after[39])


def test_write_kv_fills_slots_and_skips_negative_ones():
    gen = torch.Generator().manual_seed(5)
    cache = torch.zeros(2, 6, 4, 2, 80, device=DEVICE, dtype=torch.bfloat16)
    # k, v as views into one fused projection output, like the model's qkv split
    fused = torch.randn(3, (4 + 2 + 2) * 80, generator=gen).to(DEVICE, torch.bfloat16)
    k = fused[:, 4 * 80:6 * 80].view(3, 2, 80)
    v = fused[:, 6 * 80:].view(3, 2, 80)
    slots = torch.tensor([9, -1, 22], dtype=torch.long, device=DEVICE)
    write_kv(cache, k, v, slots)
    flat_k, flat_v = cache[0].view(-1, 2, 80), cache[1].view(-1, 2, 80)
    assert torch.equal(flat_k[9], k[0]) and torch.equal(flat_v[22], v[2])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[[9, 22]] = True
    assert (flat_k[~written.to(DEVICE)] == 0).all() and (flat_v[~written.to(DEVICE)] == 0).all()


def test_decode_splits_fill_the_device_but_not_short_contexts():
    cpu = torch.device("cpu")          # the interpreter counts 4 multiprocessors
    assert decode_splits(batch=1, kv_heads=1, max_seq_len=4096, device=cpu) == 8
    assert decode_splits(batch=1, kv_heads=1, max_seq_len=300, device=cpu) == 2
    assert decode_splits(batch=64, kv_heads=8, max_seq_len=4096, device=cpu) == 1


def test_rejects_a_cache_of_the_wrong_layout():
    q = torch.zeros(1, 4, 64, device=DEVICE)
    cache = torch.zeros(2, 3, 16, 64, 2, device=DEVICE)         # heads and dims swapped
    with pytest.raises(ValueError, match="kv_cache must be"):
        paged_decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
                               torch.ones(1, dtype=torch.int32, device=DEVICE), 0.1)
