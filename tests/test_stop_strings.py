"""Stop strings end a request where a new match completes: a match completed
before min_tokens never ends it later, whatever the other stop strings."""

from __future__ import annotations

import pytest

from engine.output_processor import RequestTextState
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tiny_model import ensure_default_model
from engine.tokenizer import load_tokenizer

TEXT = "the cat sat on the mat and the dog"


def run(tokenizer, token_ids: list[int], **params):
    """(text, finish_reason, stop_reason, output tokens) after feeding `token_ids` as sampled."""
    seq = Sequence("r", [5, 6, 7], 3, SamplingParams(**params), eos_token_ids=(1,))
    state = RequestTextState(seq, tokenizer, 1024)
    for token_id in token_ids:
        state.append(token_id, None)
        if seq.finish_reason is not None:
            break
    out = state.make_output(seq.finish_reason is not None)
    return out.text, out.finish_reason, out.stop_reason, len(out.token_ids)


@pytest.mark.parametrize("other_stops", [[], ["zzzzzzzz"], ["zzzzzzzz", "qqqqqqqqqqqqqqqq"]])
def test_a_match_completed_before_min_tokens_is_not_a_stop(other_stops):
    tokenizer = load_tokenizer(ensure_default_model())
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    before_min = next(n for n in range(1, len(ids)) if "cat" in tokenizer.decode(ids[:n]))
    text, reason, stop, count = run(tokenizer, ids, stop=["cat", *other_stops], min_tokens=before_min + 1,
                                    max_tokens=len(ids))
    assert (text, reason, stop, count) == (tokenizer.decode(ids), "length", None, len(ids))


def test_a_match_completed_at_min_tokens_or_later_stops():
    tokenizer = load_tokenizer(ensure_default_model())
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    text, reason, stop, _ = run(tokenizer, ids, stop=["mat", "zzzzzzzz"], min_tokens=2, max_tokens=len(ids))
    assert (text, reason, stop) == ("the cat sat on the ", "stop", "mat")
