"""Continuous batching: which sequences run in the next step, and how many of
their tokens.

Queues:
    waiting (FIFO; preempted sequences go back to the front)
       --admitted when its blocks fit and the token budget allows-->
    running (in admission order)
       --finished--> gone, blocks freed
       --out of blocks--> the most recently admitted running sequence is preempted
                          (blocks freed, recomputed from scratch when readmitted)
    reserved (decode role: blocks allocated for KV arriving from elsewhere)
       --kv ready--> running

A step gets at most `max_num_batched_tokens` tokens: first one token for every
decoding sequence and the next chunk of every running prefill, then chunks of
newly admitted prompts (chunked prefill splits a long prompt over steps).
`schedule(prefill=..., decode=...)` can restrict a step to one phase, which is
what dedicated prefill and decode workers run.

With async scheduling a step is scheduled while the previous one still runs:
a sequence whose last token is pending (sampled on the device, not read back)
decodes that token next, unless the pending token is known to end it
(max_tokens, the context limit, or a prefill-role request that ends after its
first token). A pending token that turns out to end it (EOS, a stop) wastes that
sequence's row of the next step; the engine drops the row's sample.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledStep:
    """One step's work. `num_new_tokens[i]` tokens of `seqs[i]` run; decodes
    (exactly one new token) come first in `seqs`."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_decode_seqs: int = 0      # the first num_decode_seqs of `seqs` are decodes

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.num_new_tokens[self.num_decode_seqs:])


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, max_model_len: int | None = None):
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        # every running sequence takes a token of each step: more of them than tokens would leave the
        # newest without any, step after step
        self.max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved: dict[str, Sequence] = {}
        self.num_preemptions = 0   # since start, for metrics
        # since start, for metrics (vLLM's prefix_cache_queries/hits): the prompt tokens of the
        # sequences first admitted while prefix caching is on, and of those, the ones read from the cache
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0

    # ---- queue changes -----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def reserve(self, seq: Sequence, num_filled_tokens: int) -> bool:
        """Decode role: allocates blocks for `num_filled_tokens` tokens whose K/V will
        be written from outside (a prefill worker). The sequence is not scheduled
        until `mark_filled`. Returns False when the blocks do not fit now, when
        running and reserved sequences already number `max_num_seqs`, or when
        they would leave too few blocks, or no batch slot, for the sequence at
        the head of the waiting queue (one preempted, a prompt prefilled here):
        it came first, and a stream of hand-offs taking every block or slot
        that frees would keep it waiting for ever; nor while any preempted
        sequence waits (each preemption puts its victim at the head, so hand-offs
        taken in between and preempted in turn would keep an older one behind
        them for ever)."""
        if self.num_seqs_in_batch + (1 if self.waiting else 0) >= self.max_num_seqs:
            return False
        if any(waiting.num_preemptions for waiting in self.waiting):
            return False
        bm = self.block_manager
        if self.waiting:
            head = self.waiting[0]
            if bm.blocks_needed(seq.block_table, num_filled_tokens) + \
                    bm.blocks_needed(head.block_table, head.num_tokens) > bm.num_free_blocks:
                return False
        if not bm.allocate(seq.block_table, num_filled_tokens):
            return False
        seq.status = SequenceStatus.RESERVED
        self.reserved[seq.request_id] = seq
        return True

    def mark_filled(self, seq: Sequence, num_filled_tokens: int) -> None:
        """The reserved blocks now hold K/V for the first `num_filled_tokens` tokens."""
        del self.reserved[seq.request_id]
        seq.num_computed_tokens = num_filled_tokens
        seq.num_hashed_blocks = self.block_manager.cache_full_blocks(
            seq.token_ids, seq.block_table, num_filled_tokens, seq.num_hashed_blocks)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, *, keep_blocks: bool = False) -> None:
        """Removes a sequence from every queue; frees its blocks unless `keep_blocks`."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq.request_id in self.reserved:
            del self.reserved[seq.request_id]
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not keep_blocks:
            self.block_manager.free(seq.block_table)

    @property
    def num_seqs_in_batch(self) -> int:
        """Sequences that hold a place in the batch: running, and reserved for a hand-off."""
        return len(self.running) + len(self.reserved)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.reserved)

    # ---- the step --------------------------------------------------------------------
    def schedule(self, *, prefill: bool = True, decode: bool = True) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_num_batched_tokens
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []

        # 1. running sequences, oldest first; preempt the newest when blocks run out. A running
        #    prefill (a chunked prompt, a preempted sequence's recompute, which a decode worker
        #    readmits behind the hand-offs it took since) leaves a token for each decode after it.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens and not self._continues_after_pending(seq):
                i += 1
                continue
            remaining = seq.num_uncomputed_tokens
            is_decode = self._decodes_now(seq)
            # a decode-only step still runs the recompute of a preempted sequence (it has output
            # tokens: see 2.), whose later chunks come here as a running prefill
            if (is_decode and not decode) or (not is_decode and not prefill and seq.num_output_tokens == 0):
                i += 1
                continue
            n = min(remaining, budget if is_decode else budget - self._decodes_after(i, decode))
            if n <= 0 or (n < remaining and not self.enable_chunked_prefill):
                i += 1
                continue
            allocated = True
            while not self.block_manager.allocate(seq.block_table, seq.num_computed_tokens + n):
                victim = self._preemption_victim()
                if seq.num_pending_tokens:
                    # its pending token may be its last (EOS, a stop string), and the pending tokens
                    # read back in this call may end others and free blocks: it waits a step rather
                    # than have a sequence (itself included) preempted for a block it may never use
                    allocated = False
                    break
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself: nothing younger is left to schedule
            if not allocated:
                i += 1
                continue
            (decodes if is_decode else prefills).append((seq, n))
            budget -= n
            i += 1

        # 2. admit waiting sequences, unless this step already had to preempt. A
        #    decode-only step still readmits preempted sequences (they have output
        #    tokens): recomputing their KV is the only way they can go on. One whose
        #    next prompt block a running prompt is computing waits for it (set aside,
        #    keeping its place): then it reads that block from the prefix cache
        #    instead of computing it again (n choices of one prompt, a shared
        #    system prompt arriving in a burst). Its seat and the blocks its prompt
        #    needs stay free for it: requests behind it do not take them.
        set_aside: list[Sequence] = []
        set_aside_blocks = 0
        in_flight: set[int] | None = None
        while (not step.preempted and self.waiting and budget > 0
               and self.num_seqs_in_batch + len(set_aside) < self.max_num_seqs):
            seq = self.waiting[0]
            if not prefill and seq.num_output_tokens == 0:
                break
            # a request scoring its prompt reads from the cache only the tokens it has scored (a
            # preempted one's; match_prefix leaves the last of them to run): any other cached
            # token would go unscored
            scoring = seq.prompt_logprobs is not None
            readable = seq.token_ids[:len(seq.prompt_logprobs)] if scoring else seq.token_ids
            reads_cache = self.block_manager.enable_prefix_caching
            cached = self.block_manager.match_prefix(readable, seq.block_table) if reads_cache else 0
            if reads_cache and not scoring:
                in_flight = self._blocks_in_flight() if in_flight is None else in_flight
                if self._next_block_in_flight(seq, cached, in_flight):
                    set_aside_blocks += self._blocks_once_shared(seq, in_flight)
                    self._undo_admission(seq)
                    set_aside.append(self.waiting.popleft())
                    continue
            seq.num_computed_tokens = cached
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = min(cached, seq.num_prompt_tokens)
            remaining = seq.num_uncomputed_tokens
            n = min(remaining, budget)
            # the blocks of its whole prompt, not only of this chunk: a prompt admitted on its first
            # chunk's blocks that cannot get its later ones preempts itself (the newest) and, readmitted,
            # starts over, step after step while what fills the cache stays (held or reserved blocks)
            need = self.block_manager.blocks_needed(seq.block_table, seq.num_computed_tokens + remaining)
            if (n < remaining and not self.enable_chunked_prefill) or \
                    need + set_aside_blocks > self.block_manager.num_free_blocks or \
                    not self.block_manager.allocate(seq.block_table, seq.num_computed_tokens + n):
                self._undo_admission(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            prefills.append((seq, n))
            if reads_cache and seq.num_preemptions == 0:
                self.prefix_cache_queried_tokens += seq.num_prompt_tokens
                self.prefix_cache_hit_tokens += seq.num_cached_prompt_tokens
            budget -= n
            if in_flight is not None:      # its prompt blocks are being computed from now on
                in_flight.update(self._uncomputed_prompt_blocks(seq))

        self.waiting.extendleft(reversed(set_aside))
        step.num_decode_seqs = len(decodes)
        for seq, n in decodes + prefills:
            step.seqs.append(seq)
            step.num_new_tokens.append(n)
        return step

    @staticmethod
    def _decodes_now(seq: Sequence) -> bool:
        """Whether a running sequence's next step is a decode (one token after its whole prompt)."""
        return seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens

    def _decodes_after(self, index: int, decode: bool) -> int:
        """The running sequences after `index` that decode in this step (none in a prefill-only
        one). Counted only at a running prefill, which is rare before the last few."""
        if not decode:
            return 0
        return sum(self._decodes_now(seq) for seq in itertools.islice(self.running, index + 1, None))

    def _preemption_victim(self) -> Sequence:
        """The newest running sequence that goes on after its pending token. One
        whose pending token is its last is about to give its blocks back, or (a
        prefill worker's) to hold them for a hand-off, and is never preempted.
        The sequence being scheduled qualifies, so there always is one."""
        return next(s for s in reversed(self.running)
                    if not (s.num_pending_tokens and not self._continues_after_pending(s)))

    def _continues_after_pending(self, seq: Sequence) -> bool:
        """False when the sequence's pending token is sure to be its last."""
        if seq.hold_kv or seq.num_output_tokens >= seq.params.max_tokens:
            return False
        return self.max_model_len is None or seq.num_tokens < self.max_model_len

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the sequence's K/V; it starts over later
        (its generated tokens are kept and recomputed as part of its prompt)."""
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _prompt_block_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the prompt's full blocks that match_prefix may match (all but a
        block holding the last prompt token, which always runs), computed once."""
        if seq.prompt_block_hashes is None:
            reach = (seq.num_prompt_tokens - 1) // self.block_manager.block_size
            seq.prompt_block_hashes = self.block_manager.block_hashes(seq.token_ids, reach)
        return seq.prompt_block_hashes

    def _uncomputed_prompt_blocks(self, seq: Sequence) -> list[int]:
        """Hashes of those blocks `seq` has yet to compute."""
        done = seq.num_computed_tokens // self.block_manager.block_size
        if done >= (seq.num_prompt_tokens - 1) // self.block_manager.block_size:
            return []          # (a decoding sequence: nothing to hash)
        return self._prompt_block_hashes(seq)[done:]

    def _blocks_in_flight(self) -> set[int]:
        """Prompt blocks that running sequences are computing (chunk by chunk) and will
        register in the prefix cache."""
        return {h for seq in self.running for h in self._uncomputed_prompt_blocks(seq)}

    def _next_block_in_flight(self, seq: Sequence, cached: int, in_flight: set[int]) -> bool:
        """Whether the block after `seq`'s cached prefix is one a running prompt computes."""
        if not in_flight:
            return False
        hashes = self._prompt_block_hashes(seq)
        index = cached // self.block_manager.block_size
        return index < len(hashes) and hashes[index] in in_flight

    def _blocks_once_shared(self, seq: Sequence, in_flight: set[int]) -> int:
        """Blocks `seq`'s tokens (a preempted one's output too) will take besides those it
        matched in the cache and the ones in flight that it will read from there once they
        are computed."""
        hashes = self._prompt_block_hashes(seq)
        matched = shared = len(seq.block_table)
        while shared < len(hashes) and hashes[shared] in in_flight:
            shared += 1
        return self.block_manager.blocks_needed(seq.block_table, seq.num_tokens) - (shared - matched)

    def _undo_admission(self, seq: Sequence) -> None:
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0

    def after_step(self, step: ScheduledStep) -> None:
        """Records the tokens the step computed and registers newly full blocks
        (those whose token ids are all known: a pending token is hashed later)."""
        for seq, n in zip(step.seqs, step.num_new_tokens):
            seq.num_computed_tokens += n
            seq.num_hashed_blocks = self.block_manager.cache_full_blocks(
                seq.token_ids, seq.block_table, min(seq.num_computed_tokens, seq.num_known_tokens),
                seq.num_hashed_blocks)
