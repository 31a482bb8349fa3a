"""`echo` and `prompt_logprobs` at the OpenAI API, over a backend whose
prompt logprobs are scripted (tests/test_prompt_logprobs.py checks the engine's
against transformers): where each piece goes in a response, a stream and a
chat, as OpenAI's legacy completions API and vLLM place them."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from engine.tiny_model import ensure_default_model
from engine.tokenizer import load_tokenizer
from router.metrics import ServingMetrics
from router.openai_api import build_openai_app
from router.responses import TokenTexts
from tests.test_openai_api import FakeBackend, sse_events

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "Once upon a time"


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


def _prompt_ids(tokenizer, prompt=PROMPT) -> list[int]:
    return tokenizer.encode(prompt) if isinstance(prompt, str) else prompt


def _texts(tokenizer, ids: list[int]) -> list[str]:
    return [TokenTexts(tokenizer)(t) for t in ids]


def test_echo_puts_the_prompt_before_the_completion_and_scores_nothing_unasked(client, backend):
    r = client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 4, "echo": True})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    reply = backend.tokenizer.decode(backend.reply_ids[:4])
    assert choice["text"] == PROMPT + reply
    assert choice["logprobs"] is None and "prompt_logprobs" not in choice
    assert backend.calls[-1][2].prompt_logprobs is None       # no logprobs asked: the prompt is not scored


def test_echo_with_logprobs_leads_with_the_prompts_tokens(client, backend, tokenizer):
    r = client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    prompt_ids = _prompt_ids(tokenizer)
    assert backend.calls[-1][2].prompt_logprobs == 1          # vLLM's rule: echo scores the prompt as logprobs asks
    lp = choice["logprobs"]
    ids = prompt_ids + backend.reply_ids[:3]
    assert lp["tokens"] == _texts(tokenizer, ids)
    # the first prompt token has nothing before it to be scored by; then the backend's -0.5 x position
    assert lp["token_logprobs"][:len(prompt_ids)] == [None] + [-0.5 * p for p in range(1, len(prompt_ids))]
    assert lp["token_logprobs"][len(prompt_ids):] == [-0.25, -0.5, -0.75]
    assert lp["top_logprobs"][0] is None
    assert len(lp["top_logprobs"][1]) == 1 + (prompt_ids[1] != 7)   # the best alternative, and the token itself
    offsets = [0]
    for text in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(text))
    assert lp["text_offset"] == offsets
    assert len(choice["prompt_logprobs"]) == len(prompt_ids)


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client, backend, tokenizer):
    r = client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    prompt_ids = _prompt_ids(tokenizer)
    assert choice["text"] == PROMPT
    assert choice["logprobs"]["tokens"] == _texts(tokenizer, prompt_ids)
    assert choice["logprobs"]["token_logprobs"] == [None] + [-0.5 * p for p in range(1, len(prompt_ids))]
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 0,
                             "total_tokens": len(prompt_ids)}
    assert backend.calls[-1][2].max_tokens == 1     # one token runs, to score the prompt; it is not returned


def test_echo_of_token_ids_is_their_text(client, backend, tokenizer):
    ids = tokenizer.encode("a quiet harbour", add_special_tokens=False)
    r = client.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 2, "echo": True, "n": 2})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    reply = tokenizer.decode(backend.reply_ids[:2])
    assert texts == [tokenizer.decode(ids) + reply] * 2


def test_echo_of_cut_token_ids_keeps_the_text_of_their_special_tokens(client, backend, tokenizer):
    # the text of every id kept, as uncut: the echoed logprobs' tokens then spell the echoed text
    ids = tokenizer.encode("a quiet harbour")          # [BOS, ...]
    assert ids[0] == tokenizer.bos_token_id
    for cut in (None, len(ids)):                       # [5, 6] cut off the front
        prompt = ids if cut is None else [5, 6] + ids
        body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "truncate_prompt_tokens": cut}
        r = client.post(COMPLETIONS, json={k: v for k, v in body.items() if v is not None})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == tokenizer.decode(ids) and choice["text"].startswith(tokenizer.bos_token), cut
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"], cut


def test_a_streamed_echo_opens_each_choice_with_the_prompt(client, backend, tokenizer):
    r = client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 5, "echo": True, "logprobs": 0,
                                       "stream": True, "n": 2})
    assert r.status_code == 200, r.text
    chunks = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
    prompt_ids = _prompt_ids(tokenizer)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["text"].startswith(PROMPT)
        assert "".join(c["text"] for c in mine) == PROMPT + tokenizer.decode(backend.reply_ids[:5])
        tokens = [t for c in mine for t in c["logprobs"]["tokens"]]
        assert tokens == _texts(tokenizer, prompt_ids + backend.reply_ids[:5])
        assert mine[0]["logprobs"]["token_logprobs"][0] is None
        offsets = [o for c in mine for o in c["logprobs"]["text_offset"]]
        assert offsets == sorted(offsets) and offsets[0] == 0     # one running offset over prompt and completion


def test_a_streamed_echo_alone_sends_the_prompt_and_no_completion(client, backend):
    r = client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": True})
    chunks = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == PROMPT


def test_prompt_logprobs_are_listed_per_token_as_vllm_lists_them(client, backend, tokenizer):
    r = client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    prompt_ids = _prompt_ids(tokenizer)
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt_ids)
    texts = TokenTexts(tokenizer)
    for p, entry in enumerate(scored[1:], start=1):
        token = prompt_ids[p]
        assert entry[str(token)] == {"logprob": -0.5 * p, "rank": p, "decoded_token": texts(token)}
        assert entry["7"]["rank"] == 1 or token == 7                 # the best alternative, rank 1
    assert choice["text"] == tokenizer.decode(backend.reply_ids[:2])    # no echo: the completion alone
    assert choice["logprobs"] is None


def test_n_choices_score_the_prompt_once_and_each_carries_the_scores(client, backend, tokenizer):
    for body in ({"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}):
        r = client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 2, "n": 3, **body})
        assert r.status_code == 200, r.text
        assert [call[2].prompt_logprobs for call in backend.calls[-3:]] == [1, None, None]   # the first scores
        choices = r.json()["choices"]
        if "prompt_logprobs" in body:
            assert choices[0]["prompt_logprobs"] is not None
            assert all(c["prompt_logprobs"] == choices[0]["prompt_logprobs"] for c in choices)
        else:                    # each echo leads with the prompt's tokens and their logprobs
            n = len(_prompt_ids(tokenizer))
            assert all(c["logprobs"]["token_logprobs"][:n] == choices[0]["logprobs"]["token_logprobs"][:n]
                       for c in choices)
            last = choices[2]["logprobs"]
            assert last["token_logprobs"][0] is None and len(last["tokens"]) == n + 2


def test_chat_prompt_logprobs_are_the_responses_and_echo_repeats_an_assistant_message(client, backend):
    messages = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Well,"}]
    r = client.post(CHAT, json={"messages": messages, "max_tokens": 2, "prompt_logprobs": 0, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = backend.calls[-1][1]
    assert len(body["prompt_logprobs"]) == len(prompt_ids) and body["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])   # 0 alternatives: the token alone
    assert body["choices"][0]["message"]["content"] == "Well," + backend.tokenizer.decode(backend.reply_ids[:2])
    # vLLM's rule: a chat echo with logprobs scores the prompt as the reply's tokens are
    r = client.post(CHAT, json={"messages": messages, "max_tokens": 2, "echo": True, "logprobs": True,
                                "top_logprobs": 2})
    assert backend.calls[-1][2].prompt_logprobs == 2 and len(r.json()["prompt_logprobs"]) == len(prompt_ids)
    client.post(CHAT, json={"messages": messages, "max_tokens": 2, "echo": True, "logprobs": True, "stream": True})
    assert backend.calls[-1][2].prompt_logprobs is None       # a stream would not carry them
    r = client.post(CHAT, json={"messages": messages[:1], "max_tokens": 2, "echo": True, "stream": True})
    chunks = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == backend.tokenizer.decode(backend.reply_ids[:2])    # the last message is the user's: no echo
    # without a generation prompt the reply continues the last message, whatever its role: it has that
    # role, and an echo repeats that message (vLLM's)
    r = client.post(CHAT, json={"messages": messages[:1], "max_tokens": 2, "echo": True,
                                "add_generation_prompt": False})
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "user", "content": "Tell me" + backend.tokenizer.decode(backend.reply_ids[:2])}
    r = client.post(CHAT, json={"messages": messages[:1], "max_tokens": 2, "stream": True,
                                "add_generation_prompt": False})
    opening = json.loads(sse_events(r)[0])
    assert opening["choices"][0]["delta"]["role"] == "user"



def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, backend, tokenizer):
    """vLLM's return_tokens_as_token_ids: every token string in logprobs is `token_id:ID`
    (the echoed prompt's too); the text itself is unchanged."""
    r = client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 2, "logprobs": 1, "echo": True,
                                       "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    ids = _prompt_ids(tokenizer) + backend.reply_ids[:2]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert "token_id:7" in choice["logprobs"]["top_logprobs"][1]     # a prompt token's best alternative
    assert choice["text"] == PROMPT + tokenizer.decode(backend.reply_ids[:2])
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in backend.reply_ids[:2]]
    assert content[0]["bytes"] == list(f"token_id:{backend.reply_ids[0]}".encode())


@pytest.mark.parametrize("stream", [False, True])
def test_an_echo_with_max_tokens_0_finishes_on_length_whatever_ended_the_scoring_token(client, backend, stream):
    # the one token run to score the prompt ends the reply ("stop"): it is not returned, so neither
    # is why it ended; OpenAI answers max_tokens 0 with "length"
    backend.reply_ids = backend.reply_ids[:1]
    r = client.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
        finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
        assert finishes == ["length"]
    else:
        (choice,) = r.json()["choices"]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (PROMPT, "length", None)


def test_echo_of_token_ids_keeps_spaces_before_punctuation(client, backend, tokenizer, monkeypatch):
    # decoded as the stream and token strings are, without the clean-up of tokenization spaces
    ids = tokenizer.encode("wait . it 's here", add_special_tokens=False)
    real_decode = type(tokenizer).decode

    def cleaning_decode(self, token_ids, *args, clean_up_tokenization_spaces=True, **kwargs):
        # a checkpoint whose tokenizer_config asks for the clean-up, as Llama 3's does
        text = real_decode(self, token_ids, *args, **kwargs)
        return text.replace(" .", ".").replace(" 's", "'s") if clean_up_tokenization_spaces else text

    monkeypatch.setattr(type(tokenizer), "decode", cleaning_decode)
    r = client.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 0, "echo": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "wait . it 's here"
