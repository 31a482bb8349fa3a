"""Prompt logprobs (SamplingParams.prompt_logprobs): every prompt token after the
first scored under the model's raw logits, equal to transformers' log-softmax of
its own forward pass over the prompt, under every way a prompt reaches the
engine: chunked prefill beside decodes, preemption, a prefix already cached,
tensor parallelism, and the prefill side of a hand-off."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from engine.outputs import OutputKind, ResumedOutput
from engine.sampling_params import SamplingParamsError
from tests.conftest import PARITY_PRESETS
from tests.test_parity import _prompts

TOP = 3


@functools.lru_cache(maxsize=None)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_scores(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(prompt) - 1, vocab]: row i scores the token after position i."""
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(dim=-1)


def _check_against_hf(model_dir: str, prompt: list[int], entries, top: int = TOP) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    scores = _hf_scores(model_dir, prompt)
    for pos, entry in enumerate(entries[1:], start=1):
        row = scores[pos - 1]
        token = prompt[pos]
        assert entry.token_id == token, f"position {pos}: scored token {entry.token_id}, prompt has {token}"
        assert entry.logprob == pytest.approx(row[token].item(), abs=2e-4), f"position {pos}"
        # 1 + tokens scored higher; tokens within rounding of this one's score may fall either side
        assert int((row > row[token] + 2e-4).sum()) + 1 <= entry.rank <= int((row > row[token] - 2e-4).sum()) + 1
        best = row.topk(top)
        assert [t for t, _ in entry.top] == best.indices.tolist(), f"position {pos}"
        assert [lp for _, lp in entry.top] == pytest.approx(best.values.tolist(), abs=2e-4)


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], per_step: int = 2) -> dict:
    """Adds `per_step` requests before each step (they join a batch already decoding);
    returns {index: final output}."""
    pending = list(enumerate(requests))
    done = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(per_step):
            if pending:
                i, (prompt, params) = pending.pop(0)
                engine.add_request(str(i), prompt, params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
    return done


@pytest.mark.parametrize("preset", PARITY_PRESETS)
def test_prompt_logprobs_match_transformers_in_chunks_beside_decodes(preset, model_dirs):
    # a 7-token step budget splits every prompt over 7 tokens into chunks that share steps with decodes
    model_dir = str(model_dirs[preset])
    engine = LLMEngine(EngineConfig(model=model_dir, max_model_len=256, max_num_batched_tokens=7))
    prompts = _prompts(engine.tokenizer, 6, seed=11, min_len=2, max_len=40)
    scored = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=TOP)
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    requests = [(p, scored if i % 2 == 0 else plain) for i, p in enumerate(prompts)]
    done = _run(engine, requests)
    for i, p in enumerate(prompts):
        if i % 2 == 0:
            _check_against_hf(model_dir, p, done[i].prompt_logprobs)
        else:
            assert done[i].prompt_logprobs is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_prompt_chunk_of_one_token_mid_prompt_scores_the_token_after_it(model_dirs):
    """With two sequences decoding and a 3-token step budget, the prompt runs one token a
    step: each such chunk looks like a decode, and still scores the next prompt token."""
    model_dir = str(model_dirs["tiny"])
    engine = LLMEngine(EngineConfig(model=model_dir, max_model_len=128, max_num_batched_tokens=3))
    prompt = _prompts(engine.tokenizer, 1, seed=18, min_len=12, max_len=12)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", [5, 6], plain)
    engine.add_request("b", [7, 8], plain)
    for _ in range(3):
        engine.step()
    engine.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP))
    seq = engine._states["s"].seq
    computed, done = [0], []
    while not done:
        done = [o for o in engine.step() if o.request_id == "s"]
        computed.append(seq.num_computed_tokens)
    one_token_chunks = sum(b - a == 1 for a, b in zip(computed, computed[1:]) if b < len(prompt))
    assert one_token_chunks >= 5, "the prompt was meant to run a token a step"
    _check_against_hf(model_dir, prompt, done[0].prompt_logprobs)


def test_a_one_token_prompt_has_one_entry_and_zero_asks_for_no_alternatives(model_dirs):
    model_dir = str(model_dirs["tiny"])
    engine = LLMEngine(EngineConfig(model=model_dir, max_model_len=128))
    prompt = _prompts(engine.tokenizer, 1, seed=12, min_len=20, max_len=20)[0]
    done = _run(engine, [([prompt[0]], SamplingParams(max_tokens=2, prompt_logprobs=TOP)),
                         (prompt, SamplingParams(max_tokens=2, prompt_logprobs=0))])
    assert done[0].prompt_logprobs == [None]
    entries = done[1].prompt_logprobs
    assert all(e.top == [] for e in entries[1:])
    _check_against_hf(model_dir, prompt, [None] + [dataclasses.replace(e, top=[]) for e in entries[1:]], top=0)


def test_a_cached_prefix_is_scored_anyway_and_stays_cached_for_others(model_dirs):
    model_dir = str(model_dirs["tiny"])
    engine = LLMEngine(EngineConfig(model=model_dir, max_model_len=256, block_size=8))
    prompt = _prompts(engine.tokenizer, 1, seed=13, min_len=50, max_len=50)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    first = _run(engine, [(prompt, plain)])[0]
    scored = _run(engine, [(prompt, dataclasses.replace(plain, prompt_logprobs=TOP))])[0]
    again = _run(engine, [(prompt, plain)])[0]
    assert first.num_cached_tokens == 0
    assert scored.num_cached_tokens == 0          # it ran the whole prompt: every token is scored
    _check_against_hf(model_dir, prompt, scored.prompt_logprobs)
    assert again.num_cached_tokens == 48          # the blocks are still there for requests that read them
    assert scored.token_ids == first.token_ids == again.token_ids


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_prompt_logprobs_survive_preemption_once_each(model_dirs, prefix_caching):
    # 12 blocks of 8 tokens: the batch does not fit, so sequences are preempted and their prompts run again
    # (with the prefix cache, a recompute reads back the blocks of the tokens it scored already)
    model_dir = str(model_dirs["tiny"])
    engine = LLMEngine(EngineConfig(model=model_dir, max_model_len=96, block_size=8, num_kv_blocks=12,
                                    max_num_batched_tokens=16, enable_prefix_caching=prefix_caching))
    prompts = _prompts(engine.tokenizer, 8, seed=14, min_len=10, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=TOP)
    done = _run(engine, [(p, params) for p in prompts], per_step=8)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    for i, p in enumerate(prompts):
        _check_against_hf(model_dir, p, done[i].prompt_logprobs)


def test_delta_outputs_carry_them_once_cumulative_ones_every_time(model_dirs):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128))
    prompt = _prompts(engine.tokenizer, 1, seed=15, min_len=12, max_len=12)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    seen = {}
    for kind in (OutputKind.DELTA, OutputKind.CUMULATIVE):
        engine.add_request(kind.value, prompt, params, output_kind=kind)
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out.prompt_logprobs)
    delta, cumulative = seen["delta"], seen["cumulative"]
    assert len(delta) == len(cumulative) == 4
    assert delta[0] is not None and len(delta[0]) == 12 and delta[1:] == [None] * 3
    assert all(c == delta[0] for c in cumulative)


def test_prompt_logprobs_with_two_tensor_parallel_ranks_over_several_passes(model_dirs):
    """The scores are computed SCORE_ROWS_PER_PASS (256) rows of logits at a time, each
    pass gathering the vocabulary shards of both ranks: a 300-token prompt takes two."""
    model_dir = str(model_dirs["tiny"])
    engine = LLMEngine(EngineConfig(model=model_dir, max_model_len=400, tensor_parallel_size=2))
    try:
        prompt = _prompts(engine.tokenizer, 1, seed=16, min_len=300, max_len=300)[0]
        done = _run(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP))])
    finally:
        engine.shutdown()
    _check_against_hf(model_dir, prompt, done[0].prompt_logprobs)


def test_the_prefill_side_of_a_hand_off_scores_and_the_decode_side_does_not(model_dirs):
    model_dir = str(model_dirs["tiny"])
    config = EngineConfig(model=model_dir, max_model_len=128, block_size=8)
    prefill, decode = LLMEngine(config), LLMEngine(config)
    prompt = _prompts(prefill.tokenizer, 1, seed=17, min_len=20, max_len=20)[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=TOP)
    prefill.add_request("r", prompt, params, hold_kv=True, output_kind=OutputKind.DELTA)
    (first,) = [o for o in prefill.run_to_completion()]
    _check_against_hf(model_dir, prompt, first.prompt_logprobs)
    blocks = decode.reserve_prefilled("r", prompt, first.token_ids[0], params, output_kind=OutputKind.DELTA)
    held = prefill.held_sequence("r").block_table
    decode.write_kv_shards(blocks, prefill.read_kv_shards(list(held)))
    prefill.release_kv("r")
    outs = [decode.commit_prefilled("r")]
    while decode.has_unfinished_requests():
        outs += decode.step()
    assert all(o.prompt_logprobs is None for o in outs)
    assert sum(len(o.token_ids) for o in outs) == 5


def test_out_of_range_and_resumed_requests_are_refused(model_dirs):
    for bad in (-1, 21, 2.5, False):        # (True is vLLM's 1)
        with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128))
    with pytest.raises(InvalidRequestError, match="prompt_logprobs=None"):
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, prompt_logprobs=1),
                           resume=ResumedOutput([8], 1))
    assert not engine.has_unfinished_requests()
