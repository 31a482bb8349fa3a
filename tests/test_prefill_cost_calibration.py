"""A new engine times a few throwaway prompts before it serves
(engine/step_cost.py, calibrate_prefill_cost), so that it reports a per-token
prefill cost from the start: the router's conditional disaggregation and
admission control price prompts with it, and without it a burst of prompts on
a new deployment looked like no backlog at all."""

from __future__ import annotations

import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.step_cost import calibrate_prefill_cost

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [1, 17, 33, 49, 65, 81, 97, 113, 129, 145]


def _engine(model_dirs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), dtype="float32", device="cpu", max_model_len=128,
                                  cpu_threads=1))


def _greedy(engine: LLMEngine, request_id: str) -> list[int]:
    engine.add_request(request_id, PROMPT, GREEDY)
    return next(o for o in engine.run_to_completion() if o.request_id == request_id).token_ids


def test_calibration_times_a_prompt_and_leaves_the_engine_as_it_found_it(model_dirs):
    untouched = _greedy(_engine(model_dirs), "reference")
    engine = _engine(model_dirs)
    free_before = engine.block_manager.num_free_blocks

    started = time.perf_counter()
    cost = calibrate_prefill_cost(engine)
    elapsed = time.perf_counter() - started

    # seconds per token (not per step): at most a 16-token prompt's share of the time the calibration took
    assert cost is not None and 0 < cost * 16 <= elapsed
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == free_before
    assert engine.last_step is None                  # no step for the cost estimates to pick up
    assert _greedy(engine, "after") == untouched     # nothing it left behind changes what the engine computes


def test_the_cost_is_the_fastest_timed_pass_over_its_tokens(model_dirs, monkeypatch):
    """The first pass warms up and is not timed; of the others the fastest counts,
    divided by the prompt's tokens (127: max_model_len 128)."""
    import engine.step_cost as step_cost
    engine = _engine(model_dirs)
    clock = iter([0.0,  10.0, 10.254,  20.0, 20.381])   # the warm-up's start; then (start, end): 0.254, 0.381 s
    monkeypatch.setattr(step_cost.time, "perf_counter", lambda: next(clock))
    assert calibrate_prefill_cost(engine, passes=3) == pytest.approx(0.254 / 127)


def test_the_calibration_prompt_fits_the_step_budget_and_the_context(model_dirs):
    engine = _engine(model_dirs)
    timed: list[int] = []
    step = engine.step

    def spy(**kwargs):
        out = step(**kwargs)
        timed.append(engine.last_step.num_prefill_tokens)
        return out

    engine.step = spy
    assert calibrate_prefill_cost(engine, tokens=4096, passes=2) is not None
    assert timed == [127, 127]      # max_model_len 128 leaves 127 prompt tokens; one step per pass


def test_an_engine_with_work_is_not_calibrated(model_dirs):
    engine = _engine(model_dirs)
    engine.add_request("busy", PROMPT, GREEDY)
    assert calibrate_prefill_cost(engine) is None
    outputs = engine.run_to_completion()
    assert [o.request_id for o in outputs] == ["busy"]   # the request already there is all that ran


@pytest.mark.parametrize("passes", [0, 1])
def test_one_pass_is_only_a_warm_up_and_gives_no_figure(model_dirs, passes):
    assert calibrate_prefill_cost(_engine(model_dirs), passes=passes) is None
