"""The head mapping between TP degrees: every destination head is covered
exactly once, by a source rank that really holds it, at the right offsets."""

from __future__ import annotations

import pytest

from engine.kv_head_map import (
    HeadTransfer,
    check_tp_for_heads,
    kv_heads_of_rank,
    kv_transfer_plan,
)


def _valid_tps(num_kv_heads: int) -> list[int]:
    out = []
    for tp in range(1, 9):
        try:
            check_tp_for_heads(num_kv_heads, tp)
            out.append(tp)
        except ValueError:
            pass
    return out


def test_valid_degrees():
    assert _valid_tps(8) == [1, 2, 4, 8]
    assert _valid_tps(4) == [1, 2, 4, 8]
    assert _valid_tps(2) == [1, 2, 4, 6, 8]
    assert _valid_tps(1) == list(range(1, 9))


def test_ownership_examples():
    assert [kv_heads_of_rank(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [kv_heads_of_rank(1, 3, r) for r in range(3)] == [range(0, 1)] * 3
    with pytest.raises(ValueError, match=r"not divisible"):
        kv_heads_of_rank(8, 3, 0)
    with pytest.raises(ValueError, match=r"multiple of num_key_value_heads \(4\)"):
        kv_heads_of_rank(4, 6, 0)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
def test_every_destination_head_exactly_once(num_kv_heads):
    for p in _valid_tps(num_kv_heads):
        for q in _valid_tps(num_kv_heads):
            plan = kv_transfer_plan(num_kv_heads, p, q)
            received: dict[int, list[int]] = {d: [] for d in range(q)}
            for t in plan:
                src_heads = kv_heads_of_rank(num_kv_heads, p, t.src_rank)
                dst_heads = kv_heads_of_rank(num_kv_heads, q, t.dst_rank)
                for i in range(t.num_heads):
                    head = t.head_start + i
                    assert head in src_heads, (p, q, t)
                    assert src_heads[t.src_local_start + i] == head, (p, q, t)
                    assert dst_heads[t.dst_local_start + i] == head, (p, q, t)
                    received[t.dst_rank].append(head)
            for d in range(q):
                assert sorted(received[d]) == list(kv_heads_of_rank(num_kv_heads, q, d)), (p, q, d)


def test_replicated_heads_spread_over_sources():
    # 2 KV heads on 4 prefill ranks (each head twice) -> 2 decode ranks: both replicas used
    plan = kv_transfer_plan(2, 4, 2)
    assert plan == [HeadTransfer(0, 0, 0, 1, 0, 0), HeadTransfer(3, 1, 1, 1, 0, 0)]
    # 8 heads, p=2 -> q=4: each decode rank takes 2 contiguous heads from one source
    assert kv_transfer_plan(8, 2, 4) == [
        HeadTransfer(0, 0, 0, 2, 0, 0), HeadTransfer(0, 1, 2, 2, 2, 0),
        HeadTransfer(1, 2, 4, 2, 0, 0), HeadTransfer(1, 3, 6, 2, 2, 0)]
    # p=4 -> q=1: the single decode rank gathers from all four, merged per source
    assert [(t.src_rank, t.head_start, t.num_heads) for t in kv_transfer_plan(8, 4, 1)] == \
        [(0, 0, 2), (1, 2, 2), (2, 4, 2), (3, 6, 2)]


def test_kv_cache_reads_and_writes_head_ranges():
    """A rank ships a sub-range of its local heads to each destination rank."""
    import torch

    from engine.kv_cache import KVCache, KVCacheSpec
    cache = KVCache(KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=3, block_size=2, dtype=torch.float32), 6, "cpu")
    cache.tensor.copy_(torch.arange(cache.tensor.numel(), dtype=torch.float32).view_as(cache.tensor))
    part = cache.read_blocks([4, 1], heads=range(1, 3))
    assert part.shape == (2, 2, 2, 2, 2, 3)
    assert torch.equal(part, cache.tensor[:, :, [4, 1], :, 1:3, :])
    other = KVCache(cache.spec, 6, "cpu")
    other.write_blocks([0, 5], part, heads=range(2, 4))
    assert torch.equal(other.tensor[:, :, [0, 5], :, 2:4, :], part)
    assert other.tensor[:, :, [0, 5], :, :2, :].abs().sum() == 0   # the other heads untouched
    assert other.tensor[:, :, 1:5].abs().sum() == 0                  # and the other blocks
