"""Paged attention in Triton: K and V are read straight from the cache blocks,
never gathered into a dense copy.

Cache of one layer: [2, num_blocks, block_size, kv_heads, head_dim] (K then V).
Token t of a sequence lives in block `block_table[t // block_size]`, slot
`t % block_size`; any block size works, since each key's block is looked up
on its own (the lookups hit the cache: a tile shares a few blocks).

- `paged_decode_attention`: one query token per sequence. A program takes one
  (sequence, KV head, split of the context) and all the query heads that share
  that KV head, so each K/V byte is read once per step (GQA and MQA alike).
  Long contexts at small batch are split over several programs (flash-decoding)
  and a second kernel merges the splits by their log-sum-exp.
- `paged_prefill_attention`: chunks of query tokens, each chunk after a cached
  prefix of its sequence (or none), attending causally: query i of a chunk of
  n sits at position seq_len - n + i.
- `write_kv`: stores this step's K/V into their slots; a negative slot is
  skipped (padding rows of a CUDA-graph batch).

All three run on CUDA, and on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1), which is how the tests check them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.interpreter_compat import patch_interpreter_scalars

patch_interpreter_scalars()

# context tokens one decode split covers, at least: below this the merge costs more than it saves
MIN_TOKENS_PER_SPLIT = 256
MAX_DECODE_SPLITS = 32


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr,
                     stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     stride_cache_kv, stride_cache_slot, stride_cache_head,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & (slot >= 0)
    src = offs_h[:, None] * stride_k_head + offs_d[None, :]
    dst = cache_ptr + slot * stride_cache_slot + offs_h[:, None] * stride_cache_head + offs_d[None, :]
    k = tl.load(k_ptr + token * stride_k_tok + src, mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_cache_kv, v, mask=mask)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_blocks, block_size, kv_heads, D]; k, v: [T, kv_heads, D]
    (last dim contiguous); slot_mapping: [T] (block * block_size + offset; < 0: skip)."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _check_cache(kv_cache, kv_heads, head_dim)
    _write_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


@triton.jit
def _decode_kernel(q_ptr, cache_ptr, table_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, scale,
                   stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                   stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head, stride_table,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(lens_ptr + seq)
    # this split's keys: [start, end), a whole number of tiles
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    qd_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=qd_mask, other=0.0)                                          # [G, D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = cache_ptr + kv_head * stride_cache_head
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        block = tl.load(table_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot       # [N]
        kv_mask = n_mask[:, None] & (offs_d[None, :] < HEAD_DIM)                     # [N, D]
        # K loaded transposed, [D, N]: no tl.trans needed before the dot
        kt = tl.load(k_base + row[None, :] + offs_d[:, None], mask=tl.trans(kv_mask), other=0.0)
        v = tl.load(k_base + stride_cache_kv + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale                           # [G, N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    has_keys = l_i > 0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SPLIT:
        # partials: [B, heads, splits, D] and log-sum-exp [B, heads, splits]
        part = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=qd_mask)
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=offs_g < GROUP)
    else:
        tl.store(out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=qd_mask)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_o_tok, stride_o_head,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_S: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    base = (seq * NUM_HEADS + head) * num_splits
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))                                           # empty splits: 0
    part = tl.load(part_out_ptr + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                   mask=s_mask[:, None], other=0.0)                                 # [S, D]
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_o_tok + head * stride_o_head + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, num_splits: int = 1,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, heads, D] (one token per sequence, its K/V already in the cache);
    kv_cache: [2, num_blocks, block_size, kv_heads, D]; block_tables: [B, >= blocks
    covering seq_lens] int32; seq_lens: [B] int32 >= 1 (keys per sequence, this
    token's included). Returns out [B, heads, D] (written into `out` if given).
    `num_splits` > 1 splits each context over that many programs; it must not
    depend on seq_lens' values (read on the device only), so a CUDA graph can
    fix it per batch size."""
    batch, num_heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    _check_cache(kv_cache, kv_heads, head_dim)
    group = num_heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    part_out = part_lse = out                     # unused when not split
    if split:
        part_out = torch.empty(batch, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, kv_cache, block_tables, seq_lens, out, part_out, part_lse, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_N=64 if head_dim <= 128 else 32, SPLIT=split,
        PRECISION=_precision(q.dtype), num_warps=4, num_stages=2)
    if split:
        _merge_splits_kernel[(batch, num_heads)](
            part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)))
    return out


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, table_ptr, query_start_ptr, lens_ptr, out_ptr, scale,
                    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head, stride_table,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(lens_ptr + seq)
    prefix = seq_len - q_len                       # cached tokens before the chunk
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)                  # [M, D]
    q_pos = prefix + offs_m                                                         # [M]
    # keys up to the tile's last query (none when the tile is past the chunk)
    hi = tl.where(tile * BLOCK_M < q_len, tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = cache_ptr + (head // GROUP) * stride_cache_head
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < hi
        block = tl.load(table_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot
        kv_mask = n_mask[:, None] & d_mask[None, :]
        kt = tl.load(k_base + row[None, :] + offs_d[:, None], mask=tl.trans(kv_mask), other=0.0)  # [D, N]
        v = tl.load(k_base + stride_cache_kv + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale                           # [M, N]
        s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows past the chunk see no key
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                            scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, heads, D], the chunks of P sequences back to back (their K/V already
    in the cache); query_start: [P + 1] int32 offsets of the chunks in q;
    seq_lens: [P] int32, each sequence's length up to the chunk's end;
    block_tables: [P, >= blocks covering seq_lens] int32; max_query_len: the
    longest chunk (a host int: it sizes the grid). Returns [T, heads, D]."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    _check_cache(kv_cache, kv_heads, head_dim)
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    block_m = 64 if max_query_len > 32 else 16
    block_d = max(16, triton.next_power_of_2(head_dim))
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), num_seqs, num_heads)](
        q, kv_cache, block_tables, query_start, seq_lens, out, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m, BLOCK_N=64 if head_dim <= 128 else 32, PRECISION=_precision(q.dtype),
        num_warps=4, num_stages=2)
    return out


def decode_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """How many programs to split each decode context over: enough that
    batch * kv_heads * splits fills the device about twice, no split shorter
    than MIN_TOKENS_PER_SPLIT tokens of `max_seq_len`."""
    programs = batch * kv_heads
    target = 2 * _multiprocessors(device)
    wanted = -(-target // max(1, programs))
    return max(1, min(wanted, MAX_DECODE_SPLITS, -(-max_seq_len // MIN_TOKENS_PER_SPLIT)))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4   # the interpreter: a few, so that CPU runs exercise the split path


def _precision(dtype: torch.dtype) -> str:
    # float32 stays float32 (no tf32): the fp32 path is the one checked against references
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(kv_cache: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (kv_heads, head_dim):
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {kv_heads}, {head_dim}], "
                         f"got {list(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1 or kv_cache.stride(3) != head_dim:
        raise ValueError("kv_cache must be contiguous within a slot ([kv_heads, head_dim])")
