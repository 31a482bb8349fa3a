"""SamplingParams validation and normalisation."""

import math
import re

import pytest

from engine.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.logprobs is None
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.skip_special_tokens is True and p.min_tokens == 0
    assert not p.is_greedy


def test_list_defaults_are_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


def test_error_is_a_value_error_with_field_value_and_range():
    with pytest.raises(ValueError) as info:
        SamplingParams(top_p=1.5)
    assert isinstance(info.value, SamplingParamsError)
    assert str(info.value) == "top_p must be in (0, 1], got 1.5"


@pytest.mark.parametrize("field, value, range_text", [
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", -3, ">= 1"),
    ("temperature", -0.1, r"in \[0, 2\]"),
    ("temperature", 2.5, r"in \[0, 2\]"),          # vLLM's (0.32) and OpenAI's bound
    ("top_p", 0.0, r"in \(0, 1\]"),
    ("top_p", 1.0001, r"in \(0, 1\]"),
    ("top_k", -2, ">= 1"),
    ("min_p", -0.01, r"in \[0, 1\]"),
    ("min_p", 1.01, r"in \[0, 1\]"),
    ("repetition_penalty", 0.0, r"in \[0.0001, 10000\]"),
    ("repetition_penalty", -1.0, r"in \[0.0001, 10000\]"),
    ("repetition_penalty", 1e-46, r"in \[0.0001, 10000\]"),   # 0 in float32: NaN logits
    ("repetition_penalty", 20000.0, r"in \[0.0001, 10000\]"),   # 1e39 would be inf in float32
    ("presence_penalty", 2.01, r"in \[-2, 2\]"),
    ("presence_penalty", -2.01, r"in \[-2, 2\]"),
    ("frequency_penalty", 2.5, r"in \[-2, 2\]"),
    ("frequency_penalty", -3.0, r"in \[-2, 2\]"),
    ("seed", -2**63 - 1, r"in \[-2\*\*63, 2\*\*64\)"),
    ("seed", 2**64, r"in \[-2\*\*63, 2\*\*64\)"),
    ("logprobs", -1, r"in \[0, 20\]"),
    ("logprobs", 21, r"in \[0, 20\]"),
])
def test_out_of_range_names_field_value_and_range(field, value, range_text):
    with pytest.raises(SamplingParamsError, match=rf"^{field} must be .*{range_text}, got {value!r}$"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "5"),
    ("max_tokens", 5.0),
    ("max_tokens", True),
    ("top_k", 1.5),
    ("top_k", False),
    ("seed", "42"),
    ("seed", True),
    ("min_tokens", 1.0),
    ("logprobs", False),
    ("logprobs", "1"),
    ("spaces_between_special_tokens", 1),
    ("temperature", "1.0"),
    ("temperature", True),
    ("top_p", None),
    ("min_p", "0"),
    ("repetition_penalty", [1.0]),
    ("presence_penalty", False),
    ("frequency_penalty", "0.1"),
])
def test_wrong_type_names_field_and_type(field, value):
    with pytest.raises(SamplingParamsError, match=rf"^{field} must be .*\({type(value).__name__}\)$"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_rejected(field, value):
    with pytest.raises(SamplingParamsError, match=rf"^{field} must be a finite number"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["ignore_eos", "skip_special_tokens"])
@pytest.mark.parametrize("value", [0, 1, "true", None])
def test_bool_fields_require_bool(field, value):
    with pytest.raises(SamplingParamsError, match=rf"^{field} must be a bool"):
        SamplingParams(**{field: value})


def test_int_values_for_float_fields_become_float():
    p = SamplingParams(temperature=0, top_p=1, min_p=0, repetition_penalty=2,
                       presence_penalty=-2, frequency_penalty=2)
    assert type(p.temperature) is float and p.temperature == 0.0
    assert type(p.repetition_penalty) is float and p.repetition_penalty == 2.0
    assert (p.presence_penalty, p.frequency_penalty) == (-2.0, 2.0)


def test_boundaries_accepted():
    p = SamplingParams(max_tokens=1, top_p=1.0, top_k=1, min_p=1.0, repetition_penalty=1e-3,
                       presence_penalty=2.0, frequency_penalty=-2.0, seed=2**63 - 1,
                       min_tokens=1, logprobs=20)
    assert (p.top_k, p.seed, p.logprobs, p.min_tokens) == (1, 2**63 - 1, 20, 1)
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=-2**63).seed == -2**63
    assert SamplingParams(seed=-1).seed is None          # vLLM's "no seed": each run samples afresh
    assert SamplingParams(logprobs=0).logprobs == 0


def test_top_k_minus_one_normalised_to_zero():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=40).top_k == 40


def test_greedy_threshold():
    assert SamplingParams(temperature=0.0).is_greedy
    # a positive temperature under 0.01 is 0.01, as vLLM's (dividing by less overflows half precision)
    assert SamplingParams(temperature=9.9e-6).temperature == SamplingParams(temperature=0.005).temperature == 0.01
    assert not SamplingParams(temperature=9.9e-6).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


def test_min_tokens_bounded_by_max_tokens():
    assert SamplingParams(max_tokens=8, min_tokens=8).min_tokens == 8
    with pytest.raises(SamplingParamsError, match=r"^min_tokens must be in \[0, max_tokens=8\], got 9$"):
        SamplingParams(max_tokens=8, min_tokens=9)
    with pytest.raises(SamplingParamsError, match=r"^min_tokens must be .*, got -1$"):
        SamplingParams(min_tokens=-1)


def test_stop_normalisation():
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    given = ["x"]
    p = SamplingParams(stop=given)
    given.append("y")
    assert p.stop == ["x"]


@pytest.mark.parametrize("stop", ["", ["ok", ""], [1], 5, {"a"}])
def test_bad_stop_rejected(stop):
    with pytest.raises(SamplingParamsError, match="^stop must be"):
        SamplingParams(stop=stop)


def test_stop_token_ids_normalisation():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(2, 0)).stop_token_ids == [2, 0]


@pytest.mark.parametrize("ids", [[-1], [1, 2.0], [True], 7, "12"])
def test_bad_stop_token_ids_rejected(ids):
    with pytest.raises(SamplingParamsError, match="^stop_token_ids must be"):
        SamplingParams(stop_token_ids=ids)


def test_validate_against_vocab():
    SamplingParams(stop_token_ids=[0, 31999]).validate_against_vocab(32000)
    with pytest.raises(SamplingParamsError, match=r"^stop_token_ids contains 32000, must be in \[0, 32000\)$"):
        SamplingParams(stop_token_ids=[5, 32000]).validate_against_vocab(32000)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingParams().validate_against_vocab(0)


def test_logit_bias_takes_token_ids_as_ints_or_their_strings_and_checks_each_bias():
    assert SamplingParams(logit_bias={"50": -100, 7: 2.5}).logit_bias == {50: -100.0, 7: 2.5}
    assert SamplingParams(logit_bias=None).logit_bias == {} and SamplingParams().allowed_token_ids is None
    for bad, fragment in (({"50": 100.5}, "got 100.5 for token '50'"), ({"-3": 1}, "got key '-3'"),
                          ({"x": 1}, "got key 'x'"), ({True: 1}, "got key True"), ([1], "got [1]"),
                          ({"5": float("nan")}, "finite")):
        with pytest.raises(SamplingParamsError, match=rf"^logit_bias must be .*{re.escape(fragment)}"):
            SamplingParams(logit_bias=bad)
    # JSON numbers of any size: a 400, never a float overflow or int()'s digit limit
    with pytest.raises(SamplingParamsError, match=r"^logit_bias must be a finite number .*an int of 1329 bits"):
        SamplingParams(logit_bias={"5": 10 ** 400})
    for key in ("9" * 20, "1" * 5000):
        with pytest.raises(SamplingParamsError, match=r"^logit_bias token id '\d{20}'(\.\.\. \(\d+ characters\))? "
                                                      r"is past any vocabulary"):
            SamplingParams(logit_bias={key: 1})
    # 19 digits: an id, checked against the vocabulary later
    assert SamplingParams(logit_bias={"9" * 19: 1}).logit_bias == {int("9" * 19): 1.0}


def test_allowed_token_ids_must_name_some_tokens():
    assert SamplingParams(allowed_token_ids=(3, 4)).allowed_token_ids == [3, 4]
    for bad in ([], [-1], [True], "3"):
        with pytest.raises(SamplingParamsError, match="^allowed_token_ids must be"):
            SamplingParams(allowed_token_ids=bad)


def test_every_token_id_a_field_names_must_be_in_the_vocabulary():
    SamplingParams(stop_token_ids=[9], logit_bias={9: 1.0}, allowed_token_ids=[9]).validate_against_vocab(10)
    for field, value in (("stop_token_ids", [10]), ("logit_bias", {10: 1.0}), ("allowed_token_ids", [0, 10])):
        with pytest.raises(SamplingParamsError, match=rf"^{field} contains 10, must be in \[0, 10\)"):
            SamplingParams(**{field: value}).validate_against_vocab(10)


def test_vllms_convenience_values_are_taken():
    # logprobs=True is vLLM's 1 (the sampled token and one alternative); its decoding switches are taken at
    # the values this engine serves, and the one it does not (token ids without text) is refused
    params = SamplingParams(logprobs=True, prompt_logprobs=True, spaces_between_special_tokens=False, detokenize=True)
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)
    with pytest.raises(SamplingParamsError, match="detokenize=False .* is not supported"):
        SamplingParams(detokenize=False)
