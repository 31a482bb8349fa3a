"""Attention over the paged KV cache for a mixed batch of decode tokens and
prefill chunks.

With `meta.paged` set (the Triton backend, the default on CUDA), the paged
kernels of engine/kernels/paged_attention.py read K/V in place from the blocks.
Otherwise it runs in plain torch (scaled_dot_product_attention), as described
below, except that on the cpp backend (the default on CPU where the extension
builds) decode tokens go to the C++ kernel of engine/kernels/cpu_kernels.py,
which also reads the blocks in place.

Per layer the cache is a tensor [2, num_blocks, block_size, kv_heads, head_dim]
(K then V). New K/V are written to their slots first; then
- decode tokens, in groups of similar length: gather each sequence's blocks,
  attend with a length mask;
- prefill chunks (one SDPA each): a fresh prompt attends causally to its own
  K/V; a chunk after a cached prefix gathers the prefix from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels
from engine.model.attention_metadata import AttentionMetadata, DecodeGroup


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # kv_cache: [2, num_blocks, block_size, kv_heads, D]; k, v: [T, kv_heads, D]; slot_mapping: [T]
    kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, D]; k, v: [T, kv_heads, D] (this step's, already rotated).
    Writes k, v into the cache and returns the attention output [T, heads, D]."""
    if meta.paged is not None:
        return _paged_kernels_attention(q, k, v, kv_cache, meta, scale)
    write_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        s, n = group.token_start, group.block_tables.shape[0]
        if group.seq_lens is not None:
            cpu_kernels.paged_decode_attention(q[s:s + n], kv_cache, group.block_tables, group.seq_lens, scale,
                                                 out=out[s:s + n])
        else:
            out[s:s + n] = _decode_attention(q[s:s + n], kv_cache, group, scale)
    for chunk in meta.prefills:
        s, n = chunk.token_start, chunk.num_tokens
        if chunk.has_cached_prefix:
            kc, vc = _gather_context(kv_cache, chunk.block_table, chunk.context_len)
            # query i sits at position context_len - n + i and sees keys 0..that position
            q_pos = torch.arange(chunk.context_len - n, chunk.context_len, device=q.device)
            mask = torch.arange(chunk.context_len, device=q.device)[None, :] <= q_pos[:, None]
            o = _prefill_sdpa(q[s:s + n], kc, vc, scale, mask)
        else:
            o = _prefill_sdpa(q[s:s + n], k[s:s + n], v[s:s + n], scale)
        out[s:s + n] = o
    return out


def _prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """One prefill chunk's attention: causal when `mask` is None (a fresh prompt,
    keys = queries), else `mask` [n, L] says which keys each query sees.
    q: [n, heads, D]; k, v: [L, kv_heads, D] -> [n, heads, D].
    KV heads are repeated up to the query heads first: with `enable_gqa`, or
    with no batch dimension, CPU SDPA falls back to its unfused math kernel,
    3x slower at 280 tokens and 5.6x at 2,048 (bench preset, 2 cores)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))   # [1, heads, n | L, D]
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=mask is None, scale=scale)
    return o[0].transpose(0, 1)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, block_size, kv_heads, D] (K or V); block_ids: [*S, nb]
    -> [*S, nb * block_size, kv_heads, D]. index_select on a flat view is several
    times faster than advanced indexing for this copy on CPU."""
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, kv_heads, head_dim)


def _gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    # -> k, v: [context_len, kv_heads, D]
    k = _gather_blocks(kv_cache[0], block_table)[:context_len]
    v = _gather_blocks(kv_cache[1], block_table)[:context_len]
    return k, v


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup,
                      scale: float) -> torch.Tensor:
    # q: [B, heads, D] -> [B, heads, D]
    batch, num_heads, head_dim = q.shape
    k = _gather_blocks(kv_cache[0], group.block_tables).transpose(1, 2)   # [B, kv_heads, L, D]
    v = _gather_blocks(kv_cache[1], group.block_tables).transpose(1, 2)
    # the heads that share a KV head become that head's "query positions", so the
    # KV is never expanded: q [B, kv_heads, heads_per_kv, D]
    qg = q.view(batch, k.shape[1], num_heads // k.shape[1], head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.key_mask, scale=scale)
    return o.reshape(batch, num_heads, head_dim)


def _paged_kernels_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                             meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The Triton backend: one decode launch for every decode token, one prefill
    launch for every chunk; a lone fresh prompt of SDPA_FRESH_PREFILL_MIN_TOKENS
    or more (engine/model/attention_metadata.py) takes SDPA's causal kernel."""
    from engine.kernels import paged_attention as kernels  # Triton is only needed here

    paged = meta.paged
    kernels.write_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    d = paged.num_decodes
    if d:
        kernels.paged_decode_attention(q[:d], kv_cache, paged.block_tables[:d], paged.seq_lens[:d], scale,
                                       paged.decode_splits, out=out[:d])
    if q.shape[0] == d:
        return out
    if paged.single_fresh_prefill:
        # [1, heads, n, D], contiguous, KV heads repeated: the shape SDPA's flash kernels take
        group = q.shape[1] // k.shape[1]
        kc = k.repeat_interleave(group, dim=1) if group > 1 else k
        vc = v.repeat_interleave(group, dim=1) if group > 1 else v
        qc, kc, vc = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, kc, vc))
        o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale)
        out.copy_(o[0].transpose(0, 1))
        return out
    kernels.paged_prefill_attention(q[d:], kv_cache, paged.block_tables[d:], paged.prefill_query_start,
                                    paged.seq_lens[d:], paged.max_prefill_query_len, scale, out=out[d:])
    return out
