"""Paged KV blocks: allocation, reference counts, and prefix caching.

A block holds the K/V of `block_size` consecutive tokens of one or more
sequences (more than one when they share a prefix). Free blocks sit in an
ordered free list; a freed block keeps its cached contents (and stays findable
by hash) until it is handed out again, least recently freed first.

Prefix caching: each full block gets a chained hash,
h_i = hash((h_{i-1}, tokens of block i)). A lookup by hash is only a hint: a hit
is verified against the block's tokens and the identity of the block before it,
so a hash collision can never splice another sequence's K/V into this one. A
block's identity is its `content_id` (unique per filling, never reused), or,
for a block computed again with the same tokens after the same prefix (two
requests sharing a prompt in one step, a whole-prompt hit's last block), the
identity of the registered block it duplicates: its descendants then stay
findable through the registered one, and through the copy once the registered
one is evicted (a copy takes over its registration).

Free blocks that no lookup can find (no hash, or a private duplicate) are
handed out before cached ones.

Contract: the caller (the scheduler) owns each sequence's `block_table` list and
passes it in; this class never holds a reference to a sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

NO_HASH = None


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = NO_HASH
    token_ids: tuple[int, ...] = ()
    content_id: int = 0          # changes every time the block is handed out fresh
    identity: int = 0            # content_id, or that of the registered block it duplicates
    parent_content_id: int = 0   # identity of the previous block of the prefix (0 for the first)


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self._copies: dict[int, set[int]] = {}      # identity -> blocks that duplicate the registered one
        self._content_ids = count(1)

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks to add to `block_table` so it holds `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Grows `block_table` in place to hold `num_tokens` tokens. All or nothing:
        returns False (and changes nothing) when there are not enough free blocks."""
        need = self.blocks_needed(block_table, num_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            block_table.append(self._take_fresh())
        return True

    def free(self, block_table: list[int]) -> None:
        """Drops one reference to each block of `block_table` and empties it. Blocks
        are released tail first, so a prefix's first blocks are evicted last."""
        for block_id in block_table:
            if self.blocks[block_id].ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is NO_HASH or self._by_hash.get(block.hash) != block_id:
                    self._free.move_to_end(block_id, last=False)    # nothing to keep: handed out first
        block_table.clear()

    def _take_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        copies = self._copies.get(block.identity)
        if copies is not None:
            copies.discard(block_id)
        if block.hash is not NO_HASH and self._by_hash.get(block.hash) == block_id:
            del self._by_hash[block.hash]
            self._register_a_copy(block)
        if copies is not None and not copies:
            del self._copies[block.identity]
        block.hash, block.token_ids, block.parent_content_id = NO_HASH, (), 0
        block.content_id = block.identity = next(self._content_ids)
        block.ref_count = 1
        return block_id

    def _register_a_copy(self, evicted: Block) -> None:
        """`evicted`'s registration (just dropped) goes to a copy of it, if one is left: the
        blocks registered after it (its copy's sequence's continuation) stay findable. A copy
        in use is preferred; a free one is kept as cached from now on."""
        copies = self._copies.get(evicted.identity)
        if not copies:
            return
        copy_id = max(copies, key=lambda i: self.blocks[i].ref_count)
        copies.discard(copy_id)
        self._by_hash[evicted.hash] = copy_id
        if copy_id in self._free:
            self._free.move_to_end(copy_id)      # no longer a free block nobody can find

    # ---- prefix caching --------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], block_table: list[int]) -> int:
        """For a sequence with an empty `block_table`: appends the cached blocks of
        the longest verified prefix of full blocks (taking a reference on each) and
        returns how many tokens they hold. At least one token is always left
        uncached, since the last prompt token must run to produce logits."""
        assert not block_table, "match_prefix is for sequences that hold no blocks"
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        prev_hash, prev_content = None, 0
        for i in range(max_blocks):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = hash((prev_hash, chunk))
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.parent_content_id != prev_content:
                break
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            block_table.append(block_id)
            prev_hash, prev_content = h, block.identity
        return len(block_table) * bs

    def block_hashes(self, token_ids: list[int], num_blocks: int) -> list[int]:
        """The chained hashes of the first `num_blocks` full blocks of `token_ids`, as
        match_prefix looks them up and cache_full_blocks registers them."""
        bs = self.block_size
        hashes, prev = [], None
        for i in range(num_blocks):
            prev = hash((prev, tuple(token_ids[i * bs:(i + 1) * bs])))
            hashes.append(prev)
        return hashes

    def cache_full_blocks(self, token_ids: list[int], block_table: list[int], num_computed: int,
                          num_already_cached: int) -> int:
        """Registers the blocks of `block_table` that are now full of computed tokens
        (the first `num_computed` of `token_ids`) so later sequences can share them.
        Blocks before `num_already_cached` were registered earlier. Returns the new
        count of registered blocks, for the caller to pass next time."""
        if not self.enable_prefix_caching:
            return num_already_cached
        bs = self.block_size
        num_full = min(num_computed // bs, len(block_table))
        for i in range(num_already_cached, num_full):
            block = self.blocks[block_table[i]]
            if block.hash is NO_HASH:
                parent = self.blocks[block_table[i - 1]] if i else None
                chunk = tuple(token_ids[i * bs:(i + 1) * bs])
                block.hash = hash((parent.hash if parent else None, chunk))
                block.token_ids = chunk
                block.parent_content_id = parent.identity if parent else 0
                # first writer wins: an identical block computed again stays private, with the
                # registered block's identity (its children then match through the registered one).
                # A registered block that no longer verifies (its parent's content was evicted and
                # computed again since) gives the hash to this one, or the chain breaks there for good.
                registered = self.blocks[self._by_hash.setdefault(block.hash, block.block_id)]
                if registered is not block:
                    if registered.token_ids == chunk and registered.parent_content_id == block.parent_content_id:
                        block.identity = registered.identity
                        self._copies.setdefault(block.identity, set()).add(block.block_id)
                    else:
                        self._by_hash[block.hash] = block.block_id
        return max(num_full, num_already_cached)
