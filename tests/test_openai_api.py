"""The OpenAI HTTP layer (router/openai_api.py) over a scripted fake backend.

The tiny model's real tokenizer and chat template are used, so prompts are
tokenized for real; the fake backend replays REPLY token by token and records
what it was asked and whether its stream was closed early (the abort path).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import math
from types import SimpleNamespace

import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.tiny_model import ensure_default_model
from engine.tokenizer import load_tokenizer
from router.backend import BackendUnavailableError, GenerationBackend, ModelInfo
from router.metrics import ServingMetrics
from router.openai_api import build_openai_app
from router.timings import PhaseTimings

MODEL = "tiny-test"
MAX_MODEL_LEN = 64
REPLY = "Hello world, this is pdserve!"
PHASES = PhaseTimings(queue_time=0.002, prefill_time=0.03, transfer_time=0.004,
                      transfer_bytes=3 * 2**20)
ERROR_KEYS = {"message", "type", "param", "code"}


class FakeBackend(GenerationBackend):
    """Replays REPLY one token per output (up to max_tokens) with scripted failures."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
        self.calls: list[tuple[str, list[int], SamplingParams]] = []
        self.closed_early: list[str] = []    # streams closed before their last output
        self.fail_after: int | None = None   # raise `failure` after this many outputs
        self.failure: Exception = BackendUnavailableError("decode worker died")
        self.hang_after: int | None = None   # block forever after this many outputs
        self.hanging = asyncio.Event()
        self.healthy = True

    def model_info(self) -> ModelInfo:
        return ModelInfo(MODEL, MAX_MODEL_LEN, self.vocab_size)

    async def check_health(self) -> None:
        if not self.healthy:
            raise BackendUnavailableError("no decode replica is alive")

    def phase_timings(self, request_id: str) -> PhaseTimings | None:
        return PHASES

    async def generate(self, request_id, prompt_token_ids, params):
        self.calls.append((request_id, list(prompt_token_ids), params))
        ids = self.reply_ids[:params.max_tokens]
        done = False
        try:
            for i in range(len(ids)):
                if i == self.fail_after:
                    raise self.failure
                if i == self.hang_after:
                    self.hanging.set()
                    await asyncio.Event().wait()
                finished = i == len(ids) - 1
                text = self.tokenizer.decode(ids[:i + 1])
                previous = self.tokenizer.decode(ids[:i])
                logprobs = prompt_logprobs = None
                if params.prompt_logprobs is not None and i == 0:
                    prompt_logprobs = [None] + [
                        TokenLogprobs(t, -0.5 * p, p, [(7, -0.125), (t, -0.5 * p)][:params.prompt_logprobs])
                        for p, t in enumerate(prompt_token_ids[1:], start=1)]
                if params.logprobs is not None:
                    logprobs = [TokenLogprobs(ids[i], -0.25 * (i + 1), 1,
                                              [(ids[i], -0.25 * (i + 1)), (7, -3.0)][:params.logprobs])]
                done = finished
                delta = text[len(previous):]
                yield RequestOutput(     # a delta, as the backend contract says
                    request_id, list(prompt_token_ids), delta, [ids[i]],
                    delta_text=delta, delta_token_ids=[ids[i]], logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs, finished=finished,
                    finish_reason=("length" if len(ids) < len(self.reply_ids) else "stop")
                    if finished else None, num_output_tokens=i + 1)
        finally:
            if not done:
                self.closed_early.append(request_id)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_default_model())


@pytest.fixture
def backend(tokenizer):
    return FakeBackend(tokenizer, len(tokenizer))


@pytest.fixture
def metrics():
    return ServingMetrics()


@pytest.fixture
def app(backend, tokenizer, metrics):
    return build_openai_app(backend, tokenizer, metrics)


@pytest.fixture
def client(app):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def sse_events(response) -> list[str]:
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("\n\n")
    events = response.text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def metric_samples(client) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    # Bucket bounds are compared as numbers: the text format writes 4 MiB as "4.194304e+06".
    return {(s.name, tuple(sorted((k, float(v) if k == "le" else v) for k, v in s.labels.items()))):
            s.value for family in text_string_to_metric_families(response.text) for s in family.samples}


def assert_openai_error(response, status: int, param: str | None, fragment: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert error["param"] == param, error
    assert fragment in error["message"], error
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")   # OpenAI's
    return error


# --- completions -------------------------------------------------------------

def test_completion_maps_the_request_and_returns_the_full_text(client, backend, tokenizer):
    prompt = "def fibonacci(n):"
    response = client.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0.5, "top_p": 0.9,
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "seed": 3, "stop": "###", "stop_token_ids": [1, 2],
        "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False, "user": "u1",
        "spaces_between_special_tokens": False, "some_future_field": {"ignored": True}})
    assert response.status_code == 200, response.text
    body = response.json()
    prompt_ids = tokenizer.encode(prompt)
    assert prompt_ids[0] == tokenizer.bos_token_id  # add_special_tokens defaults to True
    request_id, seen_ids, params = backend.calls[0]
    assert seen_ids == prompt_ids
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (40, 0.5, 0.9, 5)
    assert (params.min_p, params.repetition_penalty, params.seed) == (0.1, 1.2, 3)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.stop == ["###"] and params.stop_token_ids == [1, 2]
    assert params.ignore_eos and params.min_tokens == 2 and not params.skip_special_tokens
    assert params.logprobs is None
    assert body["id"] == request_id and request_id.startswith("cmpl-")
    assert body["object"] == "text_completion" and body["model"] == MODEL
    [choice] = body["choices"]
    assert choice["text"] == REPLY and choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None and choice["index"] == 0
    n_reply = len(backend.reply_ids)
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": n_reply,
                             "total_tokens": len(prompt_ids) + n_reply}
    assert backend.closed_early == []


def test_a_temperature_past_2_is_refused_as_vllm_and_openai_refuse_it(client, backend):
    assert_openai_error(client.post(COMPLETIONS, json={"prompt": "Hi", "temperature": 3, "max_tokens": 1}), 400,
                        "temperature", "temperature must be in [0, 2], got 3")
    assert client.post(COMPLETIONS, json={"prompt": "Hi", "temperature": 2, "max_tokens": 1}).status_code == 200
    assert backend.calls[0][2].temperature == 2.0


def test_a_whole_number_written_as_a_float_is_taken_for_an_integer_field(client, backend):
    # some clients write every number with a fraction (16.0); vLLM takes those, and so does this
    sent = client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 3.0, "top_k": 5.0, "n": 1.0})
    assert sent.status_code == 200, sent.text
    params = backend.calls[0][2]
    assert (params.max_tokens, params.top_k) == (3, 5) and type(params.max_tokens) is int
    assert_openai_error(client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2.5}), 400, "max_tokens",
                        "valid integer")
    assert_openai_error(client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": "3"}), 400, "max_tokens",
                        "valid integer")


def test_max_tokens_defaults_to_16_for_completions_and_the_rest_of_the_context_for_chat(client, backend):
    response = client.post("/v1/completions", json={"prompt": [[5, 6, 7]]})  # model optional
    assert response.status_code == 200, response.text
    _, seen_ids, params = backend.calls[0]
    assert seen_ids == [5, 6, 7]
    assert params.max_tokens == 16                              # as OpenAI's and vLLM's
    assert params.temperature == SamplingParams().temperature  # unset: the engine's default
    assert client.post("/v1/completions", json={"prompt": [5] * (MAX_MODEL_LEN - 4)}).status_code == 200
    assert backend.calls[1][2].max_tokens == 4                  # less than 16 left: what is left
    assert client.post("/v1/completions", json={"prompt": [5], "min_tokens": 20}).status_code == 200
    assert backend.calls[2][2].max_tokens == 20                 # at least min_tokens
    assert client.post("/v1/chat/completions", json={"messages": USER}).status_code == 200
    _, chat_ids, params = backend.calls[3]
    assert params.max_tokens == MAX_MODEL_LEN - len(chat_ids)


def test_completion_logprobs_in_openai_format(client, backend, tokenizer):
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3,
                                                "logprobs": 2}).json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length" and backend.calls[0][2].logprobs == 2
    tokens = [tokenizer.decode([t]) for t in backend.reply_ids[:3]]
    assert choice["text"] == "".join(tokens) == "Hello"
    lp = choice["logprobs"]
    assert lp["tokens"] == tokens
    assert lp["token_logprobs"] == [-0.25, -0.5, -0.75]
    assert lp["text_offset"] == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    assert lp["top_logprobs"][1] == {tokens[1]: -0.5, tokenizer.decode([7]): -3.0}


def test_streamed_logprob_tokens_of_a_split_character_spell_each_choices_text(client, backend, tokenizer):
    # one token a chunk, two choices interleaved: each choice's place carries the character's first bytes
    # from chunk to chunk (before: the strings of its three byte tokens were U+FFFD each)
    backend.reply_ids = tokenizer.encode("a 中 b", add_special_tokens=False)
    assert len(backend.reply_ids) > len("a 中 b".split()) + 2          # 中 is split across byte tokens
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 16, "stream": True,
                                                    "logprobs": 0, "n": 2})
    chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    for index in (0, 1):
        logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["index"] == index]
        tokens = [t for lp in logprobs if lp for t in lp["tokens"]]
        offsets = [o for lp in logprobs if lp for o in lp["text_offset"]]
        assert "".join(tokens) == "a 中 b"
        assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


def test_completion_stream_chunks_add_up_and_end_with_usage_then_done(client, backend):
    response = client.post("/v1/completions", json={
        "prompt": [5, 6], "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in content) == "Hello world"
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (len(content) - 1) + ["length"]
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in content)
    assert len({c["id"] for c in chunks}) == 1
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(client):
    # vLLM's stream_options.continuous_usage_stats (it was ignored: usage null on every chunk)
    events = sse_events(client.post(CHAT, json={
        "messages": USER, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    chunks = [json.loads(e) for e in events[:-1]]
    completions = [c["usage"]["completion_tokens"] for c in chunks]
    assert completions[0] == 0 and completions[-1] == 3             # the role chunk, the final usage
    assert completions == sorted(completions) and chunks[-1]["choices"] == []
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)


def test_the_models_generation_config_sets_what_a_request_leaves_unset(tokenizer, tmp_path):
    # an instruct model's recommended sampling (vLLM's --generation-config auto); a request's
    # own value wins, and a setting the engine would refuse is left out
    import json

    from engine.model.model_config import generation_sampling_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 2.0, "do_sample": True, "presence_penalty": 1.5,
         "frequency_penalty": 0.25, "max_new_tokens": 7}))
    defaults = generation_sampling_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "presence_penalty": 1.5,
                        "frequency_penalty": 0.25, "max_tokens": 7}

    class Recommending(FakeBackend):
        def model_info(self):
            return ModelInfo(MODEL, MAX_MODEL_LEN, self.vocab_size, sampling_defaults=defaults)
    backend = Recommending(tokenizer, len(tokenizer))
    with TestClient(build_openai_app(backend, tokenizer, ServingMetrics())) as client:
        assert client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        assert client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2, "temperature": 0,
                                              "top_k": 5}).status_code == 200
        # max_new_tokens: a chat's max_tokens when it gives none (completions keep OpenAI's 16)
        assert client.post(CHAT, json={"messages": USER}).status_code == 200
        assert client.post(CHAT, json={"messages": USER, "max_tokens": 9}).status_code == 200
        assert client.post(COMPLETIONS, json={"prompt": "Hi"}).status_code == 200
    (_, _, first), (_, _, second), *rest = backend.calls
    assert [params.max_tokens for _, _, params in rest] == [7, 9, 16]
    assert (first.temperature, first.top_p, first.top_k, first.min_p) == (0.6, 0.9, 20, 0.0)
    assert (first.presence_penalty, first.frequency_penalty) == (1.5, 0.25)
    assert (second.temperature, second.top_p, second.top_k) == (0.0, 0.9, 5)


def test_stream_without_include_usage_has_no_usage_key(client):
    events = sse_events(client.post("/v1/completions",
                                    json={"prompt": "Hi", "max_tokens": 2, "stream": True}))
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)
    # the server's build, on every chunk and body, as OpenAI's and vLLM's carry theirs
    version = client.get("/version").json()["version"]
    assert {c["system_fingerprint"] for c in chunks} == {f"pdserve-{version}"}
    body = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).json()
    assert body["system_fingerprint"] == f"pdserve-{version}"


# --- chat ----------------------------------------------------------------------

def test_chat_applies_the_template_and_returns_a_message(client, backend, tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                             {"type": "text", "text": "there"}]}]
    response = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_completion_tokens": 30, "max_tokens": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    request_id, seen_ids, params = backend.calls[0]
    assert tokenizer.decode(seen_ids) == (
        "<|begin_of_text|><|system|>\nBe brief.<|end_of_text|>\n"
        "<|user|>\nHi\nthere<|end_of_text|>\n<|assistant|>\n")
    assert seen_ids.count(tokenizer.bos_token_id) == 1  # the template's BOS only
    assert params.max_tokens == 30  # max_completion_tokens wins over max_tokens
    assert body["id"] == request_id and request_id.startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": REPLY}
    assert choice["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == len(seen_ids)


def test_a_developer_message_is_a_system_message(client, backend, tokenizer):
    for role in ("developer", "system"):
        response = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": role, "content": "Be brief."}] + USER, "max_tokens": 2})
        assert response.status_code == 200, response.text
    (_, developer_ids, _), (_, system_ids, _) = backend.calls
    assert developer_ids == system_ids
    assert "<|system|>\nBe brief." in tokenizer.decode(developer_ids)


def test_chat_stream_opens_with_the_role_and_carries_logprobs(client, tokenizer, backend):
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
        "logprobs": True, "top_logprobs": 1})
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:]]
    assert "".join(deltas) == "Hello wor"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    entries = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    first = tokenizer.decode([backend.reply_ids[0]])
    assert [e["logprob"] for e in entries] == [-0.25, -0.5, -0.75, -1.0]
    assert entries[0] == {"token": first, "logprob": -0.25, "bytes": list(first.encode()),
                          "top_logprobs": [{"token": first, "logprob": -0.25,
                                            "bytes": list(first.encode())}]}
    assert backend.calls[0][2].logprobs == 1


# --- the official client ------------------------------------------------------------

def test_official_openai_client(client):
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client,
                        max_retries=0)
    assert [m.id for m in oai.models.list().data] == [MODEL]

    completion = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert completion.choices[0].text == "Hello" and completion.usage.completion_tokens == 3

    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content == REPLY
    assert chat.choices[0].finish_reason == "stop"

    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=5, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world"
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []

    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="Hi", n=0)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="gpt-4", prompt="Hi")
    assert info.value.body["code"] == "model_not_found"


# --- models, health, metrics ------------------------------------------------------

def test_models_lists_the_served_model(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL, "model", MAX_MODEL_LEN)
    assert (card["root"], card["parent"], card["permission"]) == (MODEL, None, [])     # vLLM's card
    assert client.get(f"/v1/models/{MODEL}").json() == card
    assert_openai_error(client.get("/v1/models/gpt-4"), 404, "model", f"serves `{MODEL}`")


def test_a_model_served_under_several_names_answers_to_each(tokenizer):
    class Aliased(FakeBackend):
        def model_info(self):
            return ModelInfo(MODEL, MAX_MODEL_LEN, self.vocab_size, aliases=("/models/tiny",))
    backend = Aliased(tokenizer, len(tokenizer))
    with TestClient(build_openai_app(backend, tokenizer, ServingMetrics())) as client:
        assert [card["id"] for card in client.get("/v1/models").json()["data"]] == [MODEL, "/models/tiny"]
        assert client.get("/v1/models//models/tiny").json()["root"] == MODEL
        answer = client.post(COMPLETIONS, json={"model": "/models/tiny", "prompt": "Hi", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["model"] == MODEL      # responses carry the main name
        assert_openai_error(client.post(COMPLETIONS, json={"model": "/models", "prompt": "Hi"}), 404, "model",
                            f"serves `{MODEL}`")


def test_tokenize_and_detokenize_as_vllms(client, backend, tokenizer):
    prompt = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    ids = tokenizer.encode("Hello world")
    assert prompt == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    bare = client.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                          "return_token_strs": True}).json()
    assert bare["tokens"] == ids[1:] and bare["token_strs"] == tokenizer.convert_ids_to_tokens(ids[1:])
    # messages: the prompt the chat endpoint runs
    client.post(CHAT, json={"messages": USER, "max_tokens": 1})
    chat = client.post("/tokenize", json={"messages": USER}).json()
    assert chat["tokens"] == backend.calls[0][1] and chat["count"] == len(chat["tokens"])
    continued = client.post("/tokenize", json={"messages": USER + [{"role": "assistant", "content": "The"}],
                                               "add_generation_prompt": False, "continue_final_message": True})
    assert tokenizer.decode(continued.json()["tokens"]).endswith("<|assistant|>\nThe")
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    assert_openai_error(client.post("/tokenize", json={"prompt": 5}), 400, "prompt", "valid string")
    assert_openai_error(client.post("/tokenize", json={}), 400, "prompt", "prompt is required")
    assert_openai_error(client.post("/tokenize", json={"messages": USER, "continue_final_message": True}), 400,
                        "continue_final_message", "set add_generation_prompt to false")
    # what the chat endpoint refuses to render, /tokenize does not count without
    tool = {"type": "function", "function": {"name": "f"}}
    for field, value, says in (("tools", [tool], "tool calling"), ("tool_choice", "auto", "no tool calling"),
                               ("documents", [{"text": "a"}], "documents is not supported"),
                               ("chat_template", "{{ 1 }}", "chat_template is not supported")):
        assert_openai_error(client.post("/tokenize", json={"messages": USER, field: value}), 400, field, says)
    assert_openai_error(client.post("/tokenize", json={"prompt": "x" * 1_000_000}), 400, "prompt",
                        "far more than 64 tokens can hold")
    assert_openai_error(client.post("/detokenize", json={"tokens": [5, len(tokenizer)]}), 400, "tokens",
                        f"{len(tokenizer)}, outside the model's vocabulary")
    assert_openai_error(client.post("/detokenize", json={"tokens": [5] * 65}), 400, "tokens", "65 ids")
    assert_openai_error(client.post("/detokenize", json={"tokens": ["a"] * 100_000}), 400, "tokens",
                        "tokens: must be a list of token ids (integers)")
    assert_openai_error(client.post("/detokenize", json={"tokens": [5], "model": "gpt-4"}), 404, "model", "serves")
    # a name with no UTF-8 encoding (a lone surrogate, escaped in the JSON) quoted back: the error was a 500
    for path, body in (("/tokenize", {"model": "a\ud800", "prompt": "hi"}), ("/detokenize", {"model": "\udc00",
                                                                                          "tokens": [1]})):
        response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert_openai_error(response, 404, "model", "does not exist")
        assert response.content.isascii() and "\\ud" in response.text
    assert len(backend.calls) == 1                     # none of these generates
    version = client.get("/version").json()["version"]
    assert isinstance(version, str) and version


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids_as_vllm(client, backend):
    reply = backend.reply_ids[:3]
    body = client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 3, "return_token_ids": True}).json()
    prompt_ids = backend.calls[-1][1]
    [choice] = body["choices"]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (prompt_ids, reply)
    body = client.post(CHAT, json={"messages": USER, "max_tokens": 3, "return_token_ids": True}).json()
    assert (body["prompt_token_ids"], body["choices"][0]["token_ids"]) == (backend.calls[-1][1], reply)
    plain = client.post(CHAT, json={"messages": USER, "max_tokens": 3}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    # streamed: the prompt's ids once (chat: on the opening chunk; completions: on the first choice), then
    # each chunk's new ids
    chunks = [json.loads(e) for e in sse_events(client.post(COMPLETIONS, json={
        "prompt": "Hi", "max_tokens": 3, "return_token_ids": True, "stream": True}))[:-1]]
    assert [c["choices"][0]["prompt_token_ids"] for c in chunks] == [prompt_ids, None, None]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == reply
    chunks = [json.loads(e) for e in sse_events(client.post(CHAT, json={
        "messages": USER, "max_tokens": 3, "return_token_ids": True, "stream": True}))[:-1]]
    assert chunks[0]["prompt_token_ids"] == backend.calls[-1][1] and "token_ids" not in chunks[0]["choices"][0]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == reply


def test_the_clients_request_id_names_the_response_and_the_cluster_keeps_its_own(client, backend):
    by_field = client.post(CHAT, json={"messages": USER, "max_tokens": 1, "request_id": "trace-7"},
                           headers={"X-Request-Id": "trace-8"}).json()   # (Ray Serve sets the header if unsent)
    by_header = client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1},
                            headers={"X-Request-Id": "trace-7"}).json()
    assert (by_field["id"], by_header["id"]) == ("chatcmpl-trace-7", "cmpl-trace-7")
    internal = [call[0] for call in backend.calls]
    assert len(set(internal)) == 2 and "trace" not in "".join(internal)
    # a header no client means as an id (every chunk of a stream repeats it) names nothing
    for header in ("t" * 257, "trace\x7f"):
        body = client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": header}).json()
        assert body["id"] == backend.calls[-1][0] and body["id"].startswith("cmpl-")
    assert client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1},
                       headers={"X-Request-Id": "t" * 256}).json()["id"] == "cmpl-" + "t" * 256


def test_logit_bias_and_allowed_token_ids_reach_the_engine(client, backend):
    client.post(CHAT, json={"messages": USER, "max_tokens": 1, "logit_bias": {"5": -100, "17": 3.5},
                            "allowed_token_ids": [5, 17, 40]})
    params = backend.calls[-1][2]
    assert (params.logit_bias, params.allowed_token_ids) == ({5: -100.0, 17: 3.5}, [5, 17, 40])
    assert not params.include_stop_str_in_output
    client.post(COMPLETIONS, json={"prompt": "Hi", "stop": "x", "include_stop_str_in_output": True})
    assert backend.calls[-1][2].include_stop_str_in_output
    client.post(COMPLETIONS, json={"prompt": "Hi", "bad_words": ["world", "this is"]})
    assert backend.calls[-1][2].bad_words == ["world", "this is"]


def test_vllm_request_fields_a_completion_or_a_chat_takes(client, backend, tokenizer):
    client.post(COMPLETIONS, json={"prompt": "Hi", "max_completion_tokens": 5, "max_tokens": 2})
    assert backend.calls[-1][2].max_tokens == 5         # as on chat: the newer name wins
    events = sse_events(client.post(CHAT, json={"messages": USER, "max_tokens": 2, "stream": True,
                                                "stream_options": {"continuous_usage_stats": True}}))
    # stream options without include_usage ask for no usage (OpenAI's and vLLM 0.32's default; a client
    # reading choices[0] of every chunk broke on the usage chunk, whose choices are empty)
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] and "usage" not in c for c in chunks)
    events = sse_events(client.post(CHAT, json={"messages": USER, "max_tokens": 2, "stream": True,
                                                "stream_options": {"include_usage": True}}))
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 2
    client.post(CHAT, json={"messages": USER, "max_tokens": 1, "add_special_tokens": True})
    assert backend.calls[-1][1][:2] == [tokenizer.bos_token_id] * 2    # the tokenizer's BOS on the template's
    assert client.post(CHAT, json={"messages": USER, "max_tokens": 1, "top_logprobs": 0}).status_code == 200


def test_vllm_fields_that_would_change_the_output_are_refused_not_ignored(client, backend):
    for field, value in (("logprob_token_ids", [5, 6]), ("repetition_detection", {"max_pattern_size": 4})):
        assert_openai_error(client.post(CHAT, json={"messages": USER, "max_tokens": 1, field: value}), 400, field,
                            f"{field} is not supported by this server")
    assert backend.calls == []


def test_an_empty_model_name_is_the_served_model_as_vllm_takes_it(client, backend):
    assert client.post(COMPLETIONS, json={"model": "", "prompt": "Hi", "max_tokens": 1}).status_code == 200
    assert_openai_error(client.post(COMPLETIONS, json={"model": "other", "prompt": "Hi"}), 404, "model",
                        "does not exist")


def test_every_chat_delta_has_a_content_string_the_last_one_too(tokenizer):
    # vLLM's: clients that join delta.content broke on a finish chunk of {} (an EOS adds no text)
    class EndsOnEos(FakeBackend):
        async def generate(self, request_id, prompt_token_ids, params):
            async for out in super().generate(request_id, prompt_token_ids, params):
                yield dataclasses.replace(out, finished=False, finish_reason=None)
            yield dataclasses.replace(out, text="", token_ids=[], delta_text="", delta_token_ids=[], logprobs=None,
                                      finished=True, finish_reason="stop")
    with TestClient(build_openai_app(EndsOnEos(tokenizer, len(tokenizer)), tokenizer, ServingMetrics())) as c:
        events = sse_events(c.post(CHAT, json={"messages": USER, "max_tokens": 20, "stream": True}))
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {"content": ""}, "logprobs": None,
                                        "finish_reason": "stop", "stop_reason": None}
    assert all(isinstance(c["choices"][0]["delta"]["content"], str) for c in chunks)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == REPLY


def test_a_messages_name_reaches_the_chat_template(backend, tokenizer, metrics):
    named = copy.deepcopy(tokenizer)
    named.chat_template = "{% for m in messages %}{{ m.get('name', '?') }}: {{ m['content'] }}\n{% endfor %}"
    with TestClient(build_openai_app(backend, named, metrics)) as named_client:
        named_client.post(CHAT, json={"messages": [{"role": "user", "content": "Hi", "name": "ada"},
                                                   {"role": "user", "content": "Yo"}], "max_tokens": 1})
    assert named.decode(backend.calls[-1][1]) == "ada: Hi\n?: Yo\n"


def _rendered(backend, tokenizer, metrics, template: str, body: dict) -> str:
    """The prompt text a chat request renders to with `template` as the tokenizer's."""
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = template
    with TestClient(build_openai_app(backend, templated, metrics)) as templated_client:
        r = templated_client.post(CHAT, json={"max_tokens": 1, **body})
        assert r.status_code == 200, r.text
    return templated.decode(backend.calls[-1][1])


# Gemma 3 / Llama 3.2 Vision style: a message's content is looped over as typed parts
PARTS_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {% for part in message['content'] %}"
                  "{{ part['text'] }}|{% endfor %}{{ '\\n' }}{% endfor %}")


def test_a_template_that_loops_over_content_gets_text_parts(backend, tokenizer, metrics):
    # given the joined string, such a template looped over its characters (or dropped the text); vLLM detects
    # the loop and passes each message's content as parts, a string as one part
    body = {"messages": [{"role": "system", "content": "Answer in French."},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert _rendered(backend, tokenizer, metrics, PARTS_TEMPLATE, body) == "system: Answer in French.|\nuser: a|b|\n"
    # a template written for strings gets the parts joined, as before
    plain = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    assert _rendered(backend, tokenizer, metrics, plain, body) == "system: Answer in French.\nuser: a\nb\n"
    # an assistant's refusal part is its text (vLLM's)
    refusal = {"messages": USER + [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}] + USER}
    assert "assistant: no\n" in _rendered(backend, tokenizer, metrics, plain, refusal)


def test_developer_messages_render_as_vllm_renders_them(backend, tokenizer, metrics):
    plain = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    knows = ("{% for message in messages %}{% if message['role'] == 'developer' %}dev{% else %}{{ message['role'] }}"
             "{% endif %}: {{ message['content'] }}\n{% endfor %}")
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}] + USER}
    # a template that does not name the role: system, merged with the system messages at the front (a
    # template that wants its system message first refused the conversation before)
    assert _rendered(backend, tokenizer, metrics, plain, body) == "system: s\n\nd\nuser: Hi\n"
    # one that names it gets it as it came
    assert _rendered(backend, tokenizer, metrics, knows, body) == "system: s\ndev: d\nuser: Hi\n"


def test_named_templates_and_a_continued_developer_message(backend, tokenizer, metrics):
    plain = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    # a checkpoint with named templates (a dict): the default renders (traits of a dict raised: every chat a 400)
    assert _rendered(backend, tokenizer, metrics, {"default": plain, "tool_use": "x"},
                     {"messages": USER}) == "user: Hi\n"
    # the message a reply continues stays last, though developer messages move to the front as system ones
    body = {"messages": USER + [{"role": "developer", "content": "Answer starts"}],
            "continue_final_message": True, "add_generation_prompt": False}
    assert _rendered(backend, tokenizer, metrics, plain, body) == "user: Hi\nsystem: Answer starts"


def test_reasoning_reaches_the_template(backend, tokenizer, metrics):
    think = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
             "{% if message.reasoning_content %} [{{ message.reasoning_content }}]{% endif %}{{ '\\n' }}{% endfor %}"
             "{% if enable_thinking is defined %}thinking={{ enable_thinking }} effort={{ reasoning_effort }}"
             "{% endif %}")
    turns = USER + [{"role": "assistant", "content": "Hi", "reasoning": "greet back"}] + USER
    assert _rendered(backend, tokenizer, metrics, think, {"messages": turns}) == \
        "user: Hi\nassistant: Hi [greet back]\nuser: Hi\n"
    for effort, thinking in (("none", False), ("high", True)):
        text = _rendered(backend, tokenizer, metrics, think, {"messages": USER, "reasoning_effort": effort})
        assert text.endswith(f"thinking={thinking} effort={effort}")
    kwargs = {"messages": USER, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
    assert _rendered(backend, tokenizer, metrics, think, kwargs).endswith("thinking=False effort=high")


def test_continue_final_message_continues_a_users_message_in_its_role(client, backend, tokenizer):
    r = client.post(CHAT, json={"messages": USER, "continue_final_message": True, "add_generation_prompt": False,
                                "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "user"
    assert tokenizer.decode(backend.calls[-1][1]).endswith("<|user|>\nHi")     # left open


def test_empty_or_null_stream_options_are_taken_as_unset(client):
    for options in ({}, {"include_usage": True, "continuous_usage_stats": None}):
        stream = bool(options)
        r = client.post(CHAT, json={"messages": USER, "max_tokens": 2, "stream": stream, "stream_options": options})
        assert r.status_code == 200, (options, r.text)
    assert_openai_error(client.post(CHAT, json={"messages": USER, "stream_options": {"include_usage": True}}),
                        400, "stream_options", "only allowed when stream is true")


def test_a_field_the_server_does_not_know_is_logged_once(client, caplog):
    from router import protocol
    with caplog.at_level("WARNING", logger="router.protocol"):
        for _ in range(2):
            client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1, "a_field_from_the_future": 1})
    said = [r.getMessage() for r in caplog.records if "a_field_from_the_future" in r.getMessage()]
    assert len(said) == 1 and "CompletionRequest" in said[0]
    # a client inventing names does not grow what the server remembers past its bound
    client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1, **{f"made_up_{i}": 1 for i in range(5000)}})
    assert len(protocol._ignored_fields_logged) <= protocol._MAX_IGNORED_FIELDS_LOGGED


def test_an_unknown_field_name_is_logged_short_and_quoted(client, caplog, monkeypatch):
    from router import protocol
    monkeypatch.setattr(protocol, "_ignored_fields_logged", set())
    name = "x" * 1_000_000 + "\nforged log line"
    with caplog.at_level("WARNING", logger="router.protocol"):
        assert client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1, name: 1}).status_code == 200
    (said,) = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert said.endswith(repr("x" * 64) + " (logged once each)") and "\n" not in said
    assert protocol._ignored_fields_logged == {("CompletionRequest", repr("x" * 64))}


def test_what_a_response_repeats_of_the_request_is_bounded(client):
    assert_openai_error(client.post(COMPLETIONS, json={"prompt": "Hi", "request_id": "r" * 257}), 400,
                        "request_id", "at most 256 characters")
    error = assert_openai_error(client.post(COMPLETIONS, json={"prompt": "Hi", "model": "m" * 100_000}), 404,
                                "model", "does not exist")
    assert len(error["message"]) < 300


def test_health_reports_the_backend(client, backend, monkeypatch):
    from router import health
    monkeypatch.setattr(health, "HEALTH_TTL_S", 0.0)
    assert client.get("/health").status_code == 200
    backend.healthy = False
    assert_openai_error(client.get("/health"), 503, None, "no decode replica is alive")
    assert client.head("/health").status_code == 503       # load balancers' HEAD probes (405 before)
    backend.healthy = True
    assert client.get("/health").status_code == 200
    assert client.head("/health").status_code == 200


def test_probes_close_together_share_one_check():
    """/health is open to anyone: a flood of probes must not be a flood of checks
    on the workers. One runs at a time, and its answer serves for HEALTH_TTL_S."""
    from router.health import SharedHealthCheck
    checks = []

    async def probe():
        checks.append(1)
        await asyncio.sleep(0.05)
        if len(checks) > 1:
            raise BackendUnavailableError("no decode worker answered")

    async def main():
        shared = SharedHealthCheck(probe, ttl_s=0.3)
        first = await asyncio.gather(*(shared() for _ in range(50)))      # at once: one check
        again = await shared()                                             # within the TTL: its answer
        await asyncio.sleep(0.35)
        late = await asyncio.gather(*(shared() for _ in range(5)))
        return first, again, late

    first, again, late = asyncio.run(main())
    assert first == [None] * 50 and again is None and len(checks) == 2
    assert late == ["no decode worker answered"] * 5


def test_a_streams_time_to_first_token_is_recorded_at_its_first_token_not_at_its_end(app, backend, metrics):
    # observed at the end, a long stream's TTFT reached dashboards a whole stream late: during a TTFT
    # regression the panels stayed quiet while the slow streams still ran
    backend.hang_after = 2
    during: list[str] = []
    requests = [{"type": "http.request", "body": json.dumps({"prompt": "Hi", "stream": True}).encode(),
                 "more_body": False}]

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await backend.hanging.wait()           # two tokens out, the stream still running
        during.append(metrics.render()[0].decode())
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": COMPLETIONS, "raw_path": COMPLETIONS.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1234), "server": ("testserver", 80),
             "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")]}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    assert "pdserve_time_to_first_token_seconds_count 1.0" in during[0]
    assert "pdserve_requests_total{" not in during[0]      # it had not ended yet


def test_metrics_after_requests(client, metrics, tokenizer):
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "Hi", "stream": True}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "Hi", "n": 0}).status_code == 400
    metrics.set_worker_stats("decode-1", {"num_running": 3, "kv_cache_usage": 0.25,
                                          "free_kv_blocks": 7, "cpu_borrowed_steps": 41})
    samples = metric_samples(client)
    assert samples[("pdserve_time_to_first_token_seconds_count", ())] == 2
    assert samples[("pdserve_time_per_output_token_seconds_count", ())] == 2
    assert samples[("pdserve_e2e_request_latency_seconds_count", ())] == 2
    assert samples[("pdserve_request_queue_time_seconds_sum", ())] == pytest.approx(0.004)
    assert samples[("pdserve_kv_transfer_bytes_bucket", (("le", 4 * 2**20),))] == 2
    assert samples[("pdserve_kv_transfer_bytes_bucket", (("le", 2**20),))] == 0
    assert samples[("pdserve_requests_total", (("finish_reason", "length"),))] == 1
    assert samples[("pdserve_requests_total", (("finish_reason", "stop"),))] == 1
    assert samples[("pdserve_prompt_tokens_total", ())] == 2 * len(tokenizer.encode("Hi"))
    assert samples[("pdserve_generation_tokens_total", ())] == 4 + 15
    assert samples[("pdserve_request_errors_total", (("status", "400"),))] == 1
    assert samples[("pdserve_num_requests_running", (("worker", "decode-1"),))] == 3
    assert samples[("pdserve_kv_cache_usage_ratio", (("worker", "decode-1"),))] == 0.25
    assert ("pdserve_num_requests_waiting", (("worker", "decode-1"),)) not in samples  # not reported
    assert not any("free_kv" in name for name, _ in samples)  # stats without a gauge stay out
    # a worker's running count is a counter (what rate() reads), with the value the worker counted
    assert samples[("pdserve_worker_cpu_borrowed_steps_total", (("worker", "decode-1"),))] == 41
    assert "# TYPE pdserve_worker_cpu_borrowed_steps_total counter" in client.get("/metrics").text
    metrics.remove_worker("decode-1")
    samples = metric_samples(client)
    assert ("pdserve_num_requests_running", (("worker", "decode-1"),)) not in samples
    assert ("pdserve_worker_cpu_borrowed_steps_total", (("worker", "decode-1"),)) not in samples


def test_metrics_an_operator_reads_are_the_quantities_they_name(client, metrics):
    from router.timings import PhaseTimings, RequestTimings
    # an echo of the prompt alone (lm-eval's scoring) generates a token it does not return: not counted
    r = client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0
    assert metric_samples(client)[("pdserve_generation_tokens_total", ())] == 0
    # the decode side's wait for KV blocks, the hand-offs a decode worker receives, its engine's preemptions
    metrics.observe_request(RequestTimings(arrival_time=0.0, first_token_time=0.1, finished_time=1.0,
                                           prompt_tokens=5, generation_tokens=3, finish_reason="stop",
                                           phases=PhaseTimings(reserve_time=0.3, transfer_time=0.01)))
    metrics.set_worker_stats("decode-0", {"num_receiving": 2, "num_preemptions": 7})
    # the autoscaler's prediction for targets that cannot hold the load is +Inf (an alert's > SLO holds),
    # one it has not made is NaN
    metrics.set_autoscaler({"decode": 1}, {"decode": 1}, {("ttft", "predicted"): math.inf,
                                                          ("tpot", "predicted"): None})
    samples = metric_samples(client)
    assert samples[("pdserve_kv_reserve_time_seconds_sum", ())] == pytest.approx(0.3)
    assert samples[("pdserve_worker_kv_receiving", (("worker", "decode-0"),))] == 2
    assert samples[("pdserve_worker_preemptions_total", (("worker", "decode-0"),))] == 7
    latency = "pdserve_autoscaler_latency_seconds"
    assert samples[(latency, (("metric", "ttft"), ("source", "predicted")))] == math.inf
    assert math.isnan(samples[(latency, (("metric", "tpot"), ("source", "predicted")))])


def test_request_lengths_prefix_cache_and_router_queue_metrics(tokenizer):
    from router.admission import AdmissionControl, AdmissionSettings
    from router.timings import RequestTimings
    metrics = ServingMetrics()
    for prompt, generated, reason, first in ((5, 3, "stop", 0.1), (300, 64, "length", 0.2),
                                              (40, 2, "abort", 0.3), (7, 0, "abort", None)):
        metrics.observe_request(RequestTimings(arrival_time=0.0, first_token_time=first, finished_time=1.0,
                                               prompt_tokens=prompt, generation_tokens=generated,
                                               finish_reason=reason))
    metrics.set_worker_stats("prefill-0", {"prefix_cache_queried_tokens": 900, "prefix_cache_hit_tokens": 640})
    admission = AdmissionControl(AdmissionSettings())
    admission.first_token(admission.admit(120))         # running, no longer waiting
    admission.admit(30)
    admission.admit(20)
    app = build_openai_app(FakeBackend(tokenizer, len(tokenizer)), tokenizer, metrics, admission=admission)
    samples = metric_samples(TestClient(app))
    prompt_le = lambda le: samples[("pdserve_request_prompt_tokens_bucket", (("le", float(le)),))]  # noqa: E731
    output_le = lambda le: samples[("pdserve_request_generation_tokens_bucket", (("le", float(le)),))]  # noqa: E731
    # prompts: of requests that got a first token (an aborted one too); outputs: of completed ones only
    assert (prompt_le("5.0"), prompt_le("50.0"), prompt_le("500.0")) == (1, 2, 3)
    assert samples[("pdserve_request_prompt_tokens_sum", ())] == 345
    assert (output_le("2.0"), output_le("5.0"), output_le("100.0")) == (0, 1, 2)
    assert samples[("pdserve_request_generation_tokens_sum", ())] == 67
    assert samples[("pdserve_worker_prefix_cache_queries_total", (("worker", "prefill-0"),))] == 900
    assert samples[("pdserve_worker_prefix_cache_hits_total", (("worker", "prefill-0"),))] == 640
    assert samples[("pdserve_router_requests_waiting", ())] == 2
    assert samples[("pdserve_router_prompt_tokens_waiting", ())] == 50
    assert samples[("pdserve_router_requests_running", ())] == 3
    # with admission control off the router keeps no counts: no series rather than zeros
    bare_app = build_openai_app(FakeBackend(tokenizer, len(tokenizer)), tokenizer, ServingMetrics())
    bare = metric_samples(TestClient(bare_app))
    assert not any(name.startswith("pdserve_router_") for name, _ in bare)


def test_metrics_own_their_registry():
    first, second = ServingMetrics(), ServingMetrics()  # the global registry would reject this
    first.observe_error(503)
    assert b'pdserve_request_errors_total{status="503"} 1.0' in first.render()[0]
    assert b"pdserve_request_errors_total{" not in second.render()[0]


# --- errors ------------------------------------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
LONG = list(range(3, 3 + MAX_MODEL_LEN))


@pytest.mark.parametrize(("path", "body", "status", "param", "fragment"), [
    (COMPLETIONS, {"prompt": "Hi", "n": 0}, 400, "n", "n must be at least 1, got 0"),
    (CHAT, {"messages": USER, "n": 17}, 400, "n", "n is 17; this server generates at most 16 choices"),
    (COMPLETIONS, {"prompt": "Hi", "best_of": 2}, 400, "best_of", "best_of > 1 is not supported"),
    (COMPLETIONS, {"prompt": "Hi", "best_of": 0}, 400, "best_of", "best_of must be 1, got 0"),
    # thousands of digits: the context check's own message had failed on the sum (a 500)
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": int("9" * 4300)}, 400, "max_tokens",
     "less than or equal to 9223372036854775807"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs",
     "top_logprobs must be in [0, 20], got -1"),
    (COMPLETIONS, {"prompt": "Hi", "prompt_logprobs": -1}, 400, "prompt_logprobs", "whole vocabulary"),
    (COMPLETIONS, {"prompt": "Hi", "prompt_logprobs": 21}, 400, "prompt_logprobs", "at most 20"),
    (COMPLETIONS, {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs",
     "not available when stream is true"),
    (COMPLETIONS, {"prompt": "Hi", "suffix": "end"}, 400, "suffix", "suffix (insertion) is not supported"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "got 101.0 for token '5'"),
    (CHAT, {"messages": USER, "logit_bias": {"600": 1}}, 400, "logit_bias", "contains 600, must be in [0, 512)"),
    # JSON numbers past float's range and keys past int()'s digit limit: 400s (they were 500s)
    (CHAT, {"messages": USER, "logit_bias": {"5": 10 ** 400}}, 400, "logit_bias", "an int of 1329 bits"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias", "past any vocabulary"),
    (COMPLETIONS, {"prompt": "Hi", "allowed_token_ids": []}, 400, "allowed_token_ids", "non-empty list"),
    (COMPLETIONS, {"prompt": "Hi", "allowed_token_ids": [3, 600]}, 400, "allowed_token_ids", "contains 600"),
    (COMPLETIONS, {"prompt": "Hi", "allowed_token_ids": [3] * 1025}, 400, "allowed_token_ids",
     "has 1025 ids; this server allows at most 1024"),
    (CHAT, {"messages": USER, "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias", "at most 1024"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"}}, 400,
     "response_format", "not supported"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": "ten"}, 400, "max_tokens", "valid integer"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", ">= 1, got 0"),    # 0 only with echo
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": -5}, 400, "max_tokens", ">= 1, got -5"),
    (COMPLETIONS, {"prompt": "Hi", "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    (COMPLETIONS, {"prompt": "Hi", "temperature": 2e4}, 400, "temperature", "in [0, 2]"),
    (COMPLETIONS, {"prompt": "Hi", "temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 1.5}, 400, "top_p", "got 1.5"),
    (COMPLETIONS, {"prompt": "Hi", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens", "max_tokens=3"),
    (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [1, 600]}, 400, "stop_token_ids", "600"),
    (COMPLETIONS, {"prompt": LONG}, 400, "prompt", "maximum context length is 64 tokens"),
    (COMPLETIONS, {"prompt": [5] * 10, "max_tokens": 65}, 400, "max_tokens",
     "max_tokens=65 cannot be greater than this model's maximum context length of 64 tokens"),
    (COMPLETIONS, {"prompt": [5] * 10, "max_tokens": 60, "min_tokens": 55}, 400, "min_tokens",
     "you requested at least 65 tokens (10 in the prompt, min_tokens 55 in the completion)"),
    (COMPLETIONS, {"prompt": [5, 600]}, 400, "prompt", "token id 600, outside"),
    (COMPLETIONS, {"prompt": [-1]}, 400, "prompt", "token id -1"),
    (COMPLETIONS, {"prompt": [600] * MAX_MODEL_LEN}, 400, "prompt", "maximum context length"),  # length first
    (COMPLETIONS, {"prompt": [5, "a"]}, 400, "prompt", "prompt: must be a string"),
    (COMPLETIONS, {"prompt": [5, True]}, 400, "prompt", "prompt: must be a string"),
    (COMPLETIONS, {"prompt": [[5, 6], 7]}, 400, "prompt", "prompt: must be a string"),
    (COMPLETIONS, {"prompt": [[]]}, 400, "prompt", "prompt: empty prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", "prompt: empty prompt"),
    (COMPLETIONS, {"prompt": ["a", ""]}, 400, "prompt", "prompt 1 of the batch is empty"),
    (COMPLETIONS, {"prompt": ["a", [3, 4], 5]}, 400, "prompt", "a list of those (a batch)"),
    (COMPLETIONS, {"prompt": {"text": "a"}}, 400, "prompt", "prompt: must be a string"),
    (COMPLETIONS, {}, 400, "prompt", "prompt is required"),
    (COMPLETIONS, {"prompt": "Hi", "model": "gpt-4"}, 404, "model", f"serves `{MODEL}`"),
    (CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages[0].role",
     "must be 'system', 'developer', 'user' or 'assistant' (got 'wizard')"),
    (CHAT, {"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]}] + USER}, 400,
     "messages[1].tool_calls", "tool calling is not supported"),
    (CHAT, {"messages": USER + [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}, 400, "messages[1].role",
     "messages[1] is a tool message (a tool's result); tool calling is not supported"),
    (CHAT, {"messages": USER, "guided_choice": ["yes", "no"]}, 400, "guided_choice", "not supported"),
    (COMPLETIONS, {"prompt": "Hi", "include_stop_str_in_output": 1}, 400, "include_stop_str_in_output",
     "valid boolean"),
    (COMPLETIONS, {"prompt": "Hi", "bad_words": ["  "]}, 400, "bad_words", "non-blank str"),
    (COMPLETIONS, {"prompt": "Hi", "bad_words": ["w"] * 129}, 400, "bad_words", "at most 128"),
    (COMPLETIONS, {"prompt": "Hi", "bad_words": [f"w{i}" for i in range(100)]}, 400, "bad_words",
     "token sequences"),
    (COMPLETIONS, {"prompt": "Hi", "bad_words": ["ok", "a\ud800"]}, 400, "bad_words", "lone UTF-16 surrogate"),
    (COMPLETIONS, {"prompt": "Hi", "allowed_token_ids": [67, 259], "bad_words": ["a"]}, 400, "bad_words",
     "ban every token allowed_token_ids allows ([67, 259])"),     # "a" and " a" are those two tokens
    (COMPLETIONS, {"prompt": "Hi", "bad_words": ["x" * 1_000_000]}, 400, "bad_words",
     "has 1000000 characters, more than an output of this model's 64-token context could contain"),
    # each word within the bound, together far past it (each tokenized twice, on the router and every worker)
    (COMPLETIONS, {"prompt": "Hi", "bad_words": [f"{i}" + "x" * 1_000 for i in range(100)]}, 400, "bad_words",
     "bad_words hold 100190 characters together; this server takes at most"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 1_000_000}], "truncate_prompt_tokens": 8}, 400,
     "messages", "your messages has 1000000 characters"),     # a chat is rendered whole, cut or not
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", "only text content parts"),
    (CHAT, {"messages": []}, 400, "messages", "messages: no messages"),
    (CHAT, {"messages": USER, "max_completion_tokens": 65}, 400, "max_completion_tokens",
     "max_completion_tokens=65 cannot be greater than this model's maximum context length of 64"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "21"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "requires logprobs=true"),
    (COMPLETIONS, {"prompt": "Hi \ud800"}, 400, "prompt", "lone UTF-16 surrogate (U+D800) at character 3"),
    (COMPLETIONS, {"prompt": "Hi", "model": "\udc00"}, 400, "model", "lone UTF-16 surrogate"),
    (COMPLETIONS, {"prompt": "Hi", "stop": ["a", "\ud83d"]}, 400, "stop", "lone UTF-16 surrogate"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud83d"}]}, 400, "messages[0].content", "surrogate"),
    (COMPLETIONS, {"prompt": "x" * 1_000_000}, 400, "prompt", "your prompt has 1000000 characters, far more "
     "than 64 tokens can hold"),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"bos_token": "ab " * 1_000_000}}, 400, "messages",
     "your messages has 3000011 characters, far more than 64 tokens can hold"),   # the key too
    # empty messages by the thousand: refused before the template renders them
    (CHAT, {"messages": [{"role": "user", "content": ""}] * 257}, 400, "messages",
     "your messages has 257 messages, far more than 64 tokens can hold"),
    (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": list(range(300))}, 400, "stop_token_ids",
     "has 300 ids; this server allows at most 256"),
    (CHAT, {"messages": USER, "echo": "yes"}, 400, "echo", "valid boolean"),
    (CHAT, {"messages": USER, "documents": [{"title": "t", "text": "doc"}]}, 400, "documents",
     "does not pass documents to the chat template"),       # (was dropped silently)
    (CHAT, {"messages": USER, "chat_template": "{{ messages }}"}, 400, "chat_template", "model's own template"),
    (CHAT, {"messages": USER, "best_of": 2}, 400, "best_of", "not supported"),
    (CHAT, {"messages": USER, "cache_salt": "tenant-a"}, 400, "cache_salt", "not supported"),
    (COMPLETIONS, {"prompt": "Hi", "return_tokens_as_token_ids": 1}, 400, "return_tokens_as_token_ids",
     "valid boolean"),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"tokenize": False}}, 400, "chat_template_kwargs",
     "may not set tokenize"),
    # transformers 5's own argument: it switches the shared tokenizer's special-token splitting
    (CHAT, {"messages": USER, "chat_template_kwargs": {"sanitize_control_tokens": True}}, 400,
     "chat_template_kwargs", "may not set sanitize_control_tokens"),
    # rendered to text, then tokenized with the special tokens: a kwarg the template prints that is not text
    (CHAT, {"messages": USER, "add_special_tokens": True, "chat_template_kwargs": {"bos_token": "\ud800"}}, 400,
     "chat_template_kwargs", "The rendered chat cannot be tokenized"),
    (CHAT, {"messages": USER, "top_logprobs": -1}, 400, "top_logprobs", "must be in [0, 20], got -1"),
    # lists of many bad items: one error for the list, before pydantic makes one per item
    (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [{}] * 100_000}, 400, "stop_token_ids",
     "stop_token_ids: must be a list of token ids (integers)"),
    (COMPLETIONS, {"prompt": "Hi", "allowed_token_ids": [1, True]}, 400, "allowed_token_ids",
     "must be a list of token ids"),
    (COMPLETIONS, {"prompt": "Hi", "bad_words": [1] * 100_000}, 400, "bad_words", "must be a list of strings"),
    (CHAT, {"messages": [{}] * 20_000}, 400, "messages", "has 20000 messages; this server takes at most 16384"),
    (CHAT, {"messages": ["hi"] * 100}, 400, "messages", "messages: must be a list of message objects"),
    (CHAT, {"messages": [{}] * 50}, 400, "messages[0].role", "; and 40 more errors"),
    (CHAT, {"messages": USER + [{"role": "assistant", "content": "The"}], "continue_final_message": True}, 400,
     "continue_final_message", "set add_generation_prompt to false"),
    (CHAT, {"messages": USER, "priority": -3}, 400, "priority", "priority must be 0 (got -3)"),
    (CHAT, {"messages": USER, "structural_tag": "{}"}, 400, "structural_tag", "not supported"),
    (COMPLETIONS, {"prompt": [5] * 10, "max_completion_tokens": 70}, 400, "max_completion_tokens",
     "max_completion_tokens=70 cannot be greater than"),
])
def test_bad_requests_get_openai_errors_and_the_app_keeps_serving(
        client, backend, path, body, status, param, fragment):
    # JSON as clients send it: ASCII, so a lone surrogate travels as its \uXXXX escape
    sent = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    error = assert_openai_error(sent, status, param, fragment)
    assert error["code"] == ("model_not_found" if status == 404 else None)
    assert backend.calls == []  # refused before reaching the backend
    assert client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_a_token_id_list_with_many_bad_items_gets_one_short_error(client, backend):
    """Each bad item of a long list must not become its own message (pydantic's
    union errors would list every one)."""
    error = assert_openai_error(client.post(COMPLETIONS, json={"prompt": [5] + ["a"] * 100_000}), 400, "prompt",
                                "prompt: must be a string, a list of token ids")
    assert len(error["message"]) < 300, error["message"][:400]
    assert backend.calls == []


def test_chat_template_kwargs_nested_deeper_than_pythons_recursion_limit_are_not_a_500(client, backend):
    # 700 levels parse as JSON; counting their characters recursively overflowed the stack (a 500);
    # the template cannot render them either: a 400
    deep = "[" * 700 + "]" * 700
    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template_kwargs": {"x": ' + \
        deep + "}}"
    sent = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert_openai_error(sent, 400, "messages", "The chat template cannot render these messages")
    assert backend.calls == []
    assert client.post(CHAT, json={"messages": USER, "max_tokens": 1}).status_code == 200


def test_a_template_that_raises_is_logged_spaced_out_with_its_error(client, backend, tokenizer, monkeypatch,
                                                                     caplog):
    """A template that refuses every conversation (a broken one, or one whose rules every client
    breaks) answers each request 400; the server log tells the operator why, once a minute."""
    from router import openai_api
    monkeypatch.setattr(openai_api, "_TEMPLATE_FAILURE_LOG", openai_api.SpacedLog(openai_api.log, every_s=60.0,
                                                                                  level=logging.INFO))

    def broken(*args, **kwargs):
        raise KeyError("system_message")
    monkeypatch.setattr(tokenizer, "apply_chat_template", broken)
    with caplog.at_level("INFO", logger="router.openai_api"):
        for _ in range(3):
            assert_openai_error(client.post(CHAT, json={"messages": USER, "max_tokens": 1}), 400, "messages",
                                "The chat template cannot render these messages")
    said = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
    assert said == ["the chat template refused a request's messages (answered 400): KeyError: 'system_message'"]
    assert backend.calls == []


def test_malformed_json_and_wrong_routes(client):
    response = client.post(COMPLETIONS, content=b'{"prompt": "Hi",',
                           headers={"content-type": "application/json"})
    assert_openai_error(response, 400, None, "not valid JSON")
    assert_openai_error(client.post(COMPLETIONS, content=b"[1]",
                                    headers={"content-type": "application/json"}),
                        400, None, "must be a JSON object")
    # parsed, but not as JSON syntax goes: FastAPI's own "There was an error parsing the body"
    for body, fragment in ((b'{"prompt": "caf\xe9"}', "is not UTF-8 (byte 0xe9 at position 15); send the JSON"),
                           (b'{"prompt": "Hi", "n": ' + b"9" * 5000 + b"}", "holds a number too long to parse"),
                           (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply")):
        assert_openai_error(client.post(COMPLETIONS, content=body, headers={"content-type": "application/json"}),
                            400, None, fragment)
    assert_openai_error(client.post("/v1/embeddings", json={}), 404, None,
                        "Unknown route POST /v1/embeddings")
    assert_openai_error(client.get(COMPLETIONS), 405, None, "GET is not allowed")
    assert client.get("/v1/models").status_code == 200


@pytest.mark.parametrize(("failure", "status", "param", "fragment"), [
    (InvalidRequestError("prompt does not fit in the KV cache", param="prompt"), 400, "prompt",
     "does not fit"),
    (BackendUnavailableError("the decode worker is unavailable: secret internals (Ray's, naming an actor)",
                             reason="the decode worker died"), 503, None, "unavailable: the decode worker died."),
    (BackendUnavailableError("the decode worker is unavailable: secret internals"), 503, None,
     "unavailable: no worker could serve the request."),
    (RuntimeError("secret internals"), 500, None, "internal error"),
])
def test_backend_errors_before_and_during_a_stream(client, backend, metrics, failure, status,
                                                   param, fragment):
    backend.failure, backend.fail_after = failure, 0
    for stream in (False, True):
        response = client.post(COMPLETIONS, json={"prompt": "Hi", "stream": stream})
        error = assert_openai_error(response, status, param, fragment)
        assert "secret" not in error["message"]
    backend.fail_after = 2  # after the headers: an SSE error event, then [DONE]
    events = sse_events(client.post(COMPLETIONS, json={"prompt": "Hi", "stream": True}))
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == "Hel"
    error = json.loads(events[-2])["error"]
    assert set(error) == ERROR_KEYS and fragment in error["message"]
    assert error["param"] == param
    samples = metric_samples(client)
    assert samples[("pdserve_request_errors_total", (("status", str(status)),))] == 3
    assert samples[("pdserve_requests_total", (("finish_reason", "error"),))] == 3
    # only the stream that got its first token had its prompt processed
    assert samples[("pdserve_prompt_tokens_total", ())] == len(backend.calls[-1][1])


# --- n choices ------------------------------------------------------------------

def test_n_choices_each_run_as_a_request_of_their_own_and_come_back_indexed(client, backend, tokenizer):
    body = client.post(COMPLETIONS, json={"prompt": "Hi", "n": 3, "max_tokens": 4, "seed": 5,
                                          "temperature": 1.0, "return_token_ids": True}).json()
    ids = [call[0] for call in backend.calls]
    assert len(set(ids)) == 3 and all(i.startswith("cmpl-") for i in ids)
    assert sorted(call[2].seed for call in backend.calls) == [5, 6, 7]    # vLLM's: the seed moves on by the index
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == \
        [(i, tokenizer.decode(backend.reply_ids[:4]), "length") for i in range(3)]
    assert all(c["prompt_token_ids"] == backend.calls[0][1] for c in body["choices"])   # each choice's
    assert body["usage"] == {"prompt_tokens": len(backend.calls[0][1]), "completion_tokens": 12,
                             "total_tokens": len(backend.calls[0][1]) + 12}     # the prompt counted once
    client.post(COMPLETIONS, json={"prompt": "Hi", "n": 2, "max_tokens": 1})
    assert [call[2].seed for call in backend.calls[3:]] == [None, None]
    # a seed as 64 bits: the choice after seed -2 is seeded (-1 as 2**64 - 1, what the generator makes of -1;
    # -1 itself is a request's "no seed"), and one past 2**63 - 1 is served, not refused
    client.post(COMPLETIONS, json={"prompt": "Hi", "n": 3, "max_tokens": 1, "seed": -2})
    assert [call[2].seed for call in backend.calls[5:]] == [-2, 2**64 - 1, 0]
    assert client.post(COMPLETIONS, json={"prompt": "Hi", "n": 2, "max_tokens": 1, "seed": 2**63 - 1}).status_code \
        == 200 and backend.calls[-1][2].seed == 2**63


def test_n_streamed_choices_interleave_and_each_opens_and_ends(client, backend, tokenizer):
    events = sse_events(client.post(CHAT, json={"messages": USER, "n": 2, "max_tokens": 5, "stream": True,
                                                "stream_options": {"include_usage": True}}))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[2:-1] if c["choices"][0]["index"] == index]
        assert "".join(ch["delta"].get("content", "") for ch in mine) == tokenizer.decode(backend.reply_ids[:5])
        assert [ch["finish_reason"] for ch in mine] == [None] * 4 + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert backend.closed_early == []


def test_a_choice_that_fails_ends_the_stream_with_an_error_and_closes_the_others(client, backend):
    healthy = backend.generate

    async def second_choice_fails(request_id, prompt_token_ids, params):
        async for out in healthy(request_id, prompt_token_ids, params):
            if request_id.endswith("-1") and out.num_output_tokens == 2:
                raise BackendUnavailableError.public("decode worker died")
            yield out

    backend.hang_after = 3          # the first choice waits after 3 tokens, as a slow one would
    backend.generate = second_choice_fails
    events = sse_events(client.post(COMPLETIONS, json={"prompt": "Hi", "n": 2, "stream": True}))
    assert events[-1] == "[DONE]" and "decode worker died" in json.loads(events[-2])["error"]["message"]
    assert sorted(i[-2:] for i in backend.closed_early) == ["-0", "-1"]    # the waiting one closed too
    backend.hang_after = None
    error = assert_openai_error(client.post(COMPLETIONS, json={"prompt": "Hi", "n": 2}), 503, None, "died")
    assert error["type"] == "server_error"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_closes_every_choice(app, backend, stream):
    backend.hang_after = 1
    asyncio.run(_post_then_disconnect(app, CHAT, {"messages": USER, "n": 3, "stream": stream}, backend))
    assert sorted(backend.closed_early) == sorted(call[0] for call in backend.calls) and len(backend.calls) == 3


def test_token_ids_held_back_with_their_text_still_stream_when_asked_for(client, backend):
    healthy = backend.generate

    async def first_text_held_back(request_id, prompt_token_ids, params):   # (a stop string could be forming)
        held = ""
        async for out in healthy(request_id, prompt_token_ids, params):
            if out.num_output_tokens == 1:
                held = out.delta_text
                out = dataclasses.replace(out, text="", delta_text="")
            elif held:
                out = dataclasses.replace(out, delta_text=held + out.delta_text)
                held = ""
            yield out

    backend.generate = first_text_held_back
    chunks = [json.loads(e) for e in sse_events(client.post(COMPLETIONS, json={
        "prompt": "Hi", "max_tokens": 3, "stream": True, "return_token_ids": True}))[:-1]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == backend.reply_ids[:3]
    assert chunks[0]["choices"][0]["text"] == "" and chunks[0]["choices"][0]["prompt_token_ids"]
    plain = [json.loads(e) for e in sse_events(client.post(COMPLETIONS, json={
        "prompt": "Hi", "max_tokens": 3, "stream": True}))[:-1]]
    assert len(plain) == 2          # without ids asked for, an output with nothing to show sends nothing


def test_continuous_usage_of_n_choices_is_each_chunks_own_choices(client):
    chunks = [json.loads(e) for e in sse_events(client.post(COMPLETIONS, json={
        "prompt": "Hi", "n": 2, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))[:-1]]
    counts = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        index = chunk["choices"][0]["index"]
        counts[index] += 1
        assert chunk["usage"]["completion_tokens"] == counts[index]      # as vLLM's
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def _tpot_bound_client(backend, tokenizer, metrics):
    """A client of an app whose admission control holds a 100 ms TPOT SLO over decode steps of
    1 / 2 / 3 sequences: 50 / 80 / 110 ms (a third sequence would miss it); with admission control
    and the prompt lengths of the arrivals metrics saw."""
    from router.admission import AdmissionControl, AdmissionSettings
    admission = AdmissionControl(AdmissionSettings(tpot_slo_s=0.1, tpot_headroom=1.0))
    admission.observe_workers("decode", [{"decode_step_fixed_s": 0.02, "decode_s_per_seq": 0.03}])
    arrivals: list = []
    metrics.add_listener(SimpleNamespace(on_arrival=lambda prompt, max_tokens: arrivals.append(prompt),
                                         on_refusal=lambda reason: None, on_request=lambda timings: None))
    return TestClient(build_openai_app(backend, tokenizer, metrics, admission=admission)), admission, arrivals


def test_n_choices_are_admitted_together_or_not_at_all(backend, tokenizer, metrics):
    n_client, admission, arrivals = _tpot_bound_client(backend, tokenizer, metrics)
    prompt = tokenizer.encode("Hi there")
    occupying = admission.admit(5, 1)          # another request runs: the bound holds for this one's choices
    refused = n_client.post(COMPLETIONS, json={"prompt": prompt, "n": 3, "max_tokens": 1})
    assert refused.status_code == 429 and "TPOT SLO" in refused.json()["error"]["message"] and backend.calls == []
    # demand of three sequences to decode and one prompt to prefill, as admitted choices count
    assert arrivals == [len(prompt), 0, 0]
    assert (admission.waiting_requests, admission.waiting_tokens, admission.running) == (1, 5, 1)
    admission.first_token(occupying)
    admission.finished(occupying)
    assert (admission.waiting_requests, admission.waiting_tokens, admission.running) == (0, 0, 0)
    too_long = n_client.post(COMPLETIONS, json={"prompt": LONG, "n": 2, "max_tokens": 1})
    assert too_long.status_code == 400 and backend.calls == []
    assert (admission.waiting_requests, admission.waiting_tokens, admission.running) == (0, 0, 0)
    assert n_client.post(COMPLETIONS, json={"prompt": prompt, "n": 2, "max_tokens": 2}).status_code == 200
    assert len(backend.calls) == 2 and (admission.waiting_requests, admission.running) == (0, 0)
    assert arrivals[3:] == [len(prompt), 0]
    # alone on the server, all three choices are admitted (refused, no retry could ever do better)
    assert n_client.post(COMPLETIONS, json={"prompt": prompt, "n": 3, "max_tokens": 1}).status_code == 200
    assert len(backend.calls) == 5 and (admission.waiting_requests, admission.running) == (0, 0)


# --- a batch of prompts ----------------------------------------------------------

def test_a_batch_of_prompts_gives_n_choices_each_indexed_prompt_major(client, backend, tokenizer):
    # OpenAI's and vLLM's: choice p * n + j is prompt p's choice j; usage counts each prompt once
    ids = tokenizer.encode("Hi there")
    body = client.post(COMPLETIONS, json={"prompt": ["Hi", ids], "n": 2, "max_tokens": 3, "seed": 5,
                                          "echo": True, "return_token_ids": True}).json()
    text_ids = tokenizer.encode("Hi")
    assert [call[1] for call in backend.calls] == [text_ids, text_ids, ids, ids]
    assert [call[2].seed for call in backend.calls] == [5, 6, 5, 6]     # the seed moves on by the choice
    assert len({call[0] for call in backend.calls}) == 4
    reply = tokenizer.decode(backend.reply_ids[:3])
    echoed = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    assert [(c["index"], c["text"], c["prompt_token_ids"]) for c in body["choices"]] == [
        (0, "Hi" + reply, text_ids), (1, "Hi" + reply, text_ids), (2, echoed + reply, ids), (3, echoed + reply, ids)]
    assert body["usage"] == {"prompt_tokens": len(text_ids) + len(ids), "completion_tokens": 12,
                             "total_tokens": len(text_ids) + len(ids) + 12}


def test_a_streamed_batch_sends_each_prompts_choices_under_their_own_index(client, backend, tokenizer):
    prompts = ["Hi", "Hello there", "Bye"]          # echoed: each index's text starts with its own prompt
    chunks = [json.loads(e) for e in sse_events(client.post(COMPLETIONS, json={
        "prompt": prompts, "max_tokens": 4, "stream": True, "echo": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))[:-1]]
    texts, seen = {i: "" for i in range(3)}, {i: 0 for i in range(3)}
    own = [len(tokenizer.encode(p)) for p in prompts]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        index = choice["index"]
        texts[index] += choice["text"]
        seen[index] += 1
        # continuous usage: the chunk's own choice's, its own prompt counted (vLLM's)
        assert chunk["usage"] == {"prompt_tokens": own[index], "completion_tokens": seen[index],
                                  "total_tokens": own[index] + seen[index]}
    assert texts == {i: prompts[i] + tokenizer.decode(backend.reply_ids[:4]) for i in range(3)}
    assert chunks[-1]["usage"] == {"prompt_tokens": sum(own), "completion_tokens": 12,
                                   "total_tokens": sum(own) + 12}
    assert len({c["id"] for c in chunks}) == 1


def test_max_tokens_past_the_room_the_prompt_leaves_is_cut_to_it(client, backend):
    """vLLM's (0.32) rule: within the model's context, a max_tokens the prompt leaves less room for
    generates up to the context's end (OpenAI's API refuses it; clients written for vLLM send it)."""
    cut = client.post(COMPLETIONS, json={"prompt": [5] * 10, "max_tokens": 60, "min_tokens": 54})
    assert cut.status_code == 200, cut.text
    assert [(len(ids), params.max_tokens, params.min_tokens) for _, ids, params in backend.calls] == [(10, 54, 54)]
    within = client.post(COMPLETIONS, json={"prompt": [5] * 10, "max_tokens": 3})
    assert within.status_code == 200 and backend.calls[-1][2].max_tokens == 3      # room enough: as asked


def test_a_batch_with_one_bad_prompt_names_it_and_runs_none(client, backend):
    error = assert_openai_error(client.post(COMPLETIONS, json={"prompt": ["Hi", [5] * MAX_MODEL_LEN],
                                                               "max_tokens": 2}),
                                400, "prompt", "prompt 1 of the batch: This model's maximum context length is 64")
    assert error["type"] == "invalid_request_error" and backend.calls == []
    assert_openai_error(client.post(COMPLETIONS, json={"prompt": ["Hi"] * 257}), 400, "prompt",
                        "a batch of 257 prompts; this server takes at most 256")
    assert backend.calls == []


def test_the_official_client_sends_a_batch(client, tokenizer, backend):
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    completion = oai.completions.create(model=MODEL, prompt=["Hi", "Bye"], max_tokens=2)
    reply = tokenizer.decode(backend.reply_ids[:2])
    assert [(c.index, c.text) for c in completion.choices] == [(0, reply), (1, reply)]
    assert [call[1] for call in backend.calls] == [tokenizer.encode("Hi"), tokenizer.encode("Bye")]


def test_a_batch_is_admitted_whole_or_refused_whole(backend, tokenizer, metrics):
    batch_client, admission, arrivals = _tpot_bound_client(backend, tokenizer, metrics)
    first, second = tokenizer.encode("Hi there"), tokenizer.encode("Bye")
    occupying = admission.admit(5, 1)
    admission.first_token(occupying)      # it runs: its step is what a new sequence must fit beside
    refused = batch_client.post(COMPLETIONS, json={"prompt": [first, second], "n": 2, "max_tokens": 1})
    assert refused.status_code == 429 and backend.calls == []
    # every sequence's demand to decode, each prompt's to prefill once
    assert sorted(arrivals) == sorted([len(first), 0, len(second), 0])
    assert (admission.waiting_requests, admission.waiting_tokens, admission.running) == (0, 0, 1)
    admission.finished(occupying)
    # alone on the server, the batch is judged by its first prompt: all four sequences run
    assert batch_client.post(COMPLETIONS, json={"prompt": [first, second], "n": 2, "max_tokens": 1}).status_code \
        == 200
    assert len(backend.calls) == 4
    assert (admission.waiting_requests, admission.waiting_tokens, admission.running) == (0, 0, 0)
    # beside a running request the first prompt's sequence fits the TPOT budget (2 sequences, 80 ms) but the
    # second prompt's would not (3, 110 ms): the later prompts are held to the bounds too, and nothing stays
    occupying = admission.admit(5, 1)
    admission.first_token(occupying)
    refused = batch_client.post(COMPLETIONS, json={"prompt": [first, second], "max_tokens": 1})
    assert refused.status_code == 429 and "TPOT SLO" in refused.json()["error"]["message"]
    assert len(backend.calls) == 4
    assert (admission.waiting_requests, admission.waiting_tokens, admission.running) == (0, 0, 1)


# --- client disconnects ----------------------------------------------------------

async def _post_then_disconnect(app, path: str, body: dict, backend: FakeBackend) -> list[dict]:
    """Send one request over raw ASGI; disconnect once the backend blocks. Returns what the app sent."""
    messages: list[dict] = []
    request = {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
    requests = [request]

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await backend.hanging.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        messages.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")],
             "client": ("127.0.0.1", 1234), "server": ("testserver", 80)}
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return messages


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("hang_after", [0, 3])
def test_client_disconnect_closes_the_backend_stream(app, backend, metrics, stream, hang_after):
    backend.hang_after = hang_after
    sent = asyncio.run(_post_then_disconnect(app, CHAT, {"messages": USER, "stream": stream},
                                             backend))
    [(request_id, _, _)] = backend.calls
    assert backend.closed_early == [request_id]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    if stream and hang_after:  # the stream had started: what came before the hang went out
        events = body.decode().split("\n\n")[:-1]
        deltas = [json.loads(e[len("data: "):])["choices"][0]["delta"] for e in events]
        assert sent[0]["status"] == 200
        assert "".join(d.get("content", "") for d in deltas) == "Hello"
    else:
        assert sent[0]["status"] == 499
    exposition = metrics.render()[0]
    assert b'pdserve_requests_total{finish_reason="abort"} 1.0' in exposition
    assert b"pdserve_e2e_request_latency_seconds_count 0.0" in exposition  # cut off: no latency


def _scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")],
            "client": ("127.0.0.1", 1234), "server": ("testserver", 80)}


@pytest.mark.parametrize("disconnect_seen_too", [False, True])
def test_a_handler_cancelled_as_its_client_left_aborts_the_request(app, backend, metrics, caplog,
                                                                    disconnect_seen_too):
    """Serve cancels the handler of a client that left. The request counts as
    aborted, not as an error; and when the disconnect watcher has already begun
    cancelling the backend stream, which takes a while to unwind, the handler's
    own cancellation must not close that stream while it is still running."""
    unwinding = asyncio.Event()

    async def slow_to_unwind(request_id, prompt_token_ids, params):
        backend.calls.append((request_id, list(prompt_token_ids), params))
        try:
            backend.hanging.set()
            await asyncio.Event().wait()
            yield
        finally:
            unwinding.set()
            await asyncio.sleep(0.05)      # a remote stream's cancellation takes a round trip
            backend.closed_early.append(request_id)

    backend.generate = slow_to_unwind

    async def run() -> None:
        requests = [{"type": "http.request", "body": json.dumps({"messages": USER}).encode(), "more_body": False}]

        async def receive() -> dict:
            if requests:
                return requests.pop()
            await backend.hanging.wait()
            if disconnect_seen_too:
                return {"type": "http.disconnect"}
            await asyncio.Event().wait()

        async def send(message: dict) -> None:
            pass

        handler = asyncio.ensure_future(app(_scope(CHAT), receive, send))
        await (unwinding if disconnect_seen_too else backend.hanging).wait()
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(handler, timeout=10)

    with caplog.at_level("ERROR"):
        asyncio.run(run())
    [(request_id, _, _)] = backend.calls
    assert backend.closed_early == [request_id]
    assert b'pdserve_requests_total{finish_reason="abort"} 1.0' in metrics.render()[0]
    assert not [r for r in caplog.records if "closing the backend stream" in r.getMessage()]


def test_continue_final_message_renders_the_assistants_turn_open(client, backend, tokenizer):
    messages = USER + [{"role": "assistant", "content": "The answer is"}]
    r = client.post(CHAT, json={"messages": messages, "continue_final_message": True,
                                "add_generation_prompt": False, "max_tokens": 2})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(backend.calls[0][1])
    assert prompt.endswith("The answer is"), prompt          # no end-of-turn after it: the reply continues it
    closed = client.post(CHAT, json={"messages": messages, "add_generation_prompt": False, "max_tokens": 2})
    assert closed.status_code == 200 and not tokenizer.decode(backend.calls[1][1]).endswith("The answer is")


def test_long_text_is_tokenized_off_the_event_loop(client, backend, monkeypatch):
    import asyncio

    import router.openai_api as api

    on_loop = []
    server_tokenizer = backend.tokenizer
    encode = server_tokenizer.encode

    def recording_encode(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return encode(*args, **kwargs)

    monkeypatch.setattr(server_tokenizer, "encode", recording_encode)
    monkeypatch.setattr(api, "_INLINE_TOKENIZE_CHARS", 10)
    assert client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}).status_code == 200
    assert client.post(COMPLETIONS, json={"prompt": "Hi there, a longer one", "max_tokens": 1}).status_code == 200
    assert on_loop == [True, False]
    assert backend.calls[1][1] == encode("Hi there, a longer one")


def test_many_short_chat_messages_are_rendered_off_the_event_loop(client, backend, monkeypatch):
    """Empty messages carry no text but each costs its template's rendering: they
    count towards the rule that keeps long work off the loop every stream shares."""
    import router.openai_api as api

    rendered = []
    template = backend.tokenizer.apply_chat_template

    def recording_template(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            rendered.append("on the loop")
        except RuntimeError:
            rendered.append("off the loop")
        return template(*args, **kwargs)

    monkeypatch.setattr(backend.tokenizer, "apply_chat_template", recording_template)
    longest = max(len(token) for token in backend.tokenizer.get_vocab())
    monkeypatch.setattr(api, "_INLINE_TOKENIZE_CHARS", 4 * longest)
    for count in (2, 6):
        r = client.post(CHAT, json={"messages": [{"role": "user", "content": ""}] * count, "max_tokens": 1})
        assert r.status_code == 200, r.text
    assert rendered == ["on the loop", "off the loop"]


def test_a_stream_whose_first_send_fails_is_still_cleaned_up(app, backend, metrics):
    """The server may report a vanished client by raising from the response's
    first send, before the event generator ever ran: the request must still be
    closed (its backend stream, admission's counts, its metrics)."""
    async def run() -> None:
        requests = [{"type": "http.request", "body": json.dumps({"messages": USER, "stream": True}).encode(),
                     "more_body": False}]

        async def receive() -> dict:
            if requests:
                return requests.pop()
            await asyncio.Event().wait()

        async def send(message: dict) -> None:
            raise OSError("the client is gone")

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")],
                 "client": ("127.0.0.1", 1234), "server": ("testserver", 80)}
        await asyncio.wait_for(app(scope, receive, send), timeout=10)

    asyncio.run(run())
    [(request_id, _, _)] = backend.calls
    assert backend.closed_early == [request_id]
    assert b'pdserve_requests_total{finish_reason="abort"} 1.0' in metrics.render()[0]


def test_a_stream_that_ends_before_any_output_is_an_http_error_not_a_200(client, backend):
    async def no_outputs(request_id, prompt_token_ids, params):
        backend.calls.append((request_id, list(prompt_token_ids), params))
        return
        yield

    backend.generate = no_outputs
    response = client.post(CHAT, json={"messages": USER, "stream": True})
    assert response.status_code == 503
    assert "ended before its first output" in response.json()["error"]["message"]


def test_a_model_without_a_chat_template_says_so_instead_of_blaming_the_messages(tokenizer):
    import copy
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    app = build_openai_app(FakeBackend(bare, len(bare)), bare, ServingMetrics())
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post(CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "has no chat template" in error["message"] and "/v1/completions" in error["message"]
        assert error["param"] is None
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_requests_not_served_are_logged_with_their_cause_but_not_one_line_each(monkeypatch, caplog):
    # while no worker can serve, every request fails alike: a warning each buried the log
    from router import errors
    now = [100.0]
    monkeypatch.setattr(errors, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(errors, "_UNSERVED_LOG", errors.SpacedLog(errors.log, every_s=10.0))
    with caplog.at_level("WARNING", logger="router.errors"):
        for i in range(5):
            errors.from_exception(BackendUnavailableError(f"the decode worker is unavailable: actor {i} died"))
        now[0] += 11
        errors.from_exception(BackendUnavailableError("the decode worker is unavailable: actor 5 died"))
    assert [r.getMessage() for r in caplog.records] == [
        "request not served: the decode worker is unavailable: actor 0 died",
        "request not served: the decode worker is unavailable: actor 5 died (and 4 more like it since the last "
        "logged)"]
