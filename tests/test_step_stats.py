"""The shape an engine step reports (LLMEngine.last_step) is the one the
performance model is fitted on (cluster/perf_model/profiler.py's shape_of):
the workers' served steps correct a profile with it, and the autoscaler fits
its online model to it."""

from __future__ import annotations

from cluster.perf_model.step_shape import chunk_attention
from engine import EngineConfig, LLMEngine, SamplingParams


def test_prompt_chunks_and_decodes_report_their_shape_before_the_step(model_dirs):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=256, max_num_seqs=4,
                                    max_num_batched_tokens=32, async_scheduling=False, enable_prefix_caching=False))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        engine.add_request("a", list(range(1, 21)), params)            # 20 tokens: one chunk
        engine.step()
        s = engine.last_step
        assert (s.num_prefill_tokens, s.num_decode_seqs) == (20, 0)
        assert s.prefill_attention == chunk_attention(0, 20)           # 210 pairs, not 20 x (20 + 10.5)
        engine.add_request("b", list(range(1, 41)), params)            # 40 tokens: 31 now beside a's decode
        engine.step()
        s = engine.last_step
        assert (s.num_prefill_tokens, s.num_decode_seqs) == (31, 1)
        assert s.prefill_attention == chunk_attention(0, 31)
        assert s.decode_context == 21                                   # a: 20 prompt + 1 new token
        engine.step()                                                   # b's last 9 after its first 31
        s = engine.last_step
        assert s.num_prefill_tokens == 9 and s.prefill_attention == chunk_attention(31, 9)
        assert s.decode_context == 22
    finally:
        engine.shutdown()
