"""What the GPU's KV sizing keeps free for a step: the decode graph pool (the largest
graph's peak and every smaller graph's logits) plus the larger of the largest prefill's
and the sampler's peaks, the sampler measured on
rows that take every path that allocates. The CUDA memory counters are replaced
by fakes so the bookkeeping runs here on the real model and sampler."""

from __future__ import annotations

import torch

from engine import LLM
from engine import sampler as sampler_module
from engine.sampler import Sampler, heaviest_rows


def test_the_heaviest_rows_take_every_path_that_allocates(monkeypatch):
    called = []
    for name in ("apply_banned_tokens", "apply_penalties", "apply_temperature", "apply_top_k", "apply_top_p",
                 "apply_min_p", "_gather_logprobs"):
        real = getattr(sampler_module, name)
        monkeypatch.setattr(sampler_module, name,
                            lambda *a, _real=real, _name=name, **k: (called.append(_name), _real(*a, **k))[1])
    vocab = 300
    rows = heaviest_rows(6, vocab, torch.device("cpu"))
    result = Sampler()(torch.randn(6, vocab), rows)
    assert sorted(set(called)) == sorted(["apply_banned_tokens", "apply_penalties", "apply_temperature",
                                          "apply_top_k", "apply_top_p", "apply_min_p", "_gather_logprobs"])
    assert rows[0].params.top_k == vocab                      # a top-k over the whole vocabulary sorts it all
    assert [row.generator is None for row in rows] == [True, False] * 3
    assert all(0 <= t < vocab and t != 2 for t in result.token_ids)          # token 2 is banned
    assert all(len(lp.top) == 20 for lp in result.logprobs)


def test_the_reserve_is_the_graph_pool_plus_the_larger_of_prefill_and_sampling(model_dirs, monkeypatch):
    llm = LLM(str(model_dirs["tiny"]), max_model_len=128, max_num_seqs=12, dtype="float32")
    worker = llm.engine.worker
    spec = worker.kv_cache.spec
    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 400)      # held before it (weights, KV)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 1000)

    sampled = []
    real_call = Sampler.__call__
    monkeypatch.setattr(Sampler, "__call__", lambda self, logits, rows: (sampled.append((logits.shape, len(rows))),
                                                                          real_call(self, logits, rows))[1])
    assert worker._sampling_peak(12) == 600          # the peak above what was held before
    assert sampled == [((12, worker.model_config.vocab_size), 12)]    # real logits of max_num_seqs rows

    worker.graph_sizes = [1, 2, 4]
    peaks = {"prefill": 300, "decode": 50}
    monkeypatch.setattr(worker, "_forward_peak",
                        lambda inputs, layers, baseline: peaks["prefill" if inputs.meta.prefills else "decode"])
    # the graphs of 1 and 2 keep their float32 logits beside the largest's peak
    kept_logits = 4 * worker.model_config.vocab_size * (1 + 2)
    for sampling, expected in ((200, 350), (700, 750)):
        monkeypatch.setattr(worker, "_sampling_peak", lambda rows, _p=sampling: _p)
        assert worker._activation_reserve(spec) == expected + kept_logits


def test_the_kv_cache_on_a_gpu_leaves_the_staging_budget_free(model_dirs, monkeypatch):
    from engine import model_worker

    llm = LLM(str(model_dirs["tiny"]), max_model_len=128, dtype="float32")
    worker = llm.engine.worker
    spec = worker.kv_cache.spec
    worker.device = torch.device("cuda")
    worker.config.num_kv_blocks = None
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(model_worker, "gpu_kv_budget_bytes", lambda device, utilization: 10 * 2**30)
    monkeypatch.setattr(worker, "_activation_reserve", lambda spec: 2**30)
    worker.config.kv_transfer_staging_gib = 0.0
    without = worker._num_kv_blocks(spec)
    worker.config.kv_transfer_staging_gib = 2.0
    assert without == 9 * 2**30 // spec.bytes_per_block
    assert worker._num_kv_blocks(spec) == 7 * 2**30 // spec.bytes_per_block


def test_the_free_memory_is_read_after_the_profiling_passes(model_dirs, monkeypatch):
    """The profile's passes set up what a step needs outside torch's allocator (NCCL's buffers for
    each algorithm a step's all-reduces take, cuBLAS's workspaces): read before them, the budget
    counted that memory as free for the KV cache."""
    from engine import model_worker

    llm = LLM(str(model_dirs["tiny"]), max_model_len=128, dtype="float32")
    worker = llm.engine.worker
    spec = worker.kv_cache.spec
    worker.device = torch.device("cuda")
    worker.config.num_kv_blocks = None
    worker.config.kv_transfer_staging_gib = 0.0
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    free = [10 * 2**30]

    def profile(spec):
        free[0] -= 2**30          # set up by the passes, outside the allocator: not in their peak
        return 2**30
    monkeypatch.setattr(worker, "_activation_reserve", profile)
    monkeypatch.setattr(model_worker, "gpu_kv_budget_bytes", lambda device, utilization: free[0])
    assert worker._num_kv_blocks(spec) == 8 * 2**30 // spec.bytes_per_block     # before: 9 GiB of KV


def test_the_prefill_peak_is_profiled_over_a_steps_whole_budget(model_dirs, monkeypatch):
    # max_model_len 128 and a budget of 2,048 tokens: chunked prefill fills a step from 16 prompts,
    # whose activations the reserve measured for one prompt of 128 tokens
    llm = LLM(str(model_dirs["tiny"]), max_model_len=128, max_num_batched_tokens=2048, dtype="float32")
    worker = llm.engine.worker
    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(worker, "_sampling_peak", lambda rows: 0)
    profiled = []
    monkeypatch.setattr(worker, "_forward_peak",
                        lambda inputs, layers, baseline: profiled.append(inputs.input_ids.shape[0]
                                                                         if inputs is not None else 0) or 0)
    worker._activation_reserve(worker.kv_cache.spec)
    assert profiled[0] == 2048
    # the dummy step runs on the model: its positions stay within the rotary tables
    inputs = worker._profile_inputs(2048, prefill=True)
    assert int(inputs.positions.max()) == 127
    scratch = type(worker.kv_cache)(worker.kv_cache.spec, 2048 // worker.kv_cache.spec.block_size, worker.device)
    with torch.inference_mode():
        hidden = worker.model(inputs.input_ids, inputs.positions, scratch.layer_views(), inputs.meta)
    assert hidden.shape[0] == 2048 and torch.isfinite(hidden).all()
