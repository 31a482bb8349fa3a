"""The API key, the body limit and the per-request limits at the HTTP API."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from cluster.cli.main import build_parser
from cluster.cli.serve_command import config_from_args
from cluster.config import DeploymentConfig
from cluster.transport.transport_factory import TransportSettings
from router.http_guard import api_key_digest
from router.metrics import ServingMetrics
from router.openai_api import RequestLimits, build_openai_app
from tests.test_openai_api import MODEL, FakeBackend

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def tokenizer():
    from engine.tiny_model import ensure_default_model
    from engine.tokenizer import load_tokenizer
    return load_tokenizer(ensure_default_model())


def client_for(tokenizer, **options) -> tuple[TestClient, FakeBackend]:
    backend = FakeBackend(tokenizer, len(tokenizer))
    app = build_openai_app(backend, tokenizer, ServingMetrics(), **options)
    return TestClient(app, raise_server_exceptions=False), backend


def completion(client, headers=None, **body):
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, **body},
                       headers=headers or {})


def test_every_route_but_health_needs_the_key(tokenizer):
    client, backend = client_for(tokenizer, api_key_sha256=api_key_digest(KEY))
    good = {"Authorization": f"Bearer {KEY}"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        r = completion(client, headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key" and set(r.json()["error"]) == {
            "message", "type", "param", "code"}
    assert backend.calls == []                                   # refused before the backend
    assert client.get("/v1/models").status_code == 401
    assert client.get("/metrics").status_code == 401
    assert client.get("/health").status_code == 200
    assert client.head("/health").status_code == 200
    assert client.post("/health").status_code == 401           # a probe's methods only (was: 405, unkeyed)
    # every route the app has, every method, the key's: only a probe of /health goes without
    for route in client.app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            path = route.path.replace("{model:path}", MODEL)
            if path == "/health" and method in ("GET", "HEAD"):
                continue
            assert client.request(method, path).status_code == 401, (method, path)
    assert completion(client, good).status_code == 200
    assert client.get("/metrics", headers=good).status_code == 200
    r = client.post("/v1/chat/completions", headers=good,
                    json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200


def test_metrics_can_stay_open_and_no_key_means_no_check(tokenizer):
    client, _ = client_for(tokenizer, api_key_sha256=api_key_digest(KEY), protect_metrics=False)
    assert client.get("/metrics").status_code == 200
    assert completion(client).status_code == 401
    client, _ = client_for(tokenizer)
    assert completion(client).status_code == 200


def test_refusals_here_are_counted_by_status(tokenizer):
    metrics = ServingMetrics()
    backend = FakeBackend(tokenizer, len(tokenizer))
    client = TestClient(build_openai_app(backend, tokenizer, metrics, api_key_sha256=api_key_digest(KEY),
                                         limits=RequestLimits(max_body_bytes=2048)), raise_server_exceptions=False)
    good = {"Authorization": f"Bearer {KEY}"}
    assert completion(client).status_code == 401
    assert completion(client, good, prompt="x " * 2000).status_code == 413
    assert completion(client, good, n=0).status_code == 400
    text = metrics.render()[0].decode()
    for status in (400, 401, 413):
        assert f'pdserve_request_errors_total{{status="{status}"}} 1.0' in text, text


def test_a_body_past_the_limit_gets_413(tokenizer):
    client, backend = client_for(tokenizer, limits=RequestLimits(max_body_bytes=2048))
    r = completion(client, prompt="x " * 2000)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert backend.calls == []

    def chunks():                                                # no Content-Length: counted as read
        yield json.dumps({"model": MODEL, "prompt": "y " * 3000, "max_tokens": 2}).encode()

    r = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert completion(client, prompt="short").status_code == 200


def test_request_limits_give_400s_naming_the_field(tokenizer):
    client, backend = client_for(tokenizer, limits=RequestLimits(max_prompt_tokens=8, max_tokens=5,
                                                                 max_logprobs=2, max_stop_sequences=2))
    cases = [({"max_tokens": 6}, "max_tokens", "at most 5"),
             ({"logprobs": 3}, "logprobs", "at most 2"),
             ({"stop": ["a", "b", "c"]}, "stop", "at most 2"),
             ({"prompt": "one two three four five six seven eight nine ten"}, "prompt", "at most 8")]
    for body, param, text in cases:
        r = completion(client, **body)
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] == param and text in r.json()["error"]["message"], r.json()
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                  "logprobs": True, "top_logprobs": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert completion(client, max_tokens=5, logprobs=2, stop=["a", "b"]).status_code == 200
    # an unset max_tokens is capped by the limit, not refused
    assert completion(client, max_tokens=None).status_code == 200
    assert backend.calls[-1][2].max_tokens == 5


def test_a_prompt_far_past_max_prompt_tokens_is_refused_before_tokenizing(tokenizer, monkeypatch):
    client, backend = client_for(tokenizer, limits=RequestLimits(max_prompt_tokens=8))
    from router import openai_api
    server_tokenized = []
    original = openai_api._Server._tokenize_text

    def counting(self, body):
        server_tokenized.append(1)
        return original(self, body)
    monkeypatch.setattr(openai_api._Server, "_tokenize_text", counting)
    # 8 tokens of the tiny tokenizer spell at most a few hundred characters; the context could take far more
    r = completion(client, prompt="x" * 100_000)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "far more than the 8 tokens this server accepts" in r.json()["error"]["message"]
    assert server_tokenized == [] and backend.calls == []
    r = completion(client, prompt="one two three four five six seven eight nine ten")   # near it: tokenized
    assert r.status_code == 400 and "at most 8" in r.json()["error"]["message"] and server_tokenized


def test_a_stop_string_past_max_stop_chars_is_a_400(tokenizer):
    client, backend = client_for(tokenizer, limits=RequestLimits(max_stop_chars=64))
    r = completion(client, stop=["ok", "y" * 65])
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert "65 characters" in r.json()["error"]["message"] and "at most 64" in r.json()["error"]["message"]
    assert completion(client, stop="y" * 64).status_code == 200


def test_odd_paths_and_headers_get_4xx_not_500(tokenizer):
    client, _ = client_for(tokenizer)
    r = client.get("/v1/models/")           # an empty name passed the served-model check, then no card
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    for kind in (["text"], {"a": 1}):        # unhashable part types (a dict lookup raised TypeError)
        body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": kind, "text": "hi"}]}]}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "only text content parts" in r.json()["error"]["message"], r.text
        assert client.post("/tokenize", json=body).status_code == 400


def test_a_content_length_of_unicode_digits_is_no_crash():
    import asyncio

    from router.http_guard import HttpGuard
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
    guard = HttpGuard(app, max_body_bytes=1 << 20)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "",
             "headers": [(b"content-length", "²".encode("latin-1"))]}
    messages = iter([{"type": "http.request", "body": b"{}", "more_body": False}])

    async def receive():
        return next(messages)
    asyncio.run(guard(scope, receive, lambda message: asyncio.sleep(0)))
    assert reached == ["/v1/completions"]       # ("²".isdigit() is true; int("²") raised)


def test_a_body_that_stops_arriving_gets_408(monkeypatch):
    import asyncio

    from router import http_guard
    monkeypatch.setattr(http_guard, "BODY_READ_GAP_S", 0.05)
    reached, sent = [], []
    guard = http_guard.HttpGuard(lambda *args: reached.append(args), max_body_bytes=1 << 20)
    parts = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}]

    async def receive():
        if parts:
            return parts.pop()
        await asyncio.Event().wait()          # the client sends nothing more, and stays

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(asyncio.wait_for(guard(scope, receive, send), 30))
    assert sent[0]["status"] == 408 and not reached
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_timeout"

    # a body that keeps coming, however slowly (every part within the gap), is read whole
    monkeypatch.setattr(http_guard, "BODY_READ_GAP_S", 5.0)
    parts[:] = [{"type": "http.request", "body": body, "more_body": more}      # (popped from the end)
                for body, more in ((b"}", False), (b'"Hi"', True), (b'{"prompt": ', True))]

    async def slow_receive():
        await asyncio.sleep(0.03)                # far under the gap each time
        return parts.pop()
    sent.clear()

    async def app(scope, receive, send):
        reached.append((await receive())["body"])
    guard = http_guard.HttpGuard(app, max_body_bytes=1 << 20)
    asyncio.run(asyncio.wait_for(guard(scope, slow_receive, send), 30))
    assert reached == [b'{"prompt": "Hi"}'] and not sent


def test_logprob_entries_are_limited_in_all_as_they_multiply(tokenizer):
    # each field within its own limit; together 2 prompts x n 2 x 10 tokens x (4 + 1) = 200 entries of output
    client, backend = client_for(tokenizer, limits=RequestLimits(max_logprob_entries=199))
    prompt = [[5, 6, 7, 8], [9, 10, 11, 12]]
    r = completion(client, prompt=prompt, n=2, max_tokens=10, logprobs=4)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.json()
    assert "200 logprob entries" in r.json()["error"]["message"] and not backend.calls
    assert completion(client, prompt=prompt, n=2, max_tokens=10, logprobs=3).status_code == 200   # 160
    # a prompt's, repeated for each choice: 2 x 2 x 4 tokens x (20 + 1) = 336
    r = completion(client, prompt=prompt, n=2, max_tokens=1, prompt_logprobs=20)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.json()
    r = completion(client, prompt=prompt, n=2, max_tokens=1, echo=True, logprobs=20)    # echo scores the prompt
    assert r.status_code == 400 and "logprob entries" in r.json()["error"]["message"], r.json()
    assert completion(client, prompt=prompt, n=2, max_tokens=1, prompt_logprobs=10).status_code == 200   # 176
    # a stream's output goes out chunk by chunk: its entries are not held at once
    assert completion(client, prompt=prompt, n=2, max_tokens=10, logprobs=4, stream=True).status_code == 200
    # a max_tokens past the context's room counts the room (64-token context: ~55 tokens x 4 choices x (2 + 1)
    # > 199); a chat that asks for no bound is served, as vLLM and OpenAI serve it (on a long-context model
    # its room alone would refuse every chat with logprobs), each choice ending where the limit does:
    # 199 // (4 x 3) = 16 tokens
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 4, "logprobs": True,
            "top_logprobs": 2}
    r = client.post("/v1/chat/completions", json={**chat, "max_tokens": 60})
    assert r.status_code == 400 and "logprob entries" in r.json()["error"]["message"], r.json()
    calls = len(backend.calls)
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert [params.max_tokens for _, _, params in backend.calls[calls:]] == [16] * 4
    assert [params.seed for _, _, params in backend.calls[calls:]] == [None] * 4
    calls = len(backend.calls)
    assert client.post("/v1/chat/completions", json={**chat, "n": 1, "stream": True}).status_code == 200
    assert backend.calls[calls][2].max_tokens > 16       # a stream's entries go out as they come: not bounded
    r = client.post("/v1/chat/completions", json={**chat, "n": 16, "top_logprobs": 20})  # 16 x 21 > 199 a token
    assert r.status_code == 400 and "logprob entries" in r.json()["error"]["message"], r.json()
    assert completion(client, prompt=[5, 6, 7, 8], n=4, max_tokens=63, logprobs=2).status_code == 400
    assert completion(client, prompt=[5, 6, 7, 8], n=4, max_tokens=16, logprobs=2).status_code == 200   # 192


def test_the_key_reaches_the_deployment_only_as_its_digest(monkeypatch):
    args = build_parser().parse_args(["serve", "--api-key", KEY])
    config = config_from_args(args)
    assert config.http.api_key_sha256 == api_key_digest(KEY)
    assert KEY not in json.dumps(config.model_dump(mode="json"))
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert config_from_args(build_parser().parse_args(["serve"])).api_key_sha256() == api_key_digest("from-env")
    monkeypatch.delenv("PDSERVE_API_KEY")
    config = DeploymentConfig.model_validate({"http": {"api_key_env": "MY_KEY"}})
    with pytest.raises(ValueError, match="MY_KEY, which is not set"):
        config.api_key_sha256()
    monkeypatch.setenv("MY_KEY", KEY)
    assert config.api_key_sha256() == api_key_digest(KEY)
    assert DeploymentConfig().api_key_sha256() is None


@pytest.mark.parametrize("key", ["sk-abc ", "sk-abc\r", " sk-abc", "ключ-sk", "sk\tabc"])
def test_a_key_no_client_could_send_is_refused_wherever_it_comes_from(monkeypatch, key):
    # HTTP drops the whitespace around a header's value and carries bytes: such a key locked every client out
    from cluster.config import ConfigFileError
    with pytest.raises(ConfigFileError, match="--api-key: the API key"):
        config_from_args(build_parser().parse_args(["serve", "--api-key", key]))
    monkeypatch.setenv("PDSERVE_API_KEY", key)
    with pytest.raises(ConfigFileError, match="PDSERVE_API_KEY: the API key"):
        config_from_args(build_parser().parse_args(["serve"]))
    monkeypatch.delenv("PDSERVE_API_KEY")
    monkeypatch.setenv("MY_KEY", key)
    with pytest.raises(ValueError, match="http.api_key_env names: the API key"):
        DeploymentConfig.model_validate({"http": {"api_key_env": "MY_KEY"}}).api_key_sha256()


def test_a_key_with_inner_spaces_and_punctuation_is_served(tokenizer):
    key = "sk proj_AZaz09-!~"
    config = config_from_args(build_parser().parse_args(["serve", "--api-key", key]))
    client, _ = client_for(tokenizer, api_key_sha256=config.http.api_key_sha256)
    assert completion(client, {"Authorization": f"Bearer {key}"}).status_code == 200


def test_the_kv_transfer_secret_comes_from_the_named_variable_or_is_random(monkeypatch):
    made = {DeploymentConfig().kv_transfer_secret() for _ in range(2)}
    assert len(made) == 2 and all(len(s) == 64 for s in made)   # 32 random bytes; no Ray cluster to keep them
    config = DeploymentConfig.model_validate({"kv_transfer": {"secret_env": "KV_SECRET"}})
    monkeypatch.delenv("KV_SECRET", raising=False)
    with pytest.raises(ValueError, match="KV_SECRET, which is not set"):
        config.kv_transfer_secret()
    monkeypatch.setenv("KV_SECRET", "shared-by-every-node")
    assert config.kv_transfer_secret() == "shared-by-every-node"
    assert "shared-by-every-node" not in repr(TransportSettings(secret=config.kv_transfer_secret()))


PAGE = "https://chat.example.com"


def _preflight(client, origin: str):
    return client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_lets_listed_pages_call_the_api_with_the_key_and_read_its_errors(tokenizer):
    from router.cors import CorsSettings
    client, backend = client_for(tokenizer, api_key_sha256=api_key_digest(KEY), cors=CorsSettings((PAGE,)))
    r = _preflight(client, PAGE)                   # browsers send no key with a preflight
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = completion(client, {"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
    r = completion(client, {"Origin": PAGE})       # the page can read why it was refused
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == PAGE
    # and the headers past CORS's safelisted ones that it needs: a 429's Retry-After, the request's id
    exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
    assert {"retry-after", "x-request-id"} <= exposed
    backend.fail_after, backend.failure = 0, RuntimeError("a bug")   # and why it failed
    r = completion(client, {"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert r.headers["access-control-allow-origin"] == PAGE
    backend.fail_after = None
    other = _preflight(client, "https://evil.example.com")
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # in OpenAI's error format, saying what was refused and where the origins are set
    error = other.json()["error"]
    assert error["code"] == "cors_refused" and error["type"] == "invalid_request_error"
    assert "(origin)" in error["message"] and "allowed_origins" in error["message"]
    unserved = client.options("/v1/chat/completions", headers={"Origin": PAGE,
                                                               "Access-Control-Request-Method": "DELETE"})
    assert unserved.status_code == 400 and "(method)" in unserved.json()["error"]["message"]
    assert unserved.headers["access-control-allow-origin"] == PAGE     # the page may read why
    # CORS is no access control (the key is): the server answers, the browser keeps it from the page
    r = completion(client, {"Origin": "https://evil.example.com", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert "access-control-allow-credentials" not in r.headers


def test_without_allowed_origins_no_response_carries_cors_headers(tokenizer):
    client, _ = client_for(tokenizer)
    assert "access-control-allow-origin" not in _preflight(client, PAGE).headers
    r = completion(client, {"Origin": PAGE})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_settings_from_flags_and_the_file_and_their_errors():
    args = build_parser().parse_args(["serve", "--allowed-origins", PAGE, "http://localhost:3000",
                                      "--allow-credentials"])
    http = config_from_args(args).http
    assert http.allowed_origins == [PAGE, "http://localhost:3000"] and http.allow_credentials
    assert DeploymentConfig.model_validate({}).http.allowed_origins == []
    ok = ["http://localhost:3000", "https://[::1]:8443", "http://10.0.0.7"]
    assert DeploymentConfig.model_validate({"http": {"allowed_origins": ok}}).http.allowed_origins == ok
    for origins, credentials, fragment in ((["*"], True, "list the origins one by one"),
                                           ([PAGE + "/"], False, "no path, query or trailing slash"),
                                           (["chat.example.com"], False, r"give scheme://host\[:port\]"),
                                           (["https://Chat.example.com"], False, "in lower case"),
                                           (["https://a.com?x"], False, "no path, query"),
                                           (["https://user:pw@a.com"], False, "not an origin"),
                                           (["https://a.com:443"], False, "drop the port"),
                                           ([], True, "does nothing without allowed_origins")):
        with pytest.raises(ValueError, match=fragment):
            DeploymentConfig.model_validate({"http": {"allowed_origins": origins, "allow_credentials": credentials}})


def test_the_application_passes_the_cors_settings_to_the_router():
    from cluster.app_builder import build_app
    from router.cors import CorsSettings
    app = build_app({"mode": "colocated", "http.allowed_origins": [PAGE]})
    assert app._bound_deployment.init_kwargs["cors"] == CorsSettings((PAGE,), False)
    assert build_app({"mode": "colocated"})._bound_deployment.init_kwargs["cors"] is None


def test_the_open_routes_stay_open_under_a_route_prefix(tokenizer):
    # `serve deploy` with route_prefix /llm: Serve's proxy keeps the full path and sets root_path
    backend = FakeBackend(tokenizer, len(tokenizer))
    app = build_openai_app(backend, tokenizer, ServingMetrics(), api_key_sha256=api_key_digest(KEY),
                           protect_metrics=False)
    client = TestClient(app, raise_server_exceptions=False, root_path="/llm")
    assert client.get("/llm/health").status_code == 200
    assert client.get("/llm/metrics").status_code == 200
    assert client.get("/llm/v1/models").status_code == 401
    assert client.get("/llm/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
