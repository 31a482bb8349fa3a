"""One simulated worker replica: the engine's scheduler over a block pool,
stepping with times from a performance model.

Mirrors engine/scheduler.py: running sequences first, oldest first (a
decode costs one token of the step's budget, a prompt chunk as many tokens as
fit); a sequence that needs a block when none is free preempts the newest
running one, which loses its KV and is recomputed later (prompt and output so
far); waiting sequences are admitted while the blocks of their whole prompt
are free and the budget and max_num_seqs allow, and not in a step that had to
preempt. With a prefix cache (cluster/simulator/prefix_cache.py), a sequence
that starts with no KV here starts after the prompt blocks the replica has
cached, and one whose next prompt block a running prompt is computing waits
for it, keeping its place, its batch seat and its blocks (the engine's
set-aside rule: a burst sharing a system prompt computes it once).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from cluster.perf_model.step_shape import StepShape, StepTimeModel
from cluster.simulator.prefix_cache import PrefixCache
from engine.step_cost import EngineCosts


@dataclass(eq=False)
class SimSequence:
    """A request's state on one replica."""
    index: int
    prompt_len: int
    output_len: int
    generated: int = 0            # output tokens so far (all replicas)
    computed: int = 0             # tokens whose KV is on this replica
    hold_after_first: bool = False  # prefill role: stop after the first token, keep the KV
    is_running: bool = False      # in its replica's running list
    preempted: bool = False       # preempted on this replica since it came (its KV to recompute)
    block_hashes: tuple[int, ...] = ()   # chained hashes of the prompt's full blocks (prefix_cache.py)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    @property
    def finished(self) -> bool:
        return self.generated >= self.output_len


@dataclass
class SimReplica:
    name: str
    model: StepTimeModel
    num_blocks: int
    block_size: int
    max_num_seqs: int                # (at most max_num_batched_tokens: ReplicaSpec caps it)
    max_num_batched_tokens: int
    # called at each step's end with (sequence, time) for every token sampled
    on_token: Callable[[SimSequence, float], None] = lambda seq, t: None
    # called when a hold_after_first sequence has its first token (its KV stays held)
    on_prefilled: Callable[[SimSequence, float], None] = lambda seq, t: None
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    used_blocks: int = 0
    held: dict = field(default_factory=dict)          # prefill side: index -> blocks kept until sent
    reserved: dict = field(default_factory=dict)      # decode side: index -> blocks waiting for their KV
    busy: bool = False
    step_pending: bool = False       # a step start is queued for this instant
    draining: bool = False           # scaled down: takes nothing new, finishes what it holds
    started_at: float = 0.0          # placed (holds its devices from then on)
    stopped_at: float | None = None
    num_steps: int = 0
    num_preemptions: int = 0
    threads: int = 1                 # CPU threads a step keeps busy (ClusterSpec.shared_cores)
    in_core_ledger: bool = False     # lends its threads' cores while idle (ClusterSpec.lend_idle_cores)
    wide_model: StepTimeModel | None = None   # set on a replica that borrows idle cores
    borrowed: int = 0                # cores borrowed for the step it runs
    stretch_sum: float = 0.0         # sum over its steps of step time / the model's time
    step: object = None              # the step it runs on shared cores (cluster_sim._SharedStep)
    prefix_cache: PrefixCache | None = None   # None: prefix caching off
    enable_chunked_prefill: bool = True       # False: a prompt runs whole in one step, or waits
    cached_prompt_tokens: int = 0    # prompt tokens its prefix cache spared it, in all
    costs: EngineCosts = field(default_factory=EngineCosts)   # what it reports to the router, from its steps
    waiting_tokens: int = 0          # the waiting sequences' tokens, all to be computed (kept as they come and go)

    # ---- load figures the router reads --------------------------------------------
    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.used_blocks

    @property
    def queued_prefill_tokens(self) -> int:
        # the waiting queue's by its running count (thousands wait under overload, and the router
        # reads this on every arrival); the running ones are at most max_num_seqs
        return self.waiting_tokens + \
            sum(s.num_tokens - s.computed for s in self.running if s.computed < s.prompt_len)

    @property
    def decode_routing_key(self) -> tuple[int, int]:
        """How the router ranks decode (or colocated) replicas, highest first: free
        blocks less those its queued prompts will take (the live router charges a
        replica the prompts it just sent it, which no report shows yet), then the
        fewest requests held (its tie-break: fewest calls in flight)."""
        held = len(self.waiting) + len(self.running) + len(self.reserved)
        return self.free_blocks - self.blocks_for(self.waiting_tokens), -held

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---- work in --------------------------------------------------------------------
    def add(self, seq: SimSequence) -> None:
        seq.computed = 0
        seq.preempted = False
        self.waiting.append(seq)
        self.waiting_tokens += seq.num_tokens

    def try_admit_prefilled(self, seq: SimSequence) -> bool:
        """A decode replica takes a sequence whose prompt KV arrives from elsewhere:
        reserves its blocks now (False if they are not free, or if they would leave
        too few for the sequence at the head of the waiting queue, or while a
        preempted sequence waits, as the engine's Scheduler.reserve decides, which
        keeps the head a batch slot too)."""
        if any(waiting.preempted for waiting in self.waiting):
            return False
        need = self.blocks_for(seq.prompt_len)      # (its first token's KV comes with its first decode step)
        head = self.blocks_for(self.waiting[0].num_tokens) if self.waiting else 0
        slots = len(self.running) + len(self.reserved) + (1 if self.waiting else 0)   # (a slot kept for the head)
        if need + head > self.free_blocks or slots >= self.max_num_seqs:
            return False
        self.used_blocks += need
        self.reserved[seq.index] = need
        return True

    def commit_prefilled(self, seq: SimSequence) -> None:
        """The reserved sequence's KV has arrived (into the prompt's blocks reserved for
        it, which it keeps): it decodes from the next step."""
        self.reserved.pop(seq.index)
        seq.preempted = False       # (on the replica it came from)
        seq.computed = seq.prompt_len
        self.running.append(seq)
        seq.is_running = True
        if self.prefix_cache is not None and seq.block_hashes:     # as the engine caches what arrived
            self.prefix_cache.insert(seq.block_hashes[:seq.prompt_len // self.block_size])

    def release_held(self, seq: SimSequence) -> None:
        self.used_blocks -= self.held.pop(seq.index)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def idle(self) -> bool:
        """Nothing queued, running, held for a hand-off or reserved for one."""
        return not (self.waiting or self.running or self.held or self.reserved or self.busy)

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> tuple[StepShape, list[tuple[SimSequence, int]]]:
        """The next step's work as (sequence, new tokens), decodes first; applies
        block allocation and preemption as the engine does."""
        budget = self.max_num_batched_tokens
        work: list[tuple[SimSequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.computed
            # a running prefill (a chunked prompt, a recompute) leaves a token for each decode after it,
            # as the engine's scheduler does
            n = min(remaining, budget if _decodes(seq) else budget - self._decodes_after(i))
            if n <= 0 or (n < remaining and not self.enable_chunked_prefill):
                i += 1
                continue
            while not self._allocate(seq, seq.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if not seq.is_running:
                break                         # it preempted itself: nothing younger is left
            work.append((seq, n))
            budget -= n
            i += 1
        set_aside: list[SimSequence] = []       # waiting for prompt blocks in flight, keeping their place
        set_aside_blocks = 0
        in_flight: set[int] | None = None
        while (not preempted and self.waiting and budget > 0
               and len(self.running) + len(self.reserved) + len(set_aside) < self.max_num_seqs):
            seq = self.waiting[0]
            cached = self._cached_tokens(seq)
            if self.prefix_cache is not None and seq.block_hashes:
                in_flight = self._blocks_in_flight() if in_flight is None else in_flight
                if self._next_block_in_flight(seq, cached, in_flight):
                    set_aside_blocks += self.blocks_for(seq.num_tokens)    # (a hit counts its blocks here)
                    set_aside.append(self.waiting.popleft())
                    continue
            remaining = seq.num_tokens - seq.computed - cached
            n = min(remaining, budget)
            whole = self.blocks_for(seq.num_tokens) - self.blocks_for(seq.computed)   # admitted only if all fit
            if (n < remaining and not self.enable_chunked_prefill) or \
                    whole + set_aside_blocks > self.free_blocks or \
                    not self._allocate(seq, seq.computed + cached + n):
                break
            self.waiting.popleft()
            self.waiting_tokens -= seq.num_tokens
            seq.computed += cached
            self.cached_prompt_tokens += cached
            self.running.append(seq)
            seq.is_running = True
            work.append((seq, n))
            budget -= n
            if in_flight is not None:         # its prompt blocks are being computed from now on
                in_flight.update(self._uncomputed_prompt_blocks(seq))
        self.waiting.extendleft(reversed(set_aside))
        decodes = [s.computed + 1 for s, n in work if n == 1 and s.computed >= s.prompt_len]
        chunks = [(s.computed, n) for s, n in work if not (n == 1 and s.computed >= s.prompt_len)]
        return StepShape.build(chunks, decodes), work

    def _matchable_blocks(self, seq: SimSequence) -> tuple[int, ...]:
        """The hashes of the prompt blocks a cache match may cover (not one holding the
        last prompt token, which always runs)."""
        return seq.block_hashes[:(seq.prompt_len - 1) // self.block_size]

    def _uncomputed_prompt_blocks(self, seq: SimSequence) -> tuple[int, ...]:
        """Those of them `seq` has yet to compute here."""
        return self._matchable_blocks(seq)[seq.computed // self.block_size:]

    def _blocks_in_flight(self) -> set[int]:
        """Prompt blocks running sequences are computing, chunk by chunk, into the prefix cache."""
        return {h for seq in self.running for h in self._uncomputed_prompt_blocks(seq)}

    def _next_block_in_flight(self, seq: SimSequence, cached: int, in_flight: set[int]) -> bool:
        """Whether the block after `seq`'s cached prefix is one a running prompt computes: the
        engine's scheduler then sets `seq` aside until it can read that block from the cache."""
        hashes = self._matchable_blocks(seq)
        index = cached // self.block_size
        return index < len(hashes) and hashes[index] in in_flight

    def _decodes_after(self, i: int) -> int:
        return sum(1 for seq in self.running[i + 1:] if _decodes(seq))

    def finish_step(self, work: list[tuple[SimSequence, int]], now: float) -> None:
        """Applies a step's results at its end time `now`."""
        self.num_steps += 1
        for seq, n in work:
            seq.computed += n
            if self.prefix_cache is not None and seq.block_hashes and seq.computed - n < seq.prompt_len:
                # the prompt's blocks computed so far (those of earlier chunks are the sequence's
                # still, which the engine never evicts: touched again, the head last)
                self.prefix_cache.insert(seq.block_hashes[:min(seq.computed, seq.prompt_len) // self.block_size])
            if seq.computed < seq.num_tokens:
                continue                      # a chunk that stops mid-prompt samples nothing
            seq.generated += 1
            self.on_token(seq, now)
            if seq.finished:
                self._free(seq)
                self._leave(seq)
            elif seq.hold_after_first:
                self._leave(seq)
                self.held[seq.index] = self.blocks_for(seq.computed)
                self.on_prefilled(seq, now)

    # ---- blocks -----------------------------------------------------------------------
    def _cached_tokens(self, seq: SimSequence) -> int:
        """Prompt tokens a sequence starting here with no KV can skip (0 without a cache)."""
        if self.prefix_cache is None or seq.computed or not seq.block_hashes:
            return 0
        return self.prefix_cache.match(seq.block_hashes, seq.prompt_len, self.block_size)

    def _allocate(self, seq: SimSequence, tokens: int) -> bool:
        """Blocks for `tokens` of `seq` (it holds blocks for its computed tokens)."""
        extra = self.blocks_for(tokens) - self.blocks_for(seq.computed)
        if extra > self.free_blocks:
            return False
        self.used_blocks += extra
        return True

    def _leave(self, seq: SimSequence) -> None:
        self.running.remove(seq)
        seq.is_running = False

    def _free(self, seq: SimSequence) -> None:
        self.used_blocks -= self.blocks_for(seq.computed)

    def _preempt(self, seq: SimSequence) -> None:
        self._free(seq)
        self._leave(seq)
        seq.computed = 0
        seq.preempted = True
        self.waiting.appendleft(seq)
        self.waiting_tokens += seq.num_tokens
        self.num_preemptions += 1


def _decodes(seq: SimSequence) -> bool:
    """Its next step is a decode: its prompt is in, and one token (the latest sampled) is left."""
    return seq.computed >= seq.prompt_len and seq.num_tokens - seq.computed == 1
