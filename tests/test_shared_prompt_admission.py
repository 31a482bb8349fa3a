"""Requests whose prompts share blocks with a prompt still being computed wait for
those blocks and read them from the prefix cache (n choices of one prompt, a
system prompt many requests share): the shared part is computed once, the
output is what each request gives alone, and nobody else waits behind them."""

from __future__ import annotations

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.test_parity import _prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _engine(model_dirs, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), **{"max_model_len": 512, "block_size": 8, **kw}))


def _run(engine: LLMEngine) -> tuple[dict, int]:
    """Steps to the end: {request id: final output}, prompt tokens computed in all."""
    done, computed = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if engine.last_step is not None and not engine.last_step_empty:
            computed += engine.last_step.num_prefill_tokens
    return done, computed


def test_eight_copies_of_a_prompt_compute_its_blocks_once(model_dirs, reference):
    engine = _engine(model_dirs)
    prompt = _prompts(engine.tokenizer, 1, seed=31, min_len=100, max_len=100)[0]
    for i in range(8):
        engine.add_request(str(i), prompt, GREEDY)
    done, computed = _run(engine)
    # 12 full blocks (96 tokens) are shared; the first computes all 100, each other the last 4
    assert computed == 100 + 7 * 4
    assert sorted(out.num_cached_tokens for out in done.values()) == [0] + [96] * 7
    # /metrics' prefix-cache counters: each prompt looked up once (not again while set aside)
    assert engine.scheduler.prefix_cache_queried_tokens == 8 * 100
    assert engine.scheduler.prefix_cache_hit_tokens == 7 * 96
    expected = reference("tiny").greedy(tuple(prompt), 6, ignore_eos=True)
    assert all(out.token_ids == expected for out in done.values())


def test_a_request_behind_them_that_shares_nothing_is_admitted_at_once(model_dirs):
    engine = _engine(model_dirs)
    shared, other = _prompts(engine.tokenizer, 2, seed=32, min_len=60, max_len=60)
    for i in range(4):
        engine.add_request(f"s{i}", shared, GREEDY)
    engine.add_request("other", other, GREEDY)
    engine.step()
    running = {seq.request_id for seq in engine.scheduler.running}
    assert running == {"s0", "other"}                        # the copies wait for s0's blocks, in order
    assert [seq.request_id for seq in engine.scheduler.waiting] == ["s1", "s2", "s3"]
    done, _ = _run(engine)
    assert len(done) == 5


def test_a_request_set_aside_keeps_its_seat_and_its_blocks_from_those_behind_it(model_dirs):
    """s1 waits one step for s0's blocks; `other`, behind it, may not take the last seat
    (max_num_seqs 2) nor the blocks s1 will need (60-token prompts of 8 blocks, 16 in
    all): else s1 would wait for `other` to finish."""
    for options in ({"max_num_seqs": 2}, {"num_kv_blocks": 16, "max_model_len": 128}):
        engine = _engine(model_dirs, **options)
        shared, other = _prompts(engine.tokenizer, 2, seed=36, min_len=60, max_len=60)
        engine.add_request("s0", shared, GREEDY)
        engine.add_request("s1", shared, GREEDY)
        engine.add_request("other", other, GREEDY)
        engine.step()
        assert [seq.request_id for seq in engine.scheduler.running] == ["s0"], options
        engine.step()
        assert [seq.request_id for seq in engine.scheduler.running][:2] == ["s0", "s1"], options
        done, _ = _run(engine)
        assert done["s1"].num_cached_tokens == 56 and len(done) == 3


def test_a_preempted_request_set_aside_keeps_the_blocks_of_its_output_too():
    """A preempted request set aside for a prompt block in flight recomputes its output as
    well: the blocks kept for it counted its prompt only, and a request behind it took the
    ones its output needs."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    blocks = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=4)
    prompt = list(range(10, 26))                                  # 16 tokens, 4 blocks
    running = Sequence("running", list(prompt), 16, SamplingParams(max_tokens=8))
    scheduler.add(running)
    step = scheduler.schedule()
    scheduler.after_step(step)                                    # its first block computed and cached
    preempted = Sequence("preempted", list(prompt) + list(range(40, 48)), 16, SamplingParams(max_tokens=16))
    preempted.num_preemptions = 1                                 # 8 output tokens: 2 blocks beyond the prompt
    behind = Sequence("behind", list(range(60, 64)), 4, SamplingParams(max_tokens=4))
    scheduler.waiting.extend([preempted, behind])
    scheduler.max_num_batched_tokens = 16
    step = scheduler.schedule()                                   # `running` takes the rest of its prompt
    assert [seq.request_id for seq in step.seqs] == ["running"]
    assert [seq.request_id for seq in scheduler.waiting] == ["preempted", "behind"]
    assert blocks.num_free_blocks == 2                            # what the preempted one's output needs


def test_a_prompt_sharing_only_a_prefix_waits_one_step_and_computes_its_own_part(model_dirs, reference):
    """Both fit one 512-token step, but the second shares the first's first 200 tokens:
    it waits for them, reads them from the cache, and computes only its own 100."""
    engine = _engine(model_dirs)
    base, tail = _prompts(engine.tokenizer, 2, seed=33, min_len=200, max_len=200)
    first, second = base + tail[:100], base + tail[100:]
    engine.add_request("first", first, GREEDY)
    engine.add_request("second", second, GREEDY)
    engine.step()
    assert [seq.request_id for seq in engine.scheduler.waiting] == ["second"]
    first_step = engine.last_step.num_prefill_tokens
    done, computed = _run(engine)
    assert done["second"].num_cached_tokens == 200
    assert (first_step, computed) == (300, 100)      # alone in the first step, then only its own part
    for rid, prompt in (("first", first), ("second", second)):
        assert done[rid].token_ids == reference("tiny").greedy(tuple(prompt), 6, ignore_eos=True)


def test_a_request_scoring_its_prompt_computes_it_whole_and_does_not_wait(model_dirs):
    engine = _engine(model_dirs)
    prompt = _prompts(engine.tokenizer, 1, seed=34, min_len=50, max_len=50)[0]
    engine.add_request("a", prompt, GREEDY)
    engine.add_request("scored", prompt, SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=0))
    engine.step()
    assert {seq.request_id for seq in engine.scheduler.running} == {"a", "scored"}
    done, computed = _run(engine)
    assert done["scored"].num_cached_tokens == 0 and len(done["scored"].prompt_logprobs) == 50


def test_without_prefix_caching_nothing_waits(model_dirs):
    engine = _engine(model_dirs, enable_prefix_caching=False)
    prompt = _prompts(engine.tokenizer, 1, seed=35, min_len=40, max_len=40)[0]
    for i in range(3):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()
    assert len(engine.scheduler.running) == 3


def test_a_preempted_request_scoring_its_prompt_reads_back_only_what_it_scored(model_dirs):
    """Recomputed after a preemption, a scoring request takes from the prefix cache the
    blocks of the tokens it has scored (all but the last, whose logits score the next
    one); a fresh one takes none, as a cached token would go unscored."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    blocks = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(10, 30))                       # 20 tokens, all 5 blocks computed and cached before
    earlier: list[int] = []
    blocks.allocate(earlier, 20)
    blocks.cache_full_blocks(prompt, earlier, 20, 0)
    blocks.free(earlier)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    scored = SamplingParams(max_tokens=2, prompt_logprobs=0)
    preempted = Sequence("preempted", list(prompt), 20, scored, prompt_logprobs=[None] + [object()] * 9)
    fresh = Sequence("fresh", list(prompt), 20, scored, prompt_logprobs=[None])
    preempted.num_preemptions = 1
    scheduler.waiting.extend([preempted, fresh])
    step = scheduler.schedule()
    # tokens 1-9 scored: blocks [0, 8) read back; the chunk runs from 8, and token 10 on is scored
    assert [(s.request_id, s.num_computed_tokens, n) for s, n in zip(step.seqs, step.num_new_tokens)] == \
        [("preempted", 8, 12), ("fresh", 0, 20)]
