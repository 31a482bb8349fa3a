"""Stop strings end a request where a new match completes: a match completed
before the output is past min_tokens never ends it later, whatever the other
stop strings. A stop token's text is in the output only with
include_stop_str_in_output, as vLLM does."""

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


def test_a_match_completes_a_stop_only_after_min_tokens():
    # as vLLM: stop strings count once the output holds more than min_tokens tokens
    tokenizer = load_tokenizer(ensure_default_model())
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    at = next(n for n in range(1, len(ids) + 1) if "mat" in tokenizer.decode(ids[:n]))
    text, reason, stop, count = run(tokenizer, ids, stop=["mat", "zzzzzzzz"], min_tokens=at, max_tokens=len(ids))
    assert (text, reason, stop, count) == (tokenizer.decode(ids), "length", None, len(ids))
    text, reason, stop, count = run(tokenizer, ids, stop=["mat", "zzzzzzzz"], min_tokens=at - 1,
                                    max_tokens=len(ids))
    assert (text, reason, stop, count) == ("the cat sat on the ", "stop", "mat", at)


@pytest.mark.parametrize("keep", [False, True])
def test_a_stop_token_id_shows_its_text_only_when_the_request_keeps_stops(keep):
    tokenizer = load_tokenizer(ensure_default_model())
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stop_id = ids[3]
    text, reason, stop, count = run(tokenizer, ids, stop_token_ids=[stop_id], include_stop_str_in_output=keep,
                                    max_tokens=len(ids))
    assert (reason, stop, count) == ("stop", stop_id, 4)
    assert text == tokenizer.decode(ids[:4] if keep else ids[:3])


def test_a_kept_stop_tokens_text_is_searched_for_stop_strings_too():
    # as vLLM: with include_stop_str_in_output the ending token's text joins the output, and a stop string
    # that ends in it (first) ends the request there, its reason the string
    tokenizer = load_tokenizer(ensure_default_model())
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stop_id = ids[3]
    token_text = tokenizer.decode(ids[:4])[len(tokenizer.decode(ids[:3])):]
    inner = token_text.strip()[:2]
    text, reason, stop, count = run(tokenizer, ids, stop_token_ids=[stop_id], stop=[inner],
                                    include_stop_str_in_output=True, max_tokens=len(ids))
    assert (reason, stop, count) == ("stop", inner, 4)
    assert text == tokenizer.decode(ids[:3]) + token_text[:token_text.index(inner) + len(inner)]
    # without it, the stop token's text is not output and the token is the reason
    text, reason, stop, _ = run(tokenizer, ids, stop_token_ids=[stop_id], stop=[inner], max_tokens=len(ids))
    assert (text, reason, stop) == (tokenizer.decode(ids[:3]), "stop", stop_id)


@pytest.mark.parametrize("keep", [False, True])
def test_of_two_stops_one_token_completes_the_one_that_ends_first_wins(keep):
    # as vLLM: the stop that completes first in the text, as appending a character at a time
    # would find it, not the one that starts first; the same however the text was tokenized
    tokenizer = load_tokenizer(ensure_default_model())
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    at = next(n for n in range(1, len(ids)) if len(tokenizer.decode(ids[:n + 1])) - len(tokenizer.decode(ids[:n])) >= 3)
    before, piece = tokenizer.decode(ids[:at]), tokenizer.decode(ids[:at + 1])[len(tokenizer.decode(ids[:at])):]
    inner = piece[1]              # ends inside the token, one character after the whole piece starts
    text, reason, stop, count = run(tokenizer, ids, stop=[piece, inner], include_stop_str_in_output=keep,
                                    max_tokens=len(ids))
    assert (reason, stop, count) == ("stop", inner, at + 1)
    assert text == before + piece[:2 if keep else 1]
