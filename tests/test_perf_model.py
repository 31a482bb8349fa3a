"""The performance model: the fit recovers a known engine, the profiler covers
every kind of step, the roofline and the online correction behave as stated."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from cluster.perf_model import (
    LinearStepModel,
    OnlineCorrection,
    RooflineStepModel,
    StepShape,
    load_step_model,
)
from cluster.perf_model.step_shape import chunk_attention

TRUE = (2e-3, 3e-5, 4e-9, 1e-4, 2e-7)


def _synthetic(shape: StepShape) -> float:
    return sum(c * f for c, f in zip(TRUE, shape.features()))


def _random_shapes(rng: random.Random, n: int) -> list[StepShape]:
    shapes = []
    for _ in range(n):
        chunks = [(rng.choice([0, rng.randint(1, 500)]), rng.randint(1, 300)) for _ in range(rng.randint(0, 2))]
        decodes = [rng.randint(1, 2000) for _ in range(rng.randint(0, 32))]
        shape = StepShape.build(chunks, decodes)
        if not shape.is_empty:
            shapes.append(shape)
    return shapes


def test_chunk_attention_counts_causal_pairs():
    # 3 tokens after 2 cached: they see 3, 4 and 5 keys
    assert chunk_attention(2, 3) == 3 + 4 + 5
    assert StepShape.build([(0, 4)], [10, 20]) == StepShape(4, 1 + 2 + 3 + 4, 2, 30)


def test_fit_recovers_a_synthetic_engine():
    shapes = _random_shapes(random.Random(0), 200)
    model = LinearStepModel.fit(shapes, [_synthetic(s) for s in shapes])
    assert model.coefficients == pytest.approx(TRUE, rel=1e-6)
    assert model.error.max_abs_rel < 1e-9 and model.error.num_points == len(shapes)
    assert model.eager_floor_s == 0.0      # no floor to find


def test_fit_finds_the_floor_of_steps_with_prompt_tokens():
    # a GPU engine whose eager steps (any prompt tokens) take at least 25 ms, decode-only steps less
    floor = 25e-3
    shapes = _random_shapes(random.Random(3), 300)
    # and long prompts, past the floor: the prompt tokens' cost is fitted on them (a profile's long end)
    shapes += [StepShape.build([(0, n)], []) for n in (1500, 2000, 2500, 3000)]

    def measured(s):
        t = _synthetic(s)
        return max(t, floor) if s.prefill_tokens else t
    times = [measured(s) for s in shapes]
    assert sum(s.prefill_tokens > 0 and _synthetic(s) < floor for s in shapes) > 50   # the floor binds often
    model = LinearStepModel.fit(shapes, times)
    assert model.eager_floor_s == pytest.approx(floor, rel=0.02)
    assert model.coefficients[1] == pytest.approx(TRUE[1], rel=0.05)       # the prompt tokens' cost
    assert model.error.mean_abs_rel < 0.01
    short = StepShape.build([(0, 8)], [100])
    assert model.step_time(short) == pytest.approx(floor, rel=0.02)            # floored
    decodes = StepShape.build([], [100] * 4)
    assert model.step_time(decodes) == pytest.approx(_synthetic(decodes), rel=0.02)   # decode-only: not
    unfloored = LinearStepModel(model.coefficients)
    assert unfloored.step_time(short) < 0.5 * floor
    # a CPU profile is fitted without one (before: on a busy machine noise could pass for a floor)
    assert LinearStepModel.fit(shapes, times, eager_floor=False).eager_floor_s == 0.0
    loaded = load_step_model(model.to_json())
    assert loaded.eager_floor_s == model.eager_floor_s and loaded.step_time(short) == model.step_time(short)
    with pytest.raises(ValueError, match="eager_floor_s"):
        load_step_model({**model.to_json(), "eager_floor_s": -1.0})


def test_fit_with_noise_stays_close_and_reports_its_error():
    rng = random.Random(1)
    shapes = _random_shapes(rng, 400)
    times = [_synthetic(s) * rng.uniform(0.9, 1.1) for s in shapes]
    model = LinearStepModel.fit(shapes, times)
    assert 0.01 < model.error.mean_abs_rel < 0.06
    probe = StepShape.build([(100, 200)], [500] * 16)
    assert model.step_time(probe) == pytest.approx(_synthetic(probe), rel=0.05)


def test_fit_keeps_coefficients_non_negative_and_skips_unexercised_terms():
    # decode-only points: the prefill terms are not exercised and must come out 0
    shapes = [StepShape.build([], [c] * b) for b in (1, 4, 16) for c in (10, 100, 1000)]
    model = LinearStepModel.fit(shapes, [_synthetic(s) for s in shapes])
    assert model.coefficients[1] == 0 and model.coefficients[2] == 0
    assert all(c >= 0 for c in model.coefficients)
    assert model.step_time(StepShape()) == 0.0
    # times that fall with the decode context: the unconstrained fit's context term is negative
    # (-1e-8), and is held at 0 while the others stay
    times = [2e-3 + 1e-4 * s.decode_seqs - 1e-8 * s.decode_context for s in shapes]
    clamped = LinearStepModel.fit(shapes, times)
    assert clamped.coefficients[4] == 0 and all(c >= 0 for c in clamped.coefficients)
    assert clamped.coefficients[0] > 0 and clamped.coefficients[3] > 0


def test_the_non_negative_fit_is_the_optimum_not_a_greedy_one():
    # dropping the most negative coefficient one at a time can drop one the optimum keeps: on these 12
    # points it stopped at a relative error of 1.738 where the non-negative optimum (scipy's nnls) is 1.543
    from cluster.perf_model.linear_model import _nnls_relative
    rng = np.random.default_rng(0)
    for _ in range(1932):        # the 1,932nd draw of this generator is such a case
        x = np.abs(rng.normal(size=(12, 5))) * rng.choice([0, 1], size=(12, 5), p=[0.3, 0.7])
        x[:, 0] = 1
        truth = np.abs(rng.normal(size=5)) * rng.choice([0, 1], size=5)
        y = (x @ truth + np.abs(rng.normal(size=12)) * 0.5 + 0.1) * np.exp(rng.normal(size=12) * 0.5)
    c = _nnls_relative(x, y)
    assert np.linalg.norm((x @ c - y) / y) == pytest.approx(1.5433, abs=1e-4)
    assert (c >= 0).all() and c[1] == 0 and c[4] > 0
    # and no non-negative point nearby does better (the optimum's first-order conditions)
    gradient = (x / y[:, None]).T @ ((x @ c - y) / y)
    assert np.allclose(gradient[c > 0], 0, atol=1e-9) and (gradient[c == 0] >= -1e-9).all()


def test_profile_json_round_trips(tmp_path):
    shapes = _random_shapes(random.Random(2), 50)
    model = LinearStepModel.fit(shapes, [_synthetic(s) for s in shapes], {"model": "x"})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(model.to_json()))
    loaded = load_step_model(path)
    assert loaded.coefficients == model.coefficients and loaded.meta == {"model": "x"}
    with pytest.raises(ValueError, match="unknown step model kind"):
        load_step_model({"kind": "magic"})


def test_profiler_grid_covers_prefill_decode_and_mixed_steps(model_dirs):
    from cluster.perf_model.profiler import ProfileGrid, profile_engine
    from engine import EngineConfig, LLMEngine
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=512, max_num_seqs=8))
    grid = ProfileGrid(prompt_lens=(8, 40), batch_sizes=(1, 3), contexts=(20,), chunk_len=16, decode_steps=2)
    rec = profile_engine(engine, grid)
    by_kind = {k: [s for s, kk in zip(rec.shapes, rec.kinds) if kk == k] for k in ("prefill", "decode", "mixed")}
    assert any(s.prefill_tokens == 40 and s.decode_seqs == 0 for s in by_kind["prefill"])
    # a chunk after a cached prefix: more attention pairs than a fresh prompt of its length
    assert any(s.prefill_attention > chunk_attention(0, s.prefill_tokens) for s in by_kind["prefill"])
    assert {s.decode_seqs for s in by_kind["decode"]} >= {1, 3}
    assert all(s.prefill_tokens == 0 for s in by_kind["decode"])
    assert {(s.decode_seqs, s.prefill_tokens) for s in by_kind["mixed"]} == {(1, 16), (3, 16)}
    assert all(t > 0 for t in rec.seconds) and not engine.has_unfinished_requests()


def test_profiler_warm_up_pass_drives_the_grid_once_unrecorded(model_dirs):
    from cluster.perf_model.profiler import ProfileGrid, profile_engine
    from engine import EngineConfig, LLMEngine
    grid = ProfileGrid(prompt_lens=(8, 40), batch_sizes=(1, 3), contexts=(20,), chunk_len=16, decode_steps=2)
    recorded = {}
    for warm in (False, True):
        engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=512, max_num_seqs=8))
        steps = 0
        original = engine.step

        def counting_step():
            nonlocal steps
            steps += 1
            return original()
        engine.step = counting_step
        rec = profile_engine(engine, grid, warm_up_grid=warm)
        recorded[warm] = (steps, sorted(zip(rec.kinds, ((s.prefill_tokens, s.decode_seqs) for s in rec.shapes))))
    (cold_steps, cold_shapes), (warm_steps, warm_shapes) = recorded[False], recorded[True]
    assert warm_shapes == cold_shapes           # the recorded pass is the same grid
    assert warm_steps - cold_steps == len(cold_shapes)   # plus one unrecorded pass of it


def test_roofline_decode_at_batch_one_is_the_weights_over_bandwidth():
    from engine.model.model_config import ModelConfig
    config = ModelConfig.from_pretrained("configs/models/llama-3-8b")
    model = RooflineStepModel.for_model(config, gpu="H100-SXM", tp=1)
    e = model.eff
    floor = model.cost.weight_bytes / (3.35e12 * e.mbu)
    t = model.step_time(StepShape.build([], [512]))
    assert t == pytest.approx(e.host_fixed_s + e.host_per_seq_s + floor, rel=0.01)
    # the bytes from the config, not from the model's own count: bf16 q/k/v/o and the 3 MLP matrices
    # of 32 layers, and the lm_head
    per_layer = 4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336
    assert model.cost.weight_bytes == 2 * (32 * per_layer + 128256 * 4096) == 15_009_316_864
    # long prefill is compute-bound: doubling the tokens roughly doubles the time
    t1, t2 = (model.step_time(StepShape.build([(0, n)])) for n in (4096, 8192))
    assert 1.9 < t2 / t1 < 2.3
    # a short prompt's step runs eagerly: bound by the host's launches, layers * eager_per_layer_s
    short = StepShape.build([(0, 16)])
    assert model.step_time(short) == pytest.approx(e.host_fixed_s + 32 * e.eager_per_layer_s, rel=1e-6)
    unfloored = model.with_efficiencies(eager_per_layer_s=0.0)
    assert unfloored.step_time(short) < 0.5 * model.step_time(short)
    assert unfloored.step_time(StepShape.build([], [512])) == t     # decode-only steps replay graphs: no floor
    # TP 2 halves the bytes per rank and adds two all-reduces per layer
    tp2 = RooflineStepModel.for_model(config, gpu="H100-SXM", tp=2)
    assert tp2.cost.weight_bytes < 0.55 * model.cost.weight_bytes
    no_comm = tp2.with_efficiencies(allreduce_latency_s=0.0)
    shape = StepShape.build([], [512])
    comm = tp2.step_time(shape) - no_comm.step_time(shape)
    assert comm == pytest.approx(2 * config.num_layers * e.allreduce_latency_s, rel=1e-6)
    assert no_comm.step_time(shape) < t
    assert load_step_model(tp2.to_json()).step_time(StepShape.build([(0, 100)])) == tp2.step_time(
        StepShape.build([(0, 100)]))
    with pytest.raises(ValueError, match="unknown GPU"):
        RooflineStepModel.for_model(config, gpu="TPU")


def test_roofline_prices_float32_matmuls_at_the_fp32_rate():
    # bf16's tensor-core rate priced float32 too: a 2,048-token prefill of Llama-3-8B took 54 ms either way
    from engine.model.model_config import ModelConfig
    config = ModelConfig.from_pretrained("configs/models/llama-3-8b")
    prefill = StepShape.build([(0, 2048)])         # compute-bound in both
    bf16, fp32 = (RooflineStepModel.for_model(config, gpu="H100-SXM", tp=1, dtype=d) for d in ("bfloat16", "float32"))
    host = bf16.eff.host_fixed_s
    assert (fp32.step_time(prefill) - host) / (bf16.step_time(prefill) - host) == pytest.approx(989 / 67, rel=0.01)
    # a profile written before the spec had the FP32 rate takes the named GPU's
    old = fp32.to_json()
    del old["gpu"]["fp32_flops"]
    assert load_step_model(old).step_time(prefill) == fp32.step_time(prefill)
    old["gpu"]["name"] = "some-gpu"
    with pytest.raises(ValueError, match="no FP32 rate to price float32 with"):
        load_step_model(old)


def test_a_profile_written_before_the_spec_grew_takes_the_named_gpus_figures():
    # an A100 profile without the network rate took the dataclass default (the H100's): a TP-16 step 25% fast
    from engine.model.model_config import ModelConfig
    model = RooflineStepModel.for_model(ModelConfig.from_pretrained("configs/models/llama-3-70b"), gpu="A100-80GB",
                                        tp=16)
    old = model.to_json()
    for key in ("fp32_flops", "gpus_per_node", "network_bytes_per_s"):
        del old["gpu"][key]
    batch = StepShape.build([], [1024] * 64)
    assert load_step_model(old).step_time(batch) == model.step_time(batch)


def test_online_correction_follows_a_slower_worker():
    base = LinearStepModel(TRUE)
    online = OnlineCorrection(base, weight=0.2)
    shapes = _random_shapes(random.Random(3), 60)
    for s in shapes:
        online.observe(s, 1.5 * base.step_time(s))
    assert online.factor == pytest.approx(1.5, rel=1e-6)
    probe = StepShape.build([], [100] * 8)
    assert online.step_time(probe) == pytest.approx(1.5 * base.step_time(probe))
    online.observe(StepShape(), 1.0)          # nothing predicted: ignored
    assert online.num_observed == len(shapes)
    # the first ratio sets the factor, each next one moves it by the weight: 2 -> 1.5 -> ... -> 1.16
    varying = OnlineCorrection(base, weight=0.2)
    for ratio in (2.0, 1.0, 1.0, 1.0, 1.0, 1.0):
        varying.observe(probe, ratio * base.step_time(probe))
    assert varying.factor == pytest.approx(1.16, rel=1e-9)
    # one step 50x its prediction (a stall) moves it as a 4x one would, not by itself
    stalled = OnlineCorrection(base, weight=0.05)
    for _ in range(20):
        stalled.observe(probe, base.step_time(probe))
    stalled.observe(probe, 50 * base.step_time(probe))
    assert stalled.factor == pytest.approx(1 + 0.05 * 3, rel=1e-9)          # (was 1 + 0.05 * 49 = 3.45)
    for _ in range(200):                                                     # and it still follows a real change
        stalled.observe(probe, 6 * base.step_time(probe))
    assert stalled.factor == pytest.approx(6, rel=0.01)


def test_online_correction_adds_a_fixed_serving_cost_per_step():
    base = LinearStepModel(TRUE)
    online = OnlineCorrection(base, overhead_s=0.004)
    probe = StepShape.build([], [100] * 8)
    assert online.step_time(probe) == pytest.approx(base.step_time(probe) + 0.004)
    assert online.step_time(StepShape()) == 0.0          # no step, no overhead
    # the overhead is added after the factor, not scaled by it
    slower = OnlineCorrection(base, factor=2.0, overhead_s=0.004)
    assert slower.step_time(probe) == pytest.approx(2 * base.step_time(probe) + 0.004)


def test_a_floor_above_every_prompt_step_is_not_taken_for_one():
    """A grid whose prompt steps all run at the host's floor (a GPU engine, prompts of
    up to 1k tokens): a floor above them all leaves only decode-only steps for the
    linear part, which then prices prompt tokens at 0 and every prompt, however
    long, at the floor. The fit keeps a prompt slope instead."""
    floor, rng = 30e-3, random.Random(5)
    shapes = [StepShape.build([(0, n)], []) for n in (16, 64, 128, 256, 512) for _ in range(4)]
    shapes += [StepShape.build([], [rng.randint(32, 2000) for _ in range(b)]) for b in (1, 4, 16, 64) for _ in range(10)]

    def measured(s):
        t = _synthetic(s)
        return max(t, floor) * rng.uniform(0.97, 1.03) if s.prefill_tokens else t
    model = LinearStepModel.fit(shapes, [measured(s) for s in shapes])
    assert all(_synthetic(s) < floor for s in shapes if s.prefill_tokens)       # every prompt step floored
    long_prompt = StepShape.build([(0, 8192)], [])
    assert model.coefficients[1] > 0                                             # prompt tokens cost something
    assert model.step_time(long_prompt) > 2 * floor, model                       # (was: the floor, 30 ms)


def test_the_profiler_says_which_grid_points_it_cannot_run(model_dirs, caplog):
    from cluster.perf_model.profiler import ProfileGrid, profile_engine
    from engine import EngineConfig, LLMEngine
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, max_num_seqs=8))
    grid = ProfileGrid(prompt_lens=(8, 40, 4096), batch_sizes=(1,), contexts=(20, 2000), chunk_len=16,
                       decode_steps=2)
    with caplog.at_level("WARNING", logger="cluster.perf_model.profiler"):
        rec = profile_engine(engine, grid)
    (said,) = [r.getMessage() for r in caplog.records]
    assert "prompt lengths [4096] (past 127 tokens" in said and "contexts [2000]" in said
    assert rec.shapes and not engine.has_unfinished_requests()                      # the rest was measured
