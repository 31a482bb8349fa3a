"""The scheduler under random configurations and workloads: every request's
output equals the same request run alone, whatever ran beside it.

Each case draws a block size, a KV pool from one sequence's worth (preemption
at every turn) to plenty, a token budget (chunked prompts), a batch size limit,
prefix caching and async scheduling on or off; then up to 14 requests arriving
at random steps, with prompts sharing random prefixes (prefix-cache hits and
duplicates), greedy or seeded sampling, random lengths, and some aborted
mid-flight. A request run alone is the reference: its greedy output is pinned
to transformers' by tests/test_parity.py, and a seeded one is batch-invariant
by contract. At the end every KV block is free.
"""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams

MAX_LEN = 256
PRESETS = ("tiny", "tiny-mqa", "tiny-qwen2")


@pytest.fixture(scope="module")
def alone(model_dirs):
    """The output of one request run by itself on an engine of its own (memoised)."""
    engines: dict[str, LLMEngine] = {}
    outputs: dict[tuple, list[int]] = {}

    def run(preset: str, prompt: list[int], params: SamplingParams) -> list[int]:
        key = (preset, tuple(prompt), params.max_tokens, params.temperature, params.seed)
        if key not in outputs:
            if preset not in engines:
                engines[preset] = LLMEngine(EngineConfig(model=str(model_dirs[preset]), max_model_len=MAX_LEN,
                                                         enable_prefix_caching=False, async_scheduling=False))
            engines[preset].add_request("alone", list(prompt), params)
            outputs[key] = [out.token_ids for out in engines[preset].run_to_completion()][-1]
        return outputs[key]
    return run


def _case(seed: int, model_dirs):
    """(preset, engine, requests): each request (id, prompt, params, arrival step, abort?)."""
    rng = random.Random(seed)
    preset = rng.choice(PRESETS)
    block = rng.choice([1, 2, 4, 8, 16])
    one_sequence = -(-MAX_LEN // block) + 1
    config = EngineConfig(model=str(model_dirs[preset]), max_model_len=MAX_LEN, block_size=block,
                          num_kv_blocks=rng.choice([one_sequence, one_sequence + 3, 2 * one_sequence, None]),
                          max_num_seqs=rng.choice([1, 2, 3, 8, 64]),
                          max_num_batched_tokens=rng.choice([256, 300, 512, 2048]),
                          enable_prefix_caching=rng.random() < 0.7, async_scheduling=rng.choice([False, True]))
    engine = LLMEngine(config)
    special = set(engine.tokenizer.all_special_ids)
    shared = [rng.randrange(3, 200) for _ in range(rng.randint(0, 120))]
    requests = []
    for i in range(rng.randint(1, 14)):
        if requests and rng.random() < 0.15:
            prompt = list(rng.choice(requests)[1])                    # the same prompt again
        else:
            tail = [t for t in (rng.randrange(3, 200) for _ in range(rng.randint(1, 60))) if t not in special]
            prompt = (shared[:rng.randint(0, len(shared))] + (tail or [5]))[:MAX_LEN - 40]
        max_tokens = rng.randint(1, 40)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=rng.randrange(1000)) \
            if rng.random() < 0.25 else SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        requests.append((str(i), prompt, params, rng.randint(0, 12), rng.random() < 0.1))
    return preset, engine, requests


@pytest.mark.parametrize("seed", range(12))
def test_every_request_gets_what_it_gets_alone(seed, model_dirs, alone):
    preset, engine, requests = _case(seed, model_dirs)
    pending = sorted(requests, key=lambda r: r[3])
    finished, aborted, step = {}, set(), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            request_id, prompt, params, _, _ = pending.pop(0)
            engine.add_request(request_id, prompt, params)
        for request_id, _, _, arrival, abort in requests:
            if abort and step == arrival + 2 and request_id not in finished:
                engine.abort_request(request_id)
                aborted.add(request_id)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        step += 1
        assert step < 5000, "the engine stopped making progress"
    for request_id, prompt, params, _, _ in requests:
        if request_id not in aborted:
            assert finished[request_id] == alone(preset, prompt, params), \
                f"request {request_id} ({len(prompt)} prompt tokens, {params}) differs from its run alone"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
