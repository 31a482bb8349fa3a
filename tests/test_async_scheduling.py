"""Async scheduling: step() launches the next batch before it reads back the
previous one's samples. On a CPU the forward pass finishes before launch
returns, but the bookkeeping is the GPU's: pending tokens, input tokens filled
in on the device, outputs one call late, rows wasted on a request that just
ended. Every test compares against the synchronous engine or transformers."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sequence import PENDING_TOKEN
from tests.test_parity import _check, _prompts, _run_staggered


def _engine(model_dir, async_scheduling: bool, max_model_len: int = 256, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), max_model_len=max_model_len,
                                  async_scheduling=async_scheduling, **kw))


def _count_filled_steps(engine: LLMEngine) -> list[int]:
    """Records, per forward pass, how many input tokens were filled in on the device."""
    filled: list[int] = []
    execute = engine.worker.execute

    def recording(inputs, fill=None):
        filled.append(0 if fill is None else fill.rows.numel())
        return execute(inputs, fill)

    engine.worker.execute = recording
    return filled


def _mixed_requests(tokenizer) -> list[tuple[int, str, list[int], SamplingParams]]:
    """(arrival step, request id, prompt, params): greedy and seeded sampling, stops,
    min_tokens, logprobs and penalties (rows that must be read back at once)."""
    prompts = _prompts(tokenizer, 12, seed=7, min_len=3, max_len=60)
    g = dict(temperature=0.0, ignore_eos=True)
    params = [
        SamplingParams(max_tokens=1, **g),
        SamplingParams(max_tokens=2, **g),
        SamplingParams(max_tokens=30, **g),
        SamplingParams(max_tokens=17, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, logprobs=2, **g),
        SamplingParams(max_tokens=15, repetition_penalty=1.3, **g),
        SamplingParams(max_tokens=25, stop=["e"], **g),
        SamplingParams(max_tokens=25, temperature=0.0),                      # EOS may end it
        SamplingParams(max_tokens=40, **g),
        SamplingParams(max_tokens=9, min_tokens=4, **g),
        SamplingParams(max_tokens=22, **g),
    ]
    arrivals = [0, 0, 0, 0, 1, 3, 3, 5, 6, 6, 11, 14]
    return [(a, str(i), p, sp) for i, (a, p, sp) in enumerate(zip(arrivals, prompts, params))]


def _run(engine: LLMEngine, requests, abort_at: dict[str, int] | None = None) -> dict[str, tuple]:
    """Steps until done, adding each request at its arrival step and aborting as
    told; returns per request (token ids, text, finish reason, stop reason,
    logprobs) and checks that the streamed deltas add up to the final output."""
    abort_at = abort_at or {}
    streamed: dict[str, list] = {}
    final: dict[str, tuple] = {}
    step = 0
    while step <= max(a for a, *_ in requests) or engine.has_unfinished_requests():
        for arrival, rid, prompt, params in requests:
            if arrival == step:
                engine.add_request(rid, prompt, params)
        for rid, when in abort_at.items():
            if when == step:
                engine.abort_request(rid)
                final[rid] = ("aborted",)
        for out in engine.step():
            assert final.get(out.request_id) != ("aborted",), "an output after the abort"
            ids, text = streamed.setdefault(out.request_id, [[], ""])
            streamed[out.request_id] = [ids + out.delta_token_ids, text + out.delta_text]
            assert PENDING_TOKEN not in out.token_ids
            if out.finished:
                final[out.request_id] = (out.token_ids, out.text, out.finish_reason, out.stop_reason,
                                         [(lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs or []])
                assert streamed[out.request_id] == [out.token_ids, out.text]
        step += 1
        assert step < 1000
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return final


def test_outputs_equal_the_synchronous_engines_for_every_kind_of_request(model_dirs):
    sync = _engine(model_dirs["tiny"], False)
    requests = _mixed_requests(sync.tokenizer)
    expected = _run(sync, requests, abort_at={"9": 8})
    engine = _engine(model_dirs["tiny"], True)
    filled = _count_filled_steps(engine)
    got = _run(engine, requests, abort_at={"9": 8})
    assert got == expected
    assert {r for r, v in expected.items() if v != ("aborted",) and v[2] == "length"} >= {"0", "1", "2", "3"}
    assert expected["7"][2] == "stop"
    # most forward passes took their input tokens from the previous pass's samples
    assert sum(1 for n in filled if n) > len(filled) // 2


def test_the_first_step_returns_nothing_and_the_next_returns_its_tokens(model_dirs):
    engine = _engine(model_dirs["tiny"], True)
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert engine.step() == []
    seq = engine.scheduler.running[0]
    assert seq.num_pending_tokens == 1 and seq.token_ids[-1] == PENDING_TOKEN
    assert engine.has_unfinished_requests()
    outs = engine.step()               # launches the first decode, reads back the prefill's token
    assert [len(o.token_ids) for o in outs] == [1]
    assert seq.num_pending_tokens == 1 and len(seq.token_ids) == 4 + 2
    outs = engine.step()
    assert [len(o.token_ids) for o in outs] == [2]
    outs = engine.step()               # max_tokens is known: no fourth token is launched
    assert [(len(o.token_ids), o.finished) for o in outs] == [(3, True)]
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_greedy_matches_transformers_with_staggered_arrivals(preset, model_dirs, reference):
    engine = _engine(model_dirs[preset], True, max_num_seqs=6)
    prompts = _prompts(engine.tokenizer, 10, seed=3)
    max_tokens = [random.Random(i).randint(1, 24) for i in range(len(prompts))]
    got = _run_staggered(engine, prompts, max_tokens, arrivals_per_step=2)
    _check(reference, preset, prompts, max_tokens, got)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_with_pending_tokens_gives_the_synchronous_output(model_dirs):
    """A KV pool too small for the batch: sequences are preempted while their last
    token is still pending, and recompute it once it is known."""
    requests = [(i // 2, str(i), p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
                for i, p in enumerate(_prompts(_engine(model_dirs["tiny"], False).tokenizer, 6, seed=9,
                                               min_len=20, max_len=40))]
    results = {}
    for async_scheduling in (False, True):
        engine = _engine(model_dirs["tiny"], async_scheduling, num_kv_blocks=12, block_size=8, max_model_len=96)
        results[async_scheduling] = _run(engine, requests)
        assert engine.scheduler.num_preemptions > 0
    assert results[True] == results[False]


def test_prefix_cache_registers_blocks_once_their_tokens_are_known(model_dirs):
    """A prompt that repeats an earlier request's prompt and output hits the cache
    as far under async scheduling as without it."""
    hits = {}
    for async_scheduling in (False, True):
        engine = _engine(model_dirs["tiny"], async_scheduling, block_size=4)
        first = _run(engine, [(0, "a", list(range(3, 22)), SamplingParams(temperature=0.0, max_tokens=21,
                                                                           ignore_eos=True))])
        follow_up = list(range(3, 22)) + first["a"][0] + [9, 9]
        engine.add_request("b", follow_up, SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished_requests():
            for out in engine.step():
                hits[async_scheduling] = out.num_cached_tokens
    # 19 prompt + 20 output tokens have K/V (the 21st output token never ran): 9 full blocks of 4
    assert hits[True] == hits[False] == 36


def test_a_prefill_role_request_holds_only_its_prompt_blocks(model_dirs):
    engine = _engine(model_dirs["tiny"], True, block_size=4)
    prompts = {"p": list(range(3, 15)), "q": list(range(20, 27))}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=8), hold_kv=True)
    firsts = {}
    while engine.has_unfinished_requests():
        for out in engine.step(decode=False):
            firsts[out.request_id] = out.token_ids
    assert sorted(firsts) == ["p", "q"] and all(len(t) == 1 for t in firsts.values())
    for rid, prompt in prompts.items():
        seq = engine.held_sequence(rid)
        assert seq.num_pending_tokens == 0 and seq.num_computed_tokens == len(prompt)
        assert len(seq.block_table) == -(-len(prompt) // 4)


def test_async_scheduling_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size 1"):
        EngineConfig(model="unused", tensor_parallel_size=2, async_scheduling=True)


def test_a_sequence_whose_pending_token_is_its_last_is_never_preempted():
    """A prefill worker's prompt whose first token is still pending is about to be
    held for its hand-off: preempting it would hold no blocks. The block-hungry
    sequence preempts itself instead, the only one that goes on."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence, SequenceStatus

    blocks = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    decoding = Sequence("decoding", list(range(3, 12)), 8, SamplingParams(max_tokens=8))   # 8 prompt + 1 output
    held = Sequence("held", list(range(20, 28)) + [PENDING_TOKEN], 8, SamplingParams(max_tokens=8), hold_kv=True,
                    num_pending_tokens=1)
    for seq in (decoding, held):   # 8 tokens computed each: 2 blocks each, none left
        assert blocks.allocate(seq.block_table, 8)
        seq.num_computed_tokens, seq.status = 8, SequenceStatus.RUNNING
        scheduler.running.append(seq)
    step = scheduler.schedule()
    assert step.preempted == [decoding] and step.seqs == []
    assert held.status is SequenceStatus.RUNNING and len(held.block_table) == 2


def test_a_sequence_whose_pending_token_may_be_its_last_waits_instead_of_preempting_another():
    """Async scheduling: the sequence's pending token (not yet read back) may be its EOS; at a
    block boundary in a full pool it preempted the newest sequence (a full recompute) for a
    block it might never use. It waits a step instead: then its token is known."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence, SequenceStatus

    blocks = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    old = Sequence("old", list(range(3, 11)) + [PENDING_TOKEN], 8, SamplingParams(max_tokens=8),
                   num_pending_tokens=1)                      # 8 computed: its next token needs a 3rd block
    young = Sequence("young", list(range(30, 37)) + [5], 7, SamplingParams(max_tokens=8))   # fits its 2 blocks
    for seq, computed in ((old, 8), (young, 7)):
        assert blocks.allocate(seq.block_table, computed)
        seq.num_computed_tokens, seq.status = computed, SequenceStatus.RUNNING
        scheduler.running.append(seq)
    step = scheduler.schedule()
    assert step.preempted == [] and step.seqs == [young]
    old.token_ids[-1], old.num_pending_tokens = 9, 0          # read back: not its last token
    scheduler.after_step(step)
    step = scheduler.schedule()
    assert step.preempted == [young] and step.seqs == [old]   # now it takes the block it needs


def test_a_sequence_whose_pending_token_may_be_its_last_does_not_preempt_itself_either():
    """Async scheduling, many requests ending together (one max_tokens): the block-hungry
    sequence is the only one that may go on, the others' pending tokens are their last and
    free their blocks once read back. It preempted itself (a full recompute); it waits a step."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence, SequenceStatus

    blocks = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    going_on = Sequence("going-on", list(range(3, 11)) + [PENDING_TOKEN], 8, SamplingParams(max_tokens=8),
                        num_pending_tokens=1)                 # 8 computed: its next token needs a 3rd block
    ending = Sequence("ending", list(range(30, 37)) + [PENDING_TOKEN], 7, SamplingParams(max_tokens=1),
                      num_pending_tokens=1)                   # its pending token is its last
    for seq in (going_on, ending):
        assert blocks.allocate(seq.block_table, 8)
        seq.num_computed_tokens, seq.status = 8, SequenceStatus.RUNNING
        scheduler.running.append(seq)
    step = scheduler.schedule()
    assert step.preempted == [] and step.seqs == []
    assert going_on.status is SequenceStatus.RUNNING and len(going_on.block_table) == 2


def test_a_hand_off_waits_while_a_preempted_sequence_does():
    """A decode worker: each preemption puts its victim at the head of the queue, and a hand-off
    reserved past an older preempted sequence (then preempted in turn) kept it behind for ever."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence, SequenceStatus

    blocks = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    preempted = Sequence("preempted", list(range(3, 12)), 8, SamplingParams(max_tokens=8))
    preempted.num_preemptions = 1
    scheduler.add(preempted)
    handoff = Sequence("handoff", list(range(40, 48)), 8, SamplingParams(max_tokens=8))
    assert not scheduler.reserve(handoff, 8)          # room for both, but the preempted one comes first
    assert handoff.block_table == [] and blocks.num_free_blocks == 16
    scheduler.waiting.clear()
    fresh = Sequence("fresh", list(range(3, 12)), 9, SamplingParams(max_tokens=8))
    scheduler.add(fresh)                              # a prompt to prefill here: room is kept for it only
    assert scheduler.reserve(handoff, 8) and handoff.status is SequenceStatus.RESERVED


def test_no_more_sequences_run_than_a_step_has_tokens():
    """max_num_seqs above max_num_batched_tokens: the oldest took every token of each step and
    the newest sequences admitted past the budget never got one."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    scheduler = Scheduler(BlockManager(num_blocks=64, block_size=4), max_num_seqs=8, max_num_batched_tokens=4)
    assert scheduler.max_num_seqs == 4
    for i in range(6):
        scheduler.add(Sequence(f"r{i}", [3 + i], 1, SamplingParams(max_tokens=4)))
    for _ in range(3):
        step = scheduler.schedule()
        assert len(scheduler.running) == 4 and set(step.seqs) == set(scheduler.running)   # none starved
        scheduler.after_step(step)
        for seq in step.seqs:
            seq.token_ids.append(7)           # its sampled token
    assert len(scheduler.waiting) == 2


def test_a_running_prefill_ahead_of_decodes_leaves_each_of_them_a_token():
    """A decode worker readmits a preempted sequence behind nothing: its recompute is a
    running prefill ahead of the hand-offs admitted since. Its chunk leaves the budget's
    last tokens to the decodes after it, which would otherwise stall until it is done."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence, SequenceStatus

    blocks = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=16)
    recompute = Sequence("recompute", list(range(3, 43)), 30, SamplingParams(max_tokens=20))   # 30 + 10 output
    decoding = [Sequence(f"d{i}", list(range(50, 59)), 8, SamplingParams(max_tokens=8)) for i in range(3)]
    for seq in decoding:       # 8 prompt tokens and 1 output computed but the last: one token to run
        assert blocks.allocate(seq.block_table, 8)
        seq.num_computed_tokens, seq.status = 8, SequenceStatus.RUNNING
    recompute.status = SequenceStatus.RUNNING
    scheduler.running.extend([recompute, *decoding])
    step = scheduler.schedule()
    assert [s.request_id for s in step.seqs] == ["d0", "d1", "d2", "recompute"]
    assert step.num_new_tokens == [1, 1, 1, 13]                    # 16 tokens: 3 decodes + a 13-token chunk
    # a prefill-only step (a prefill worker's) keeps the whole budget for the chunk
    scheduler.after_step(step)
    only_prefill = scheduler.schedule(decode=False)
    assert [(s.request_id, n) for s, n in zip(only_prefill.seqs, only_prefill.num_new_tokens)] == [("recompute", 16)]


def test_a_step_that_only_preempted_is_not_a_blocked_engine(model_dirs, monkeypatch):
    """A decode that finds no block and no younger victim preempts itself and runs
    nothing this step (as in the test above); the blocks it freed let the next
    step run, so a loop that only steps must not be told the engine is stuck."""
    from engine.scheduler import ScheduledStep
    engine = _engine(model_dirs["tiny"], False)
    engine.add_request("r", list(range(3, 12)), SamplingParams(temperature=0.0, max_tokens=4))
    schedule = engine.scheduler.schedule
    victim = engine.scheduler.waiting[0]
    monkeypatch.setattr(engine.scheduler, "schedule", lambda **kw: ScheduledStep(preempted=[victim]))
    assert engine.step() == [] and not engine.last_step_empty
    engine.raise_if_blocked()                      # (raised "1 requests wait for KV blocks ...")
    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    while engine.has_unfinished_requests():
        engine.step()
        engine.raise_if_blocked()
