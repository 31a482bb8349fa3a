"""Which KV heads live on which tensor-parallel rank, and how to move a
sequence's KV between gangs of different TP degrees.

Sharding rule (the same as QKVParallelLinear): with `tp <= num_kv_heads`, rank r
holds heads [r*n, (r+1)*n) where n = num_kv_heads / tp; with `tp >
num_kv_heads`, each rank holds one head, head r // (tp / num_kv_heads), so each
head is replicated on tp / num_kv_heads consecutive ranks.

A transfer from a prefill gang of TP p to a decode gang of TP q sends, for
every destination rank, each head it needs from exactly one source rank that
holds it (spreading the load over the replicas when a head is replicated).
"""

from __future__ import annotations

from dataclasses import dataclass


def check_tp_for_heads(num_kv_heads: int, tp: int) -> None:
    if tp < 1 or num_kv_heads < 1:
        raise ValueError(f"tp ({tp}) and num_kv_heads ({num_kv_heads}) must be >= 1")
    if tp <= num_kv_heads and num_kv_heads % tp:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) is not divisible by tensor_parallel_size ({tp})")
    if tp > num_kv_heads and tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of num_key_value_heads "
                         f"({num_kv_heads}) when it is larger")


def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> range:
    """Global KV head ids held by `rank` of a TP-`tp` gang."""
    check_tp_for_heads(num_kv_heads, tp)
    if tp <= num_kv_heads:
        n = num_kv_heads // tp
        return range(rank * n, (rank + 1) * n)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True, slots=True)
class HeadTransfer:
    """Heads [head_start, head_start + num_heads) (global ids) go from `src_rank`
    (local heads start at src_local_start) to `dst_rank` (local dst_local_start)."""
    src_rank: int
    dst_rank: int
    head_start: int
    num_heads: int
    src_local_start: int
    dst_local_start: int


def kv_transfer_plan(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[HeadTransfer]:
    """Every destination rank's heads, each from one source rank holding it;
    consecutive heads with the same source are merged into one transfer."""
    plan: list[HeadTransfer] = []
    for dst in range(dst_tp):
        needed = kv_heads_of_rank(num_kv_heads, dst_tp, dst)
        for head in needed:
            holders = [r for r in range(src_tp) if head in kv_heads_of_rank(num_kv_heads, src_tp, r)]
            src = holders[dst % len(holders)]
            src_local = head - kv_heads_of_rank(num_kv_heads, src_tp, src).start
            dst_local = head - needed.start
            last = plan[-1] if plan else None
            if (last and last.dst_rank == dst and last.src_rank == src
                    and last.head_start + last.num_heads == head
                    and last.src_local_start + last.num_heads == src_local):
                plan[-1] = HeadTransfer(src, dst, last.head_start, last.num_heads + 1,
                                        last.src_local_start, last.dst_local_start)
            else:
                plan.append(HeadTransfer(src, dst, head, 1, src_local, dst_local))
    return plan


def remap_kv_shards(shards: list, num_kv_heads: int, dst_tp: int) -> list:
    """Per-source-rank KV shards [..., src_local_heads, D] (index = source rank)
    -> per-destination-rank shards [..., dst_local_heads, D], following
    `kv_transfer_plan`. Works for any tensors whose second-last dim is heads."""
    import torch
    src_tp = len(shards)
    dst_heads = len(kv_heads_of_rank(num_kv_heads, dst_tp, 0))
    out = [torch.empty(*shards[0].shape[:-2], dst_heads, shards[0].shape[-1], dtype=shards[0].dtype)
           for _ in range(dst_tp)]
    for t in kv_transfer_plan(num_kv_heads, src_tp, dst_tp):
        out[t.dst_rank][..., t.dst_local_start:t.dst_local_start + t.num_heads, :] = \
            shards[t.src_rank][..., t.src_local_start:t.src_local_start + t.num_heads, :]
    return out
