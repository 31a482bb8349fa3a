"""Prefix caching in the simulator: which prompt blocks a replica can reuse.

The engine (engine/block_manager.py) gives each full block of a prompt a
chained hash, h_i = hash((h_{i-1}, tokens of block i)), keeps computed blocks
findable by hash until their memory is handed out again, and lets a new
sequence start after the longest run of its leading blocks it finds, always
leaving the last prompt token to run. The simulator keeps, per replica, the
hashes of the prompt blocks it has computed or received, least recently used
first (a prompt's last block before its first, as the engine frees a
sequence's blocks last first), at most as many as the replica has KV blocks.

Two simplifications, both in the hit's favour or against it by at most the
shared blocks: a hit still counts its blocks against the replica's KV (the
engine shares them between sequences), and cached blocks are not evicted
earlier under memory pressure (the engine hands free cached blocks out first
when it runs short).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The chained hashes of the prompt's full blocks, as the engine computes them."""
    hashes, prev = [], None
    for i in range(len(token_ids) // block_size):
        prev = hash((prev, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(prev)
    return tuple(hashes)


class PrefixCache:
    """One replica's reusable prompt blocks, by chained hash (LRU, `capacity` blocks)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: tuple[int, ...], prompt_len: int, block_size: int) -> int:
        """Tokens of a prompt whose KV is cached here: its longest run of leading
        blocks found, short of the last prompt token. Marks them used."""
        found = 0
        for h in hashes[:(prompt_len - 1) // block_size]:
            if h not in self._blocks:
                break
            found += 1
        self._touch(hashes[:found])
        return found * block_size

    def insert(self, hashes: Sequence[int]) -> None:
        """Blocks just computed: findable from now on (the least recently used go past capacity)."""
        self._touch(hashes)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def _touch(self, hashes: Sequence[int]) -> None:
        """Marks a run of a prompt's blocks used, its last block least recent: the
        engine frees a sequence's blocks last first, so a prompt's tail is evicted
        before its head (a head gone would leave the rest unreachable)."""
        for h in reversed(hashes):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
