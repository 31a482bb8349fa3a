"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

`send_request` posts to /v1/completions or /v1/chat/completions with
`"stream": true` and `stream_options.include_usage`, reads the server-sent
events (`data: {json}` lines, ending with `data: [DONE]`) and fills in a
RequestRecord as it goes, so a request cancelled mid-stream keeps what was
measured up to then.

Contracts:
- It never raises for anything the server or the network does: an HTTP error,
  an `{"error": ...}` event, a stream cut off before it finished (no `[DONE]`
  and no `finish_reason`), a response with no output chunk, a timeout or a
  refused connection each end the request with `record.error` set. Only
  cancellation propagates.
- Every chunk with a choice is output, as in vLLM's client, its text empty or
  not: the last one of an output that ends with EOS carries no text but is
  that token's step. The exception is a chat stream's opening chunk, which
  carries only the assistant role. A chunk's arrival time is when the bytes
  holding it were read.
- With `api_key`, requests carry `Authorization: Bearer KEY`.
- Output tokens are counted, in order of preference, from the server's usage
  (`completion_tokens` of the include_usage chunk), by the given tokenizer on
  the output text, or as the number of output chunks; `token_count_method`
  says which ("usage", "tokenizer" or "chunks").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.loadtest.datasets import SampleRequest

# Enough of an error body to say what went wrong without flooding the report.
_MAX_ERROR_CHARS = 300


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are `time.perf_counter()` seconds.

    `chunk_times[i]` is when the i-th output chunk arrived; the first is the
    first token. `succeeded` holds only for a request that got an output chunk
    and a complete stream.
    """

    index: int
    prompt_len: int
    expected_output_len: int
    scheduled_offset: float = 0.0          # when the arrival process meant to send it, s after the start
    send_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    end_time: float | None = None
    output_tokens: int | None = None
    token_count_method: str | None = None  # "usage" | "tokenizer" | "chunks"
    usage_prompt_tokens: int | None = None
    status: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    succeeded: bool = False
    unfinished: bool = False               # still running when the run stopped (time limit, Ctrl-C)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def input_tokens(self) -> int:
        """The prompt's tokens as the server counted them (its usage: a chat template's
        and BOS tokens included), else as the dataset sized it."""
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_len


def build_payload(request: SampleRequest, *, model: str, chat: bool, temperature: float,
                  ignore_eos: bool) -> dict[str, Any]:
    """The JSON body for `request`; max_tokens is its expected output length."""
    payload: dict[str, Any] = {"model": model, "max_tokens": request.expected_output_len,
                               "temperature": temperature, "stream": True,
                               "stream_options": {"include_usage": True}}
    if chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    if ignore_eos:
        # A vLLM extension; sent only when asked so servers without it are not confused.
        payload["ignore_eos"] = True
    return payload


# a request the server cut off: vLLM's (and pdserve's) "abort", and "error" (vLLM's for a request
# the engine failed)
FAILED_FINISH_REASONS = frozenset({"abort", "error"})


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                       record: RequestRecord, *, chat: bool, timeout_s: float,
                       tokenizer: Any = None, api_key: str | None = None) -> None:
    """Send one streaming request and record its timings in `record` (see the module contract)."""
    record.send_time = time.perf_counter()
    try:
        done = await _stream(session, url, payload, record, chat, timeout_s, auth_headers(api_key))
    except (asyncio.TimeoutError, TimeoutError):
        if not _output_finished(record):
            record.error = f"timed out after {timeout_s:g} s (--request-timeout)"
    except aiohttp.ClientError as exc:
        if not _output_finished(record):   # a connection cut after the last output chunk: complete
            record.error = f"{type(exc).__name__}: {exc}"
    except ValueError as exc:  # bad JSON in an event
        record.error = f"malformed stream event: {exc}"
    except Exception as exc:  # noqa: BLE001 - one broken request must not end the run
        record.error = f"{type(exc).__name__}: {exc}"
    else:
        if record.error is None:
            if not done and record.finish_reason is None:
                record.error = "the stream ended before the output finished (no finish_reason, no data: [DONE])"
            elif record.finish_reason in FAILED_FINISH_REASONS:
                record.error = f"the server ended the request with finish_reason {record.finish_reason!r}"
            elif not record.chunk_times:
                record.error = "the response carried no output chunk (no first token to time)"
    record.end_time = time.perf_counter()
    if record.error is None:
        record.succeeded = True
        _count_tokens(record, tokenizer)


def _output_finished(record: RequestRecord) -> bool:
    """The stream carried output and its finish_reason (one that is no failure)."""
    return bool(record.chunk_times) and record.finish_reason is not None and \
        record.finish_reason not in FAILED_FINISH_REASONS


async def _stream(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                  record: RequestRecord, chat: bool, timeout_s: float, headers: dict[str, str]) -> bool:
    """Read the response into `record`; True when it ended with [DONE]."""
    async with session.post(url, json=payload, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        record.status = resp.status
        if resp.status != 200:
            record.error = f"HTTP {resp.status}: {_error_message(await resp.text())}"
            return False
        if resp.content_type == "application/json":    # a server that ignored stream: true, or an error
            record.error = f"HTTP 200 with a JSON body, not an event stream: {_error_message(await resp.text())}"
            return False
        async for arrival, data in _sse_data(resp):
            if data == "[DONE]":
                return True
            event = json.loads(data)
            if not isinstance(event, dict):
                raise ValueError(f"expected a JSON object, got {data[:80]!r}")
            if event.get("error"):    # (a chunk may carry "error": null)
                record.error = f"stream error: {_error_message(data)}"
                return False
            usage = event.get("usage")
            if isinstance(usage, dict):
                record.output_tokens = usage.get("completion_tokens")
                record.usage_prompt_tokens = usage.get("prompt_tokens")
            choice = _output_choice(event, chat)
            if choice is not None:
                record.chunk_times.append(arrival)
                record.pieces.append(_choice_text(choice, chat))
                if isinstance(choice.get("finish_reason"), str):
                    record.finish_reason = choice["finish_reason"]
    return False


async def _sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, payload) of each `data:` line, in order."""
    buffer = b""
    async for block in resp.content.iter_any():
        # All events in one read arrived together: they share its timestamp.
        arrival = time.perf_counter()
        buffer += block
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                yield arrival, line[5:].strip().decode("utf-8", errors="replace")
    tail = buffer.strip()      # a last line with no newline: the body ended at EOF
    if tail.startswith(b"data:"):
        data = tail[5:].strip().decode("utf-8", errors="replace")
        if data != "[DONE]" and not _is_json(data):
            # cut inside an event: judged as any cut stream (complete if its output was)
            raise aiohttp.ClientPayloadError("the response ended inside a stream event")
        yield time.perf_counter(), data


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _output_choice(event: dict[str, Any], chat: bool) -> dict[str, Any] | None:
    """The chunk's first choice when it is output (module contract), else None."""
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if chat and choice.get("finish_reason") is None:
        delta = choice.get("delta")
        if isinstance(delta, dict) and "role" in delta and \
                all(value in (None, "", []) for key, value in delta.items() if key != "role"):
            # the opening chunk: {"role": "assistant", "content": ""}, maybe with empty fields
            # beside it ("refusal": null, as OpenAI's and some other servers' carry)
            return None
    return choice


def _choice_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
    else:
        text = choice.get("text")
    return text if isinstance(text, str) else ""


def _count_tokens(record: RequestRecord, tokenizer: Any) -> None:
    if isinstance(record.output_tokens, int) and record.output_tokens > 0:
        record.token_count_method = "usage"
    elif tokenizer is not None:
        record.output_tokens = len(tokenizer.encode(record.text, add_special_tokens=False))
        record.token_count_method = "tokenizer"
    else:
        record.output_tokens = len(record.chunk_times)
        record.token_count_method = "chunks"


def _error_message(body: str) -> str:
    """The `error.message` (or FastAPI `detail`) of a JSON error body, else the body itself."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    message: Any = body
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and "message" in error:
            message = error["message"]
        elif isinstance(error, str):
            message = error
        elif "detail" in parsed:
            message = parsed["detail"]
    text = message if isinstance(message, str) else json.dumps(message)
    text = " ".join(text.split())
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


class Unauthorized(ValueError):
    """The server asks for an API key (HTTP 401)."""


async def fetch_models(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 10.0,
                       api_key: str | None = None) -> list[dict]:
    """The model cards of GET {base_url}/v1/models.

    Raises aiohttp.ClientError or TimeoutError when the server cannot be
    reached, Unauthorized when it wants a (different) API key, ValueError when
    it answers with something that is not a model list.
    """
    url = base_url.rstrip("/") + "/v1/models"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(url, headers=auth_headers(api_key), timeout=timeout) as resp:
        body = await resp.text()
        if resp.status == 401:
            raise Unauthorized(f"GET {url} answered HTTP 401: {_error_message(body)}")
        if resp.status != 200:
            raise ValueError(f"GET {url} answered HTTP {resp.status}: {_error_message(body)}")
    try:
        cards = json.loads(body)["data"]
    except (ValueError, KeyError, TypeError):
        cards = None
    if not isinstance(cards, list):
        raise ValueError(f"GET {url} did not return an OpenAI model list: {body[:200]!r}")
    return [c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]


def metrics_text(base_url: str, timeout_s: float = 10.0, api_key: str | None = None) -> str:
    """GET {base_url}/metrics: the Prometheus text."""
    import urllib.request
    request = urllib.request.Request(base_url.rstrip("/") + "/metrics", headers=auth_headers(api_key))
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return reply.read().decode()


def scrape_metrics(base_url: str, timeout_s: float = 10.0, api_key: str | None = None) -> dict[str, float]:
    """The unlabelled samples of GET {base_url}/metrics (Prometheus text), by name:
    counters, and histograms' `_sum` and `_count`."""
    samples = {}
    for line in metrics_text(base_url, timeout_s, api_key).splitlines():
        name, _, value = line.partition(" ")
        if name and not name.startswith("#") and "{" not in name:
            samples[name] = float(value.split()[0])
    return samples
