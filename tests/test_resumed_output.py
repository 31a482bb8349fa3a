"""A request resumed after output it already streamed (request migration):
the engine continues it exactly as the undisturbed run, with seeded sampling,
penalties, stop strings that span the resume point and text held back."""

from __future__ import annotations

import pytest

from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from engine.outputs import ResumedOutput

PROMPT = [17, 250, 33, 480, 91, 7, 302, 118, 64, 5, 411]


@pytest.fixture(scope="module")
def engine(model_dirs):
    return LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=256, block_size=8))


def _stream(engine: LLMEngine, request_id: str, params: SamplingParams, resume: ResumedOutput | None = None):
    """Every output of one request, step by step."""
    engine.add_request(request_id, PROMPT, params, resume=resume)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


def _sent_after(outs, num_tokens: int) -> int:
    """Characters the client had once the output with `num_tokens` tokens was streamed."""
    return next(len(o.text) for o in outs if len(o.token_ids) == num_tokens)


@pytest.mark.parametrize("resume_at", [1, 6, 13])
def test_seeded_sampling_with_penalties_resumes_as_the_undisturbed_run(engine, resume_at):
    params = SamplingParams(temperature=0.9, top_k=40, seed=11, presence_penalty=0.7, frequency_penalty=0.4,
                            max_tokens=20, ignore_eos=True, logprobs=1)
    whole = _stream(engine, "whole", params)
    tokens, text = whole[-1].token_ids, whole[-1].text
    assert len(tokens) == 20
    sent = _sent_after(whole, resume_at)
    earlier = whole[-1].logprobs[:resume_at]
    rest = _stream(engine, f"rest{resume_at}", params, ResumedOutput(tokens[:resume_at], sent, earlier))
    assert [t for o in rest for t in o.delta_token_ids] == tokens[resume_at:]
    assert text[:sent] + "".join(o.delta_text for o in rest) == text
    assert (rest[-1].finished, rest[-1].finish_reason) == (True, "length")
    # the output's logprobs are one per token, the earlier ones included
    assert [lp.token_id for lp in rest[-1].logprobs] == rest[-1].token_ids == tokens
    # a resumed request prefills its earlier tokens in one pass: the same values up to float rounding
    assert [lp.logprob for lp in rest[-1].logprobs] == \
        pytest.approx([lp.logprob for lp in whole[-1].logprobs], abs=1e-3)


def test_a_stop_string_across_the_resume_point_is_found(engine):
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    whole = _stream(engine, "free", free)
    # a stop string of 4 characters, 2 before and 2 after the text of the first k tokens,
    # and nowhere earlier
    for k in range(2, 20):
        cut = len(engine.tokenizer.decode(whole[-1].token_ids[:k]))
        stop = whole[-1].text[cut - 2:cut + 2]
        if cut >= 2 and len(stop) == 4 and whole[-1].text.find(stop) == cut - 2:
            break
    else:
        pytest.skip("no 4-character window at a token boundary")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    stopped = _stream(engine, "stopped", params)
    assert (stopped[-1].finish_reason, stopped[-1].stop_reason) == ("stop", stop)
    # the undisturbed run held the stop string's first characters back: resume from what it had sent
    sent = _sent_after(stopped, k)
    assert sent < cut
    rest = _stream(engine, "rest", params, ResumedOutput(whole[-1].token_ids[:k], sent))
    assert stopped[-1].text[:sent] + "".join(o.delta_text for o in rest) == stopped[-1].text
    assert whole[-1].token_ids[:k] + [t for o in rest for t in o.delta_token_ids] == stopped[-1].token_ids
    assert (rest[-1].finish_reason, rest[-1].stop_reason) == ("stop", stop)


def test_max_tokens_counts_the_resumed_output(engine):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    whole = _stream(engine, "ten", params)
    rest = _stream(engine, "last4", params, ResumedOutput(whole[-1].token_ids[:6], len(whole[-1].text)))
    assert [t for o in rest for t in o.delta_token_ids] == whole[-1].token_ids[6:]
    with pytest.raises(InvalidRequestError, match="nothing is left to generate"):
        engine.add_request("done", PROMPT, params, resume=ResumedOutput(whole[-1].token_ids, 0))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("bad", PROMPT, params, resume=ResumedOutput([10**9], 0))
    assert not engine.has_unfinished_requests()


def test_a_resume_without_one_logprob_per_token_is_refused(engine):
    """Outputs' logprobs stay one per token: a resume that cannot keep that is refused."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    whole = _stream(engine, "with-logprobs", params)
    tokens, logprobs = whole[-1].token_ids[:4], whole[-1].logprobs[:4]
    for wrong in (None, logprobs[:3]):
        with pytest.raises(InvalidRequestError, match="one entry per resumed token"):
            engine.add_request("short", PROMPT, params, resume=ResumedOutput(tokens, 0, wrong))
    rest = _stream(engine, "right", params, ResumedOutput(tokens, 0, logprobs))
    assert rest[-1].token_ids == whole[-1].token_ids
    assert len(rest[-1].logprobs) == 10 and rest[-1].logprobs[:4] == logprobs
    assert not engine.has_unfinished_requests()
