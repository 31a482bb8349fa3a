"""The engine hooks prefill and decode workers use, beyond greedy parity:
seeds, logprobs and min_tokens across the hand-off, preemption on a
decode-only engine, and refusing bad hand-off input."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams


def _engines(model_dirs, **kw):
    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=256, block_size=8, **kw)
    return LLMEngine(config), LLMEngine(config)


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _handoff(prefill: LLMEngine, decode: LLMEngine, prompts, params) -> dict[int, list[int]]:
    for i, p in enumerate(prompts):
        prefill.add_request(str(i), p, params, hold_kv=True)
    for out in prefill.run_to_completion():
        held = prefill.held_sequence(out.request_id)
        dst = decode.reserve_prefilled(
            out.request_id, prompts[int(out.request_id)], out.token_ids[0], params,
            first_logprobs=out.logprobs[0] if out.logprobs else None,
            generator_state=held.generator.get_state() if held.generator is not None else None)
        decode.kv_cache.write_blocks(dst, prefill.kv_cache.read_blocks(held.block_table))
        prefill.release_kv(out.request_id)
        decode.commit_prefilled(out.request_id)
    return {int(o.request_id): o for o in decode.run_to_completion()}


def test_seeded_sampling_and_logprobs_survive_the_handoff(model_dirs):
    prefill, decode = _engines(model_dirs)
    single, _ = _engines(model_dirs)
    prompts = _prompts(4, seed=0)
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=12, seed=7, logprobs=2, ignore_eos=True)
    split = _handoff(prefill, decode, prompts, params)
    for i, p in enumerate(prompts):
        single.add_request(str(i), p, params)
    together = {int(o.request_id): o for o in single.run_to_completion()}
    for i in range(len(prompts)):
        assert split[i].token_ids == together[i].token_ids
        assert [lp.token_id for lp in split[i].logprobs] == split[i].token_ids
        assert [round(lp.logprob, 4) for lp in split[i].logprobs] == \
            [round(lp.logprob, 4) for lp in together[i].logprobs]


def test_min_tokens_holds_on_the_prefill_side(model_dirs):
    """The first token is sampled on the prefill side: min_tokens must already
    ban the stop tokens there."""
    prefill, _ = _engines(model_dirs)
    p = _prompts(1, seed=1)[0]
    prefill.add_request("probe", p, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    (probe,) = prefill.run_to_completion()
    first = probe.token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, stop_token_ids=[first])
    prefill.add_request("x", p, params, hold_kv=True)
    (out,) = prefill.run_to_completion()
    assert out.token_ids[0] != first


@pytest.mark.parametrize("tokens_per_step", [2048, 16])
def test_decode_only_engine_readmits_what_it_preempts(model_dirs, reference, tokens_per_step):
    """Three received sequences that outgrow a 16-block pool: the decode-only
    engine preempts, recomputes, and still finishes all of them correctly, also
    when a recompute takes several steps' budgets (its later chunks run in
    decode-only steps too)."""
    prefill = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=64, block_size=4))
    decode = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=64, block_size=4,
                                    num_kv_blocks=16, enable_prefix_caching=False,
                                    max_num_batched_tokens=tokens_per_step))
    prompts = _prompts(3, seed=2)
    prompts = [(p * 4)[:12] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts):
        prefill.add_request(str(i), p, params, hold_kv=True)
    for out in prefill.run_to_completion():
        held = prefill.held_sequence(out.request_id)
        dst = decode.reserve_prefilled(out.request_id, prompts[int(out.request_id)], out.token_ids[0], params)
        decode.kv_cache.write_blocks(dst, prefill.kv_cache.read_blocks(held.block_table))
        decode.commit_prefilled(out.request_id)
    done = {}
    for _ in range(500):
        for o in decode.step(prefill=False):
            if o.finished:
                done[int(o.request_id)] = o.token_ids
        if not decode.has_unfinished_requests():
            break
    assert decode.scheduler.num_preemptions > 0
    assert sorted(done) == [0, 1, 2]
    assert decode.block_manager.num_free_blocks == 16
    for i, p in enumerate(prompts):      # ignore_eos: EOS may be sampled and decoding goes on (min_new_tokens
        assert done[i] == reference("tiny").greedy(tuple(p), 40, ignore_eos=True)    # would ban it instead)


def test_bad_handoff_input_is_refused(model_dirs):
    prefill, decode = _engines(model_dirs)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    total = decode.block_manager.num_blocks

    def untouched() -> bool:
        return decode.block_manager.num_free_blocks == total and not decode.scheduler.reserved \
            and not decode.has_unfinished_requests()

    with pytest.raises(InvalidRequestError, match=r"token id 100000 at position 0 is outside"):
        decode.reserve_prefilled("a", [5, 6, 7], 100000, params)
    assert untouched()
    with pytest.raises(InvalidRequestError, match="request_id must be a string"):
        decode.reserve_prefilled(None, [5, 6, 7], 8, params)
    assert untouched()
    with pytest.raises(InvalidRequestError, match="pass the first token's first_logprobs"):
        decode.reserve_prefilled("b", [5, 6, 7], 8, SamplingParams(logprobs=1))
    assert untouched()
    from engine import output_processor
    real_append = output_processor.RequestTextState.append

    def failing_append(self, *args, **kwargs):
        raise RuntimeError("detokenizing failed")
    output_processor.RequestTextState.append = failing_append    # a failure after the blocks were reserved
    try:
        with pytest.raises(RuntimeError, match="detokenizing failed"):
            decode.reserve_prefilled("c", [5, 6, 7], 8, params)
    finally:
        output_processor.RequestTextState.append = real_append
    assert untouched()                                   # before: "c" kept its reserved blocks and seat
    with pytest.raises(InvalidRequestError, match="has no reserved blocks"):
        decode.commit_prefilled("never")
    with pytest.raises(ValueError, match=r"outside the KV cache's blocks"):
        decode.read_kv_shards([decode.kv_cache.num_blocks])
    assert untouched()
    # nothing above disturbed the engine: a real hand-off still decodes as one engine would
    prompt = [5, 6, 7, 9, 11]
    prefill.add_request("c", prompt, params, hold_kv=True)
    (first,) = prefill.run_to_completion()
    blocks = decode.reserve_prefilled("c", prompt, first.token_ids[0], params)
    with pytest.raises(ValueError, match="expected 1 KV shard"):
        decode.write_kv_shards(blocks, [decode.read_kv_shards(blocks)[0][:, :1]])
    decode.write_kv_shards(blocks, prefill.read_kv_shards(prefill.held_sequence("c").block_table))
    decode.commit_prefilled("c")
    (out,) = decode.run_to_completion()
    whole, _ = _engines(model_dirs)
    whole.add_request("w", prompt, params)
    (expected,) = whole.run_to_completion()
    assert out.token_ids == expected.token_ids
    assert decode.block_manager.num_free_blocks == total


def test_no_chunking_needs_a_budget_for_the_longest_prompt(model_dirs):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be >= max_model_len \(64\)"):
        LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=64, max_num_batched_tokens=16,
                               enable_chunked_prefill=False))


def test_a_decode_engine_runs_at_most_max_num_seqs_reserved_ones_included(model_dirs):
    _, decode = _engines(model_dirs, max_num_seqs=2)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    assert decode.reserve_prefilled("a", [5, 6, 7], 8, params) is not None
    assert decode.reserve_prefilled("b", [5, 6, 9], 8, params) is not None
    assert decode.reserve_prefilled("c", [5, 6, 10], 8, params) is None     # the batch is full
    decode.add_request("local", [7, 7, 7], params)                         # a prompt it prefills itself waits too
    decode.commit_prefilled("a")
    assert decode.reserve_prefilled("c", [5, 6, 10], 8, params) is None
    step = decode.scheduler.schedule()
    assert [s.request_id for s in step.seqs] == ["a"]
    decode.scheduler.after_step(step)
    decode.abort_request("a")
    # the slot "a" frees is the waiting prompt's: it came first (a hand-off taking it would
    # keep it waiting for as long as hand-offs come)
    assert decode.reserve_prefilled("c", [5, 6, 10], 8, params) is None
    assert [s.request_id for s in decode.scheduler.schedule().seqs] == ["local"]
    decode.abort_request("b")
    assert decode.reserve_prefilled("c", [5, 6, 10], 8, params) is not None


def test_a_handed_off_requests_deltas_carry_one_logprob_per_new_token(model_dirs):
    """The prefill side sends the first token with its logprobs; the decode
    engine's outputs count that token too, and the deltas the decode worker
    streams (through its outbox) must not send its logprobs again."""
    import asyncio

    from cluster.serving.messages import TokenDelta
    from decode_workers.delta_outbox import DeltaOutbox

    prefill, decode = _engines(model_dirs)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    prefill.add_request("r", prompt, params, hold_kv=True)
    (first,) = prefill.run_to_completion()
    decode.reserve_prefilled("r", prompt, first.token_ids[0], params, first_logprobs=first.logprobs[0],
                             first_token_emitted=True)

    async def decode_deltas() -> list[TokenDelta]:
        outbox, deltas = DeltaOutbox(), []
        outbox.put([decode.commit_prefilled("r")])
        while decode.has_unfinished_requests():
            outbox.put(decode.step())
            deltas += await outbox.take()
        return deltas

    deltas = [TokenDelta.from_output(first)] + asyncio.run(decode_deltas())
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == 6
    assert [lp.token_id for d in deltas for lp in d.logprobs] == tokens


@pytest.mark.parametrize("pass_state", [True, False])
def test_seeded_sampling_continues_on_the_decode_engine_with_or_without_the_generator_state(model_dirs,
                                                                                             pass_state):
    """Without the prefill side's generator state the decode engine advances its own
    past the first token's draw: the output is the one engine's either way."""
    config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=64, block_size=4)
    prefill, decode, whole = LLMEngine(config), LLMEngine(config), LLMEngine(config)
    prompt = _prompts(1, seed=5)[0]
    params = SamplingParams(temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    whole.add_request("w", prompt, params)
    (expected,) = whole.run_to_completion()
    prefill.add_request("x", prompt, params, hold_kv=True)
    (first,) = prefill.run_to_completion()
    held = prefill.held_sequence("x")
    state = held.generator.get_state() if pass_state else None
    dst = decode.reserve_prefilled("x", prompt, first.token_ids[0], params, generator_state=state)
    decode.kv_cache.write_blocks(dst, prefill.kv_cache.read_blocks(held.block_table))
    decode.commit_prefilled("x")
    (out,) = [o for o in decode.run_to_completion() if o.finished]
    assert out.token_ids == expected.token_ids
