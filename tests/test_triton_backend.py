"""The engine on the Triton backend (paged kernels that read K/V in place, the
default on CUDA) matches transformers' greedy generate() token for token: fresh
prompts, decodes of ragged lengths in one batch, chunked prefill (a chunk after
a cached prefix), prefix-cache hits. Without a GPU the kernels run under
Triton's interpreter on CPU tensors, in float32."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("triton")

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tests.conftest import PARITY_PRESETS  # noqa: E402
from tests.test_parity import _assert_chunked, _check, _prompts, _run_staggered  # noqa: E402


def _engine(model_dir, **options) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(model_dir), attention_backend="triton", **options))
    assert engine.worker.attention_backend == "triton"
    return engine


@pytest.mark.parametrize("preset", PARITY_PRESETS)
def test_greedy_matches_transformers(preset, model_dirs, reference):
    engine = _engine(model_dirs[preset], max_model_len=512, block_size=8)
    prompts = _prompts(engine.tokenizer, 6, seed=11, max_len=70)
    max_tokens = [random.Random(i).randint(1, 12) for i in range(len(prompts))]
    got = _run_staggered(engine, prompts, max_tokens, arrivals_per_step=2)
    _check(reference, preset, prompts, max_tokens, got)


@pytest.mark.parametrize("block_size", [5, 16])
def test_greedy_matches_with_chunked_prefill(block_size, model_dirs, reference):
    # an 11-token budget splits every prompt: later chunks attend to a cached prefix
    engine = _engine(model_dirs["tiny-qwen2"], max_model_len=256, block_size=block_size,
                     max_num_batched_tokens=11)
    prompts = _prompts(engine.tokenizer, 4, seed=12, min_len=12, max_len=40)
    max_tokens = [8] * len(prompts)
    steps: list = []
    got = _run_staggered(engine, prompts, max_tokens, arrivals_per_step=2, steps=steps)
    _check(reference, "tiny-qwen2", prompts, max_tokens, got)
    _assert_chunked(steps, 11)


def test_greedy_matches_with_prefix_cache_hits(model_dirs, reference):
    engine = _engine(model_dirs["tiny-mqa"], max_model_len=256, block_size=8)
    shared = _prompts(engine.tokenizer, 1, seed=13, min_len=40, max_len=40)[0]
    prompts = [shared + t for t in _prompts(engine.tokenizer, 3, seed=14, min_len=2, max_len=9)]
    first = _run_staggered(engine, prompts[:1], [6])
    ids = {engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=6)): i
           for i, p in enumerate(prompts[1:], start=1)}
    got, cached = {0: first[0]}, {}
    for out in engine.run_to_completion():
        got[ids[out.request_id]] = out.token_ids
        cached[ids[out.request_id]] = out.num_cached_tokens
    assert all(c == 40 for c in cached.values()), cached
    _check(reference, "tiny-mqa", prompts, [6] * len(prompts), got)


def test_lone_fresh_prompt_takes_sdpa_only_from_the_threshold(model_dirs, reference, monkeypatch):
    import engine.model.attention_metadata as attention_metadata
    monkeypatch.setattr(attention_metadata, "SDPA_FRESH_PREFILL_MIN_TOKENS", 24)
    engine = _engine(model_dirs["tiny"], max_model_len=256, block_size=8)
    built = engine.runner._paged_batch
    lone_fresh: list[tuple[int, bool]] = []     # (prompt tokens, took SDPA) of each step with one fresh prompt

    def recording(tables, decode_lens, chunks):
        batch = built(tables, decode_lens, chunks)
        if not decode_lens and len(chunks) == 1 and not chunks[0].has_cached_prefix:
            lone_fresh.append((chunks[0].num_tokens, batch.single_fresh_prefill))
        return batch
    monkeypatch.setattr(engine.runner, "_paged_batch", recording)
    prompts = _prompts(engine.tokenizer, 2, seed=15, min_len=10, max_len=10) + \
        _prompts(engine.tokenizer, 1, seed=16, min_len=30, max_len=30)
    got = {i: _run_staggered(engine, [p], [5])[0] for i, p in enumerate(prompts)}
    assert sorted(lone_fresh) == [(10, False), (10, False), (30, True)]
    _check(reference, "tiny", prompts, [5] * len(prompts), got)


def test_unknown_attention_backend_is_rejected(model_dirs):
    with pytest.raises(ValueError, match="attention_backend must be auto, torch, triton or cpp"):
        EngineConfig(model=str(model_dirs["tiny"]), attention_backend="flash")
