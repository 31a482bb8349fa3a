"""What a request's outputs carry (engine.outputs.OutputKind): DELTA outputs
hold only what is new, and joined they are the CUMULATIVE run's last output;
FINAL_ONLY gives that one output alone. Checked on long outputs, where text is
kept in chunks, with stop strings, held-back text and logprobs."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.output_processor import RequestTextState
from engine.outputs import OutputKind, joined
from engine.sampler import TokenLogprobs
from engine.sequence import Sequence
from engine.tiny_model import ensure_default_model
from engine.tokenizer import load_tokenizer

LONG_TEXT = " ".join(f"word{i} and more" for i in range(400))   # ~2,000 tokens


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_default_model())


def _feed(tokenizer, kind: OutputKind, token_ids: list[int], **params):
    """Every output of a request sampling `token_ids` in turn (with logprobs), as the engine makes them."""
    seq = Sequence("r", [5, 6, 7], 3, SamplingParams(**params), eos_token_ids=(1,))
    state = RequestTextState(seq, tokenizer, 100_000, kind)
    outputs = []
    for i, token_id in enumerate(token_ids):
        state.append(token_id, TokenLogprobs(token_id, -0.5 - i, 1, [(token_id, -0.5 - i)]))
        finished = seq.finish_reason is not None
        out = state.make_output(finished)
        if out is not None:
            outputs.append(out)
        if finished:
            break
    return outputs


@pytest.mark.parametrize("stop", [[], ["word399 and"], ["zzzz", "and more word390"]])
def test_deltas_joined_and_the_final_output_are_the_cumulative_run(tokenizer, stop):
    ids = tokenizer.encode(LONG_TEXT, add_special_tokens=False)
    params = dict(stop=stop, max_tokens=len(ids), logprobs=1)
    cumulative = _feed(tokenizer, OutputKind.CUMULATIVE, ids, **params)
    deltas = _feed(tokenizer, OutputKind.DELTA, ids, **params)
    final = _feed(tokenizer, OutputKind.FINAL_ONLY, ids, **params)
    whole = cumulative[-1]
    assert whole.finish_reason == ("stop" if stop else "length")
    if stop:     # cut before the stop string, found far past the first chunk of text
        assert whole.text == LONG_TEXT[:LONG_TEXT.index(stop[-1])] and len(whole.token_ids) > 1000
    else:
        assert whole.text == LONG_TEXT and whole.token_ids == ids
    assert len(deltas) == len(cumulative) and len(final) == 1
    for out in deltas:      # only what is new, and the count of everything so far
        assert (out.text, out.token_ids) == (out.delta_text, out.delta_token_ids)
        assert len(out.logprobs) == len(out.token_ids)
    assert [out.num_output_tokens for out in deltas] == [len(out.token_ids) for out in cumulative]
    for got in (joined(deltas), final[0]):
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason, got.num_output_tokens) == \
            (whole.text, whole.token_ids, whole.finish_reason, whole.stop_reason, len(whole.token_ids))
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in whole.logprobs]


def test_text_held_back_for_a_stop_string_is_in_no_delta_until_it_cannot_be_one(tokenizer):
    ids = tokenizer.encode(LONG_TEXT[:400], add_special_tokens=False)
    deltas = _feed(tokenizer, OutputKind.DELTA, ids, stop=["x" * 12], max_tokens=len(ids))
    sent = ""
    for out in deltas[:-1]:
        sent += out.text
        whole_so_far = tokenizer.decode(ids[:out.num_output_tokens])
        assert whole_so_far.startswith(sent) and len(whole_so_far) - len(sent) <= 11
    assert sent + deltas[-1].text == tokenizer.decode(ids)


def test_the_engine_gives_each_kind_what_it_asks_for(model_dirs):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=256, block_size=8))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    for kind in OutputKind:
        engine.add_request(kind.value, [17, 250, 33, 480, 91], params, output_kind=kind)
    per_step: list[set[str]] = []
    outputs: dict[str, list] = {kind.value: [] for kind in OutputKind}
    while engine.has_unfinished_requests():
        step = engine.step()
        per_step.append({out.request_id for out in step})
        for out in step:
            outputs[out.request_id].append(out)
    cumulative, deltas, final = (outputs[k.value] for k in OutputKind)
    assert len(final) == 1 and final[0].finished and sum("final_only" in ids for ids in per_step) == 1
    assert len(cumulative) == len(deltas) == 40
    assert all(len(out.token_ids) == 1 for out in deltas)
    for got in (joined(deltas), final[0]):
        assert (got.text, got.token_ids) == (cumulative[-1].text, cumulative[-1].token_ids)
        assert [lp.top for lp in got.logprobs] == [lp.top for lp in cumulative[-1].logprobs]


def test_a_held_prefill_gives_its_final_only_output_when_it_holds(model_dirs):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=256, block_size=8))
    engine.add_request("p", [17, 250, 33], SamplingParams(temperature=0.0, max_tokens=8), hold_kv=True,
                       output_kind=OutputKind.FINAL_ONLY)
    outs = engine.run_to_completion()
    assert [(o.request_id, o.finished, o.num_output_tokens) for o in outs] == [("p", False, 1)]
    assert engine.release_kv("p")
