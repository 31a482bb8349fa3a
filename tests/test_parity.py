"""Greedy output equals transformers' generate() token for token, under every
scheduling situation the engine has: staggered arrivals, chunked prefill,
preemption, prefix-cache hits, and the prefill/decode hand-off."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import PARITY_PRESETS


def _prompts(tokenizer, n: int, seed: int, min_len: int = 1, max_len: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    prompts = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        prompts.append([t for t in (rng.randrange(vocab) for _ in range(length * 2)) if t not in special][:length])
    return prompts


def _run_staggered(engine: LLMEngine, prompts, max_tokens: list[int], arrivals_per_step: int = 3,
                   steps: list | None = None):
    """Adds `arrivals_per_step` requests before each step, so requests join a batch
    that is already decoding. Returns {request_id: output token ids}; `steps` gets
    each step's StepStats."""
    pending = list(enumerate(prompts))
    done = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(arrivals_per_step):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens[i]))
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.token_ids
        if steps is not None and engine.last_step is not None and (not steps or steps[-1] is not engine.last_step):
            steps.append(engine.last_step)
    return done


def _assert_chunked(steps: list, budget: int) -> None:
    """Every step within the token budget, and prompts split: some step's prefill filled it."""
    assert max(s.num_prefill_tokens + s.num_decode_seqs for s in steps) <= budget
    assert any(s.num_prefill_tokens == budget for s in steps)
    assert any(s.num_prefill_tokens and s.num_decode_seqs for s in steps)     # chunks beside decodes


def _check(reference, preset, prompts, max_tokens, got):
    ref = reference(preset)
    for i, p in enumerate(prompts):
        expected = ref.greedy(tuple(p), max_tokens[i])
        assert got[i] == expected, f"prompt {i} (len {len(p)}): engine {got[i]} != transformers {expected}"


@pytest.mark.parametrize("preset", PARITY_PRESETS)
def test_greedy_matches_transformers_with_staggered_arrivals(preset, model_dirs, reference):
    engine = LLMEngine(EngineConfig(model=str(model_dirs[preset]), max_model_len=512))
    prompts = _prompts(engine.tokenizer, 12, seed=1)
    max_tokens = [random.Random(i).randint(1, 24) for i in range(len(prompts))]
    got = _run_staggered(engine, prompts, max_tokens)
    _check(reference, preset, prompts, max_tokens, got)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("preset", ["tiny", "tiny-mistral"])
def test_greedy_matches_transformers_on_the_gather_and_sdpa_backend(preset, model_dirs, reference):
    """The CPU default is the C++ decode kernel where it builds; the torch backend stays exact too."""
    engine = LLMEngine(EngineConfig(model=str(model_dirs[preset]), max_model_len=512, attention_backend="torch"))
    assert engine.worker.attention_backend == "torch"
    prompts = _prompts(engine.tokenizer, 12, seed=1)
    max_tokens = [random.Random(i).randint(1, 24) for i in range(len(prompts))]
    got = _run_staggered(engine, prompts, max_tokens)
    _check(reference, preset, prompts, max_tokens, got)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_greedy_matches_with_small_chunked_prefill(preset, model_dirs, reference):
    # 7-token budget: every prompt over 7 tokens is split across steps, mixed with decodes
    engine = LLMEngine(EngineConfig(model=str(model_dirs[preset]), max_model_len=512, max_num_batched_tokens=7))
    prompts = _prompts(engine.tokenizer, 8, seed=2, min_len=8, max_len=60)
    max_tokens = [12] * len(prompts)
    steps: list = []
    got = _run_staggered(engine, prompts, max_tokens, arrivals_per_step=2, steps=steps)
    _check(reference, preset, prompts, max_tokens, got)
    _assert_chunked(steps, 7)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mqa"])
def test_greedy_matches_under_preemption(preset, model_dirs, reference):
    # 12 blocks of 8 tokens hold one max-length sequence but nowhere near all of them
    engine = LLMEngine(EngineConfig(model=str(model_dirs[preset]), max_model_len=96, block_size=8,
                                    num_kv_blocks=12, enable_prefix_caching=False))
    prompts = _prompts(engine.tokenizer, 10, seed=3, min_len=10, max_len=40)
    max_tokens = [20] * len(prompts)
    got = _run_staggered(engine, prompts, max_tokens, arrivals_per_step=10)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    _check(reference, preset, prompts, max_tokens, got)
    assert engine.block_manager.num_free_blocks == 12


@pytest.mark.parametrize("preset", ["tiny-qwen3"])
def test_greedy_matches_with_two_tensor_parallel_ranks(preset, model_dirs, reference):
    # each rank runs its heads' share: Qwen3's per-head query/key norms are replicated, not split
    engine = LLMEngine(EngineConfig(model=str(model_dirs[preset]), max_model_len=256, tensor_parallel_size=2))
    try:
        prompts = _prompts(engine.tokenizer, 4, seed=8, min_len=5, max_len=60)
        max_tokens = [12] * len(prompts)
        got = _run_staggered(engine, prompts, max_tokens, arrivals_per_step=2)
    finally:
        engine.shutdown()
    _check(reference, preset, prompts, max_tokens, got)


def test_greedy_matches_with_prefix_cache_hits(model_dirs, reference):
    preset = "tiny"
    engine = LLMEngine(EngineConfig(model=str(model_dirs[preset]), max_model_len=512, block_size=8))
    shared = _prompts(engine.tokenizer, 1, seed=4, min_len=50, max_len=50)[0]
    tails = _prompts(engine.tokenizer, 6, seed=5, min_len=1, max_len=12)
    prompts = [shared + t for t in tails]
    max_tokens = [10] * len(prompts)
    first = _run_staggered(engine, prompts[:1], max_tokens[:1])
    # the rest arrive after the first finished: its full blocks (48 of 50 shared tokens) are cached
    ids = {}
    for i, p in enumerate(prompts[1:], start=1):
        ids[engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=10))] = i
    got = {0: first[0]}
    cached = {}
    for out in engine.run_to_completion():
        got[ids[out.request_id]] = out.token_ids
        cached[ids[out.request_id]] = out.num_cached_tokens
    assert all(c == 48 for c in cached.values()), cached
    _check(reference, preset, prompts, max_tokens, got)


def test_prefill_then_decode_handoff_matches(model_dirs, reference):
    """A prefill-only engine holds the KV; its blocks are copied into a second
    engine's reserved blocks; the second decodes without re-running the prompt."""
    preset = "tiny-qwen2"
    config = EngineConfig(model=str(model_dirs[preset]), max_model_len=256, block_size=8)
    prefill, decode = LLMEngine(config), LLMEngine(config)
    prompts = _prompts(prefill.tokenizer, 5, seed=6, min_len=3, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=15)
    for i, p in enumerate(prompts):
        prefill.add_request(str(i), p, params, hold_kv=True)
    firsts = {}
    while prefill.has_unfinished_requests():
        for out in prefill.step(decode=False):
            # the request holds its KV after one token; it has not ended (max_tokens 15)
            assert len(out.token_ids) == 1 and not out.finished and out.finish_reason is None
            firsts[out.request_id] = out.token_ids[0]
    for rid, first in firsts.items():
        src = prefill.held_sequence(rid).block_table
        dst = decode.reserve_prefilled(rid, prompts[int(rid)], first, params)
        assert dst is not None and len(dst) == len(src)
        decode.kv_cache.write_blocks(dst, prefill.kv_cache.read_blocks(src))
        assert prefill.release_kv(rid)
        decode.commit_prefilled(rid)
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    steps_tokens = []
    launch = decode.runner.launch
    decode.runner.launch = lambda step, *a, **k: (steps_tokens.extend(step.num_new_tokens), launch(step, *a, **k))[1]
    got = {int(o.request_id): o.token_ids for o in decode.run_to_completion()}
    assert steps_tokens and set(steps_tokens) == {1}, "the decode side must never re-run a prompt"
    _check(reference, preset, prompts, [15] * len(prompts), got)
