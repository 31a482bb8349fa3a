"""vLLM's `truncate_prompt_tokens` and `truncation_side` at the OpenAI API: the
prompt the workers run is the tokenized prompt cut to that many tokens, from
the left (the last tokens stay) unless asked otherwise."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from engine.tiny_model import ensure_default_model
from engine.tokenizer import load_tokenizer
from router.metrics import ServingMetrics
from router.openai_api import build_openai_app
from tests.test_openai_api import MAX_MODEL_LEN, FakeBackend

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
LONG = list(range(10, 10 + 3 * MAX_MODEL_LEN))     # token ids: three times the context


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_default_model())


@pytest.fixture
def backend(tokenizer):
    return FakeBackend(tokenizer, len(tokenizer))


@pytest.fixture
def client(backend, tokenizer):
    with TestClient(build_openai_app(backend, tokenizer, ServingMetrics()), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("side, expected", [(None, LONG[-20:]), ("left", LONG[-20:]), ("right", LONG[:20])])
def test_a_prompt_is_cut_to_the_tokens_asked_for_from_its_side(client, backend, side, expected):
    body = {"prompt": LONG, "max_tokens": 2, "truncate_prompt_tokens": 20,
            **({"truncation_side": side} if side else {})}
    r = client.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    assert backend.calls[-1][1] == expected
    assert r.json()["usage"]["prompt_tokens"] == 20


def test_minus_one_keeps_what_fits_beside_the_output_and_a_short_prompt_is_left_alone(client, backend):
    r = client.post(COMPLETIONS, json={"prompt": LONG, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    assert backend.calls[-1][1] == LONG[-(MAX_MODEL_LEN - 1):]
    r = client.post(COMPLETIONS, json={"prompt": LONG, "max_tokens": 10, "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    assert backend.calls[-1][1] == LONG[-(MAX_MODEL_LEN - 10):]
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": "go " * 200}], "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text           # no max_tokens: the prompt leaves one token, the reply has it
    assert len(backend.calls[-1][1]) == MAX_MODEL_LEN - 1
    r = client.post(COMPLETIONS, json={"prompt": LONG, "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text           # no max_tokens: room for a completion's default 16
    assert len(backend.calls[-1][1]) == MAX_MODEL_LEN - 16 and backend.calls[-1][2].max_tokens == 16
    r = client.post(COMPLETIONS, json={"prompt": LONG[:5], "max_tokens": 2, "truncate_prompt_tokens": 20})
    assert r.status_code == 200 and backend.calls[-1][1] == LONG[:5]


def test_text_far_longer_than_the_context_is_taken_when_it_is_to_be_cut(client, backend, tokenizer):
    text = "word " * (50 * MAX_MODEL_LEN)          # refused outright without truncation: far past the context
    assert client.post(COMPLETIONS, json={"prompt": text, "max_tokens": 2}).status_code == 400
    r = client.post(COMPLETIONS, json={"prompt": text, "max_tokens": 2, "truncate_prompt_tokens": 16,
                                       "echo": True})
    assert r.status_code == 200, r.text
    kept = [tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False)[-15:]
    assert backend.calls[-1][1] == kept           # the BOS the tokenizer adds stays in front of what is kept
    assert r.json()["choices"][0]["text"].startswith(tokenizer.decode(kept, skip_special_tokens=True))  # what ran
    r = client.post(COMPLETIONS, json={"prompt": "Hello there", "max_tokens": 2, "truncate_prompt_tokens": 16,
                                       "echo": True})
    assert r.json()["choices"][0]["text"].startswith("Hello there")     # nothing cut: the prompt's own text


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_text_prompt_keeps_its_bos_whichever_side_is_cut(client, backend, tokenizer, side):
    text = " ".join(f"w{i}" for i in range(200))
    own = tokenizer.encode(text, add_special_tokens=False)
    r = client.post(COMPLETIONS, json={"prompt": text, "max_tokens": 2, "truncate_prompt_tokens": 10,
                                       "truncation_side": side})
    assert r.status_code == 200, r.text
    assert backend.calls[-1][1] == [tokenizer.bos_token_id] + (own[:9] if side == "right" else own[-9:])
    r = client.post(COMPLETIONS, json={"prompt": text, "max_tokens": 2, "truncate_prompt_tokens": 10,
                                       "truncation_side": side, "add_special_tokens": False})
    assert backend.calls[-1][1] == (own[:10] if side == "right" else own[-10:])     # no BOS asked for
    r = client.post(COMPLETIONS, json={"prompt": [tokenizer.bos_token_id] + own, "max_tokens": 2,
                                       "truncate_prompt_tokens": 10})
    assert backend.calls[-1][1] == own[-10:]      # token ids are the client's own: cut as sent


def test_a_chat_is_cut_after_its_template(client, backend, tokenizer):
    messages = [{"role": "user", "content": "tell me " * 40}]
    r = client.post(CHAT, json={"messages": messages, "max_tokens": 2, "truncate_prompt_tokens": 12})
    assert r.status_code == 200, r.text
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    assert backend.calls[-1][1] == list(rendered)[-12:]


@pytest.mark.parametrize("body, fragment", [
    ({"truncate_prompt_tokens": 0}, "at least 1"),
    ({"truncate_prompt_tokens": -2}, "at least 1"),
    ({"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, f"this model's context is {MAX_MODEL_LEN}"),
    ({"truncate_prompt_tokens": MAX_MODEL_LEN}, "send at most"),
    ({"truncate_prompt_tokens": 8, "truncation_side": "middle"}, "'left' or 'right'"),
])
def test_bad_truncation_settings_get_400s_naming_the_field(client, backend, body, fragment):
    r = client.post(COMPLETIONS, json={"prompt": LONG[:10], "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] in ("truncate_prompt_tokens", "truncation_side")
    assert backend.calls == []
