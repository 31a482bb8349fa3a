"""Block manager properties: no leak, no double allocation, reference counts
that match the sharing, and prefix hits that are verified against the tokens."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_manager import BlockManager

BS = 4


class BlockManagerMachine(RuleBasedStateMachine):
    """Random interleavings of admit (with prefix matching), grow, cache, free."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=BS)
        self.seqs: dict[int, tuple[list[int], list[int]]] = {}  # id -> (tokens, block_table)
        self.next_id = 0

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def admit(self, prefix, tail):
        tokens = prefix + tail
        table: list[int] = []
        cached = self.bm.match_prefix(tokens, table)
        assert cached % BS == 0 and cached < len(tokens)
        if self.bm.allocate(table, len(tokens)):
            self.bm.cache_full_blocks(tokens, table, len(tokens), 0)
            self.seqs[self.next_id] = (tokens, table)
            self.next_id += 1
        else:
            self.bm.free(table)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.integers(1, 6))
    def grow(self, data, extra):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens, table = self.seqs[sid]
        before = list(table)
        new_tokens = tokens + [7] * extra
        if self.bm.allocate(table, len(new_tokens)):
            tokens.extend([7] * extra)
            self.bm.cache_full_blocks(tokens, table, len(tokens), 0)
        else:
            assert table == before, "a failed allocate must change nothing"

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        _, table = self.seqs.pop(sid)
        self.bm.free(table)
        assert table == []

    @invariant()
    def ref_counts_match_tables(self):
        counts = [0] * self.bm.num_blocks
        for _, table in self.seqs.values():
            assert len(set(table)) == len(table), "a sequence holds the same block twice"
            for b in table:
                counts[b] += 1
        assert [blk.ref_count for blk in self.bm.blocks] == counts
        # free list = exactly the unreferenced blocks: nothing leaks, nothing is handed out twice
        assert self.bm.num_free_blocks == counts.count(0)

    @invariant()
    def shared_blocks_hold_identical_tokens(self):
        owner: dict[int, tuple[int, ...]] = {}
        for tokens, table in self.seqs.values():
            for i, b in enumerate(table[: len(tokens) // BS]):
                blk = self.bm.blocks[b]
                if blk.hash is not None:
                    chunk = tuple(tokens[i * BS:(i + 1) * BS])
                    assert owner.setdefault(b, tuple(tokens[:(i + 1) * BS])) == tuple(tokens[:(i + 1) * BS]), \
                        "two sequences with different prefixes share a block"
                    assert blk.token_ids == chunk


    @invariant()
    def copies_are_unregistered_duplicates_of_their_identity(self):
        for identity, copies in self.bm._copies.items():
            assert copies, "an empty set of copies is kept"
            for b in copies:
                blk = self.bm.blocks[b]
                assert blk.identity == identity and blk.identity != blk.content_id
                assert self.bm._by_hash.get(blk.hash) != b, "a registered block is still listed as a copy"


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a_tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a: list[int] = []
    assert bm.match_prefix(a_tokens, a) == 0
    assert bm.allocate(a, 9) and len(a) == 3
    bm.cache_full_blocks(a_tokens, a, 9, 0)
    b: list[int] = []
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0, 0], b) == 8
    assert b == a[:2]
    assert [bm.blocks[i].ref_count for i in a] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b] == [1, 1]
    assert bm.num_free_blocks == 10 - 2


def test_full_prompt_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=10, block_size=BS)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    a: list[int] = []
    bm.allocate(a, 8)
    bm.cache_full_blocks(tokens, a, 8, 0)
    b: list[int] = []
    assert bm.match_prefix(tokens, b) == 4  # second block recomputed: it holds the last token


def test_freed_cached_blocks_are_reused_until_evicted():
    bm = BlockManager(num_blocks=3, block_size=BS)
    tokens = [1, 2, 3, 4, 5]
    a: list[int] = []
    bm.allocate(a, 5)
    bm.cache_full_blocks(tokens, a, 5, 0)
    first = a[0]
    bm.free(a)
    assert bm.num_free_blocks == 3
    b: list[int] = []
    assert bm.match_prefix(tokens, b) == 4 and b == [first]
    assert bm.num_free_blocks == 2
    bm.free(b)
    # fill the pool with other content: the cached block is evicted, no stale hit remains
    c: list[int] = []
    assert bm.allocate(c, 12)
    bm.cache_full_blocks([9] * 12, c, 12, 0)
    bm.free(c)
    d: list[int] = []
    assert bm.match_prefix(tokens, d) == 0


def test_a_prefix_computed_twice_keeps_the_later_blocks_findable():
    """Two requests that share a prompt in one step both compute its blocks; the
    second's copies stay private, and the blocks after them (its own continuation)
    must still be found through the registered copies."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    a_tokens, b_tokens = shared + [20, 21, 22, 23, 99], shared + [30, 31, 32, 33, 98]
    a: list[int] = []
    b: list[int] = []
    assert bm.match_prefix(a_tokens, a) == 0 and bm.match_prefix(b_tokens, b) == 0   # the same step
    bm.allocate(a, 13)
    bm.allocate(b, 13)
    bm.cache_full_blocks(a_tokens, a, 13, 0)
    bm.cache_full_blocks(b_tokens, b, 13, 0)       # its first two blocks duplicate a's
    follow_up: list[int] = []
    assert bm.match_prefix(shared + [30, 31, 32, 33, 5, 6], follow_up) == 12
    assert follow_up == a[:2] + [b[2]]


def _whole_prompt_hit_then_output(bm: BlockManager, x: list[int], y: list[int]) -> tuple[list[int], list[int]]:
    """S1 computes the one-block prompt X; S2 sends X again (a whole-prompt hit computes its block
    again: a private copy) and writes its output Y, registered under X's first identity."""
    s1: list[int] = []
    bm.allocate(s1, 4)
    bm.cache_full_blocks(x, s1, 4, 0)
    s2: list[int] = []
    assert bm.match_prefix(x, s2) == 0             # a whole-prompt hit leaves its block to compute
    bm.allocate(s2, 8)
    bm.cache_full_blocks(x + y, s2, 8, 0)
    return s1, s2


def test_a_copy_takes_over_the_registration_of_an_evicted_block():
    """X's registered block is evicted while S2 still holds its copy of X: the copy is registered
    in its place, so S3 finds X and Y in S2's blocks (before: Y was out of reach, and S3 computed
    X and Y again while S2 held both)."""
    bm = BlockManager(num_blocks=6, block_size=BS)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    s1, s2 = _whole_prompt_hit_then_output(bm, x, y)
    registered_x, copy_and_y = s1[0], list(s2)
    bm.free(s1)
    taken: list[int] = []
    assert bm.allocate(taken, 4 * bm.num_free_blocks)   # every free block, s1[0] (X) last: evicted
    assert registered_x in taken
    bm.free(taken)
    s3: list[int] = []
    assert bm.match_prefix(x + y + [0], s3) == 8 and s3 == copy_and_y
    bm.free(s2)
    bm.free(s3)
    crowd: list[int] = []
    assert bm.allocate(crowd, 4 * (bm.num_free_blocks - 2))    # all but the two cached blocks
    bm.free(crowd)
    s4: list[int] = []
    assert bm.match_prefix(x + y + [9], s4) == 8 and s4 == copy_and_y   # kept as cached once free


def test_a_registered_block_whose_parent_was_recomputed_gives_its_hash_to_the_new_chain():
    """X's registered block and its copy are both evicted while Y (registered under X's first
    identity) is still cached; S3 computes X and Y afresh. Y's old registration no longer
    verifies (its parent is gone): S3's Y takes the hash over, so that S4 finds X and Y."""
    bm = BlockManager(num_blocks=6, block_size=BS)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    s1, s2 = _whole_prompt_hit_then_output(bm, x, y)
    (registered_x,), (copy_x, y_block) = s1, s2
    bm.free(s1)                                    # X last but one to be evicted ...
    bm.free(s2)                                    # ... Y last; S2's copy of X first
    taken: list[int] = []
    assert bm.allocate(taken, 4 * (bm.num_free_blocks - 1))
    assert registered_x in taken and copy_x in taken and y_block not in taken
    bm.free(taken)
    s3: list[int] = []
    assert bm.match_prefix(x + y + [0], s3) == 0
    bm.allocate(s3, 9)
    bm.cache_full_blocks(x + y + [0], s3, 9, 0)
    s4: list[int] = []
    assert bm.match_prefix(x + y + [9], s4) == 8 and s4 == s3[:2]


def test_free_blocks_nobody_can_find_are_handed_out_before_cached_ones():
    bm = BlockManager(num_blocks=3, block_size=BS)
    prompt = [1, 2, 3, 4, 5]
    a: list[int] = []
    bm.allocate(a, 5)
    bm.cache_full_blocks(prompt, a, 5, 0)          # block a[0] is cached; a[1] holds one token, no hash
    bm.free(a)
    for _ in range(3):                             # short requests, one block each
        short: list[int] = []
        assert bm.allocate(short, 2)
        bm.free(short)
    again: list[int] = []
    assert bm.match_prefix(prompt, again) == 4     # the cached block was never handed out


def test_hash_collision_is_rejected_by_token_check(monkeypatch):
    bm = BlockManager(num_blocks=6, block_size=BS)
    a: list[int] = []
    bm.allocate(a, 5)
    bm.cache_full_blocks([1, 2, 3, 4, 0], a, 5, 0)
    # forge a collision: make the cache think another prefix hashes to a's first block
    forged = hash((None, (5, 6, 7, 8)))
    assert forged == bm.block_hashes([5, 6, 7, 8, 0], 1)[0]     # the key match_prefix looks up
    bm._by_hash[forged] = a[0]
    b: list[int] = []
    assert bm.match_prefix([5, 6, 7, 8, 0], b) == 0 and b == []


def test_chain_is_verified_not_just_the_block():
    """A forged hash hit on a block with the right tokens but a different
    preceding block is rejected: the chain, not the block alone, is verified."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    x = [1, 1, 1, 1, 2, 2, 2, 2, 0]
    a: list[int] = []
    bm.allocate(a, 9)
    bm.cache_full_blocks(x, a, 9, 0)
    y_first = [3, 3, 3, 3, 0]
    b: list[int] = []
    bm.allocate(b, 5)
    bm.cache_full_blocks(y_first, b, 5, 0)
    # forge: the hash of y's second block points at x's second block (same tokens, other parent)
    forged = hash((bm.blocks[b[0]].hash, (2, 2, 2, 2)))
    assert forged == bm.block_hashes([3, 3, 3, 3, 2, 2, 2, 2, 0], 2)[1]     # the key match_prefix looks up
    bm._by_hash[forged] = a[1]
    c: list[int] = []
    assert bm.match_prefix([3, 3, 3, 3, 2, 2, 2, 2, 0], c) == 4 and c == [b[0]]


def test_allocate_is_all_or_nothing_and_double_free_is_caught():
    bm = BlockManager(num_blocks=2, block_size=BS)
    t: list[int] = []
    assert not bm.allocate(t, 3 * BS) and t == [] and bm.num_free_blocks == 2
    assert bm.allocate(t, 2 * BS)
    kept = list(t)
    bm.free(t)
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(kept)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=20))
@settings(max_examples=100, deadline=None)
def test_blocks_needed_matches_ceiling(lengths):
    bm = BlockManager(num_blocks=1000, block_size=BS)
    table: list[int] = []
    total = 0
    for n in lengths:
        total += n
        expected = math.ceil(total / BS) - len(table)
        assert bm.blocks_needed(table, total) == expected
        assert bm.allocate(table, total)
        assert len(table) == math.ceil(total / BS)
        assert bm.blocks_needed(table, total - min(total, BS + 1)) == 0    # a table that holds more needs none
    assert [bm.blocks_needed([], n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]    # (BS 4, by hand)
