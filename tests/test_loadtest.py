"""`pdserve loadtest` against a fake OpenAI server with injected latencies.

The fake server (an aiohttp app on a background thread) streams each response
on a schedule the prompt dictates: a prompt "FAKE ttft=50 itl=10 n=8" gets its
first chunk 50 ms after the request arrived and one more every 10 ms, each
chunk one token, scheduled against the arrival time so delays do not pile up.
`fail=500|400` answers with that HTTP error, `fail=stream_error` sends an
error event mid-stream, `fail=abort` drops the connection mid-stream, `usage=0`
leaves out the usage chunk, `eos=1` ends the output with EOS (one more step:
a chunk with no text and finish_reason "stop", counted in the usage),
`finish=REASON` ends it with that finish_reason, `done=0` leaves out `data:
[DONE]`, `reset=1` cuts the connection after the last output chunk,
`error_null=1` adds `"error": null` to each output chunk, and
`eof_cut=usage|output` sends a body that ends at EOF (no chunked encoding)
inside the usage event or the last output event. Other prompts (the CLI's
datasets) get the defaults. With `api_key` the server answers 401 to
requests without that key.
The server notes when it wrote each output chunk (`sent`), so timings are
checked against what it actually did; injected-latency checks leave LATE_S for
a loaded two-core machine; the metric arithmetic itself is checked exactly on
synthetic records.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import socket
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from aiohttp import web

import bench.loadtest.arrivals as arrivals_module
import bench.loadtest.runner as runner_module
from bench.loadtest.arrivals import arrival_offsets, paced
from bench.loadtest.client import RequestRecord
from bench.loadtest.datasets import (
    DatasetError,
    SampleRequest,
    length_range,
    prefix_dataset,
    random_dataset,
    sharegpt_dataset,
)
from bench.loadtest.metrics import meets_slos, percentile, summarize, tpot, ttft
from bench.loadtest.report import build_result, format_table, vllm_json
from bench.loadtest.runner import RunConfig, run_benchmark, run_cancellable
from bench.loadtest.sweep import format_sweep_table, write_plots
from cluster.cli.main import build_parser, main

SHAREGPT = Path(__file__).parent / "data" / "sharegpt_small.json"
MODEL = "fake-model"
# a measured latency is never under the injected one (less a clock's jitter), and over it by what a
# busy 2-core machine's scheduler adds: a stall of tens of ms must not fail a test, a latency taken
# from the wrong chunk (the opening one's ~0 ms, the last one's) must
LATE_S = 0.04


def near(got: float, want: float, late: float = LATE_S) -> bool:
    return want - 0.002 <= got <= want + late
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------- the fake server


class FakeOpenAIServer:
    """A scripted OpenAI-compatible streaming server on its own thread and event loop."""

    def __init__(self, default_ttft_ms: float = 20, default_itl_ms: float = 5, api_key: str | None = None):
        self.defaults = {"ttft": default_ttft_ms, "itl": default_itl_ms}
        self.api_key = api_key
        self.in_flight = 0
        self.max_in_flight = 0
        self.received = 0
        self.paths: list[str] = []          # each generation request's path, in arrival order
        self.ignore_eos: list[bool | None] = []   # each generation request's ignore_eos, in arrival order
        self.sent: dict[str, list[float]] = {}  # prompt -> perf_counter() as each output chunk was written
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.base_url = ""

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        assert self._ready.wait(10), "the fake server did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port = runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}"
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    def _unauthorized(self, request: web.Request) -> web.Response | None:
        if self.api_key is None or request.headers.get("Authorization") == f"Bearer {self.api_key}":
            return None
        return web.json_response({"error": {"message": "Missing or invalid API key", "code": 401}}, status=401)

    async def _models(self, request: web.Request) -> web.Response:
        if refused := self._unauthorized(request):
            return refused
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "owned_by": "test", "max_model_len": 1024}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        arrival = asyncio.get_running_loop().time()
        if refused := self._unauthorized(request):
            return refused
        with self._lock:
            self.received += 1
            self.paths.append(request.path)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._respond(request, arrival)
        finally:
            with self._lock:
                self.in_flight -= 1

    async def _respond(self, request: web.Request, arrival: float) -> web.StreamResponse:
        body = await request.json()
        self.ignore_eos.append(body.get("ignore_eos"))
        chat = request.path.endswith("chat/completions")
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        script = dict(re.findall(r"(\w+)=(\S+)", text)) if text.startswith("FAKE") else {}
        ttft_s = float(script.get("ttft", self.defaults["ttft"])) / 1000
        itl_s = float(script.get("itl", self.defaults["itl"])) / 1000
        n = int(script.get("n", body.get("max_tokens", 16)))
        fail = script.get("fail")
        if fail in ("500", "400", "200"):    # 200: a JSON body where an event stream was asked for
            return web.json_response({"error": {"message": f"injected {fail}", "type": "test", "code": int(fail)}},
                                     status=int(fail))
        header = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                  "model": MODEL}
        if "eof_cut" in script:
            return self._stream_to_eof(request, header, n, script["eof_cut"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(payload: dict) -> None:
            await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

        sent = self.sent.setdefault(text, [])

        async def send_output(payload: dict) -> None:
            sent.append(time.perf_counter())    # before the write: the client cannot see it earlier
            await send(payload)

        def choice(piece: str) -> dict:
            return {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}

        if chat:  # like pdserve and OpenAI: a role chunk with empty content comes first
            opening = {"role": "assistant", "content": ""}
            if script.get("refusal") == "null":     # OpenAI's own opening chunk carries it
                opening["refusal"] = None
            await send({**header, "choices": [{"index": 0, "delta": opening}]})
        loop = asyncio.get_running_loop()
        for i in range(n):
            await asyncio.sleep(max(0.0, arrival + ttft_s + i * itl_s - loop.time()))
            if i == n // 2 and fail == "stream_error":
                await send({"error": {"message": "injected stream error", "code": 500}})
                await resp.write(b"data: [DONE]\n\n")
                return resp
            if i == n // 2 and fail == "abort":
                request.transport.close()
                return resp
            null_error = {"error": None} if script.get("error_null") == "1" else {}
            await send_output({**header, "choices": [choice(f" t{i}")], **null_error})
        steps = n
        if script.get("eos") == "1":   # EOS has no text: a last chunk with only the finish reason
            await asyncio.sleep(max(0.0, arrival + ttft_s + n * itl_s - loop.time()))
            await send_output({**header, "choices": [{**choice(""), "finish_reason": "stop"}]})
            steps += 1
        elif "finish" in script:       # the last chunk's finish_reason, e.g. a server-side "abort"
            await send_output({**header, "choices": [{**choice(""), "finish_reason": script["finish"]}]})
        if script.get("reset") == "1":      # the connection cut after the last output chunk
            request.transport.close()
            return resp
        if body.get("stream_options", {}).get("include_usage") and script.get("usage") != "0":
            await send({**header, "choices": [],
                        "usage": {"prompt_tokens": 3, "completion_tokens": steps, "total_tokens": steps + 3}})
        if script.get("done") != "0":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _stream_to_eof(request: web.Request, header: dict, n: int, where: str) -> web.StreamResponse:
        """A completion stream whose body ends at EOF (no chunked encoding: Connection: close),
        cut in the middle of the usage event (`where` "usage": after the finish_reason) or of
        the last output event ("output": before it)."""
        events = [{**header, "choices": [{"index": 0, "text": f" t{i}"}]} for i in range(n)]
        events[-1]["choices"][0]["finish_reason"] = "length"
        events.append({**header, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
        cut = body.rindex("data:") if where == "usage" else body.rindex("data:", 0, body.rindex("data:"))
        body = body[:cut + 30]        # 30 characters into the event
        request.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                                + body.encode())
        request.transport.close()
        return web.StreamResponse()


@pytest.fixture()
def server():
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    from engine.tiny_model import ensure_default_model
    return ensure_default_model()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from engine.tokenizer import load_tokenizer
    return load_tokenizer(tokenizer_dir)


def fake(**script) -> SampleRequest:
    prompt = "FAKE " + " ".join(f"{k}={v}" for k, v in script.items())
    return SampleRequest(prompt, prompt_len=3, expected_output_len=int(script.get("n", 4)))


def run(requests, base_url: str, tokenizer=None, **options):
    config = RunConfig(base_url=base_url, model=MODEL, disable_tqdm=True, **options)
    return asyncio.run(run_benchmark(requests, config, tokenizer=tokenizer))


def timed_as_sent(r: RequestRecord, sent: list[float]) -> bool:
    """Each chunk timed on its arrival (never before the server wrote it), and the TPOT's span the
    server's own: a late server shifts both, so only the client's lag reading a chunk counts."""
    return len(r.chunk_times) == len(sent) and all(got >= s for got, s in zip(r.chunk_times, sent)) and \
        tpot(r) * (r.output_tokens - 1) == pytest.approx(sent[-1] - sent[0], abs=LATE_S)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------- arrivals


def test_poisson_arrivals_have_the_asked_mean_rate():
    offsets = arrival_offsets(20000, rate=8.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    # Exponential gaps: coefficient of variation 1.
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1.0, rel=0.1)
    assert arrival_offsets(100, 8.0, seed=1) == offsets[:100]
    assert arrival_offsets(100, 8.0, seed=2) != offsets[:100]


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_keep_the_rate_and_scale_the_variance(burstiness):
    gaps = np.diff(arrival_offsets(40000, rate=5.0, burstiness=burstiness, seed=3))
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.05)
    # Gamma with shape k: squared coefficient of variation 1 / k.
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.15)


def test_infinite_rate_sends_everything_at_once_and_bad_values_are_refused():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError, match="--request-rate"):
        arrival_offsets(5, 0.0)
    with pytest.raises(ValueError, match="--burstiness"):
        arrival_offsets(5, 1.0, burstiness=0.0)


def test_pacing_follows_the_schedule(monkeypatch):
    offsets = [0.0, 0.05, 0.12, 0.2]

    async def real():
        start = time.perf_counter()
        return [time.perf_counter() - start async for _ in paced(offsets, start)]

    # On the real clock a send is never early (how late is the machine's load, not asserted)
    assert all(got >= want - 0.002 for got, want in zip(asyncio.run(real()), offsets, strict=True))

    # On a fake clock that the (patched) sleep advances, exactly: a stall of 100 ms after the second
    # send makes the third late but does not shift the fourth
    now, sleeps, real_sleep = [100.0], [], asyncio.sleep

    async def sleep(delay):
        sleeps.append(delay)
        now[0] += delay
        await real_sleep(0)

    async def fake():
        seen = []
        async for index in paced(offsets, 100.0, clock=lambda: now[0]):
            seen.append(now[0] - 100.0)
            if index == 1:
                now[0] += 0.1
        return seen

    monkeypatch.setattr(arrivals_module, "asyncio", SimpleNamespace(sleep=sleep))
    assert asyncio.run(fake()) == pytest.approx([0.0, 0.05, 0.15, 0.2])
    assert sleeps == pytest.approx([0.05, 0.05])


# ---------------------------------------------------------- metrics, exactly


def record(index=0, send=10.0, chunks=(), end=None, tokens=None, ok=True, error=None) -> RequestRecord:
    r = RequestRecord(index, prompt_len=5, expected_output_len=4, send_time=send, chunk_times=list(chunks),
                      end_time=end if end is not None else (chunks[-1] if chunks else send),
                      output_tokens=tokens if tokens is not None else len(chunks), succeeded=ok, error=error)
    r.token_count_method = "usage" if ok else None
    return r


def test_per_request_metrics_are_exact():
    r = record(send=1.0, chunks=[1.1, 1.13, 1.15, 1.2], end=1.25, tokens=6)
    assert ttft(r) == pytest.approx(0.1, abs=1e-12)
    # TPOT divides by tokens - 1 (usage said 6 tokens in 4 chunks); ITL is per chunk.
    assert tpot(r) == pytest.approx(0.1 / 5, abs=1e-12)
    s = summarize([r], num_requests=1, duration=2.0)
    assert s.latency["itl"].mean == pytest.approx(100 / 3)
    assert s.latency["itl"].median == pytest.approx(30.0)
    # E2EL to the last output chunk (vLLM's), not to the stream's close at 1.25 (usage, [DONE])
    assert s.latency["e2el"].mean == pytest.approx(200.0)
    assert tpot(record(chunks=[10.5], tokens=1)) is None


def test_summary_throughput_and_percentiles():
    records = [record(i, send=0.0, chunks=[t, t + 0.01], end=t + 0.01) for i, t in enumerate([0.1, 0.2, 0.3, 0.4])]
    records.append(record(9, ok=False, error="HTTP 500: boom"))
    s = summarize(records, num_requests=6, duration=2.0, percentiles=(90, 99))
    assert (s.completed, s.failed, s.not_sent) == (4, 1, 1)
    assert s.request_throughput == 2.0 and s.output_throughput == 4.0
    assert s.total_input_tokens == 20 and s.total_token_throughput == 14.0
    records[0].usage_prompt_tokens = 9        # the server's count (a chat template's tokens) wins over the dataset's 5
    assert summarize(records, num_requests=6, duration=2.0).total_input_tokens == 24
    assert s.latency["ttft"].mean == pytest.approx(250.0)
    assert s.latency["ttft"].median == pytest.approx(250.0)
    assert s.latency["ttft"].percentiles[90] == pytest.approx(370.0)
    assert s.latency["ttft"].std == pytest.approx(statistics.pstdev([100, 200, 300, 400]))
    assert s.error_counts == {"HTTP 500: boom": 1}
    assert s.good is None and s.request_goodput is None and s.slo_attainment is None
    rng = np.random.default_rng(0)
    for values in (rng.exponential(size=17), rng.normal(size=200)):
        for q in (1, 25, 50, 90, 99, 99.9):
            assert percentile(sorted(values), q) == pytest.approx(np.percentile(values, q))


def test_goodput_counts_exactly_the_requests_meeting_every_slo():
    # Binary fractions, so "equal to the limit" is exact in floating point.
    slos = {"ttft": 125.0, "tpot": 15.625, "e2el": 250.0}
    good = record(0, send=0.0, chunks=[0.125 + i * 0.015625 for i in range(9)], end=0.3)  # each limit exactly
    slow_first = record(1, send=0.0, chunks=[0.126, 0.13], end=0.2)
    slow_decode = record(2, send=0.0, chunks=[0.0625, 0.0785], end=0.1)
    slow_total = record(3, send=0.0, chunks=[0.125 + i * 0.014 for i in range(10)], end=0.26)   # last at 0.251
    one_token = record(4, send=0.0, chunks=[0.0625], end=0.07)               # no decode: meets any TPOT
    failed = record(5, send=0.0, chunks=[0.01], ok=False, error="x")
    records = [good, slow_first, slow_decode, slow_total, one_token, failed]
    assert [meets_slos(r, slos) for r in records] == [True, False, False, False, True, False]
    assert meets_slos(slow_first, {"tpot": 15.625}) and meets_slos(slow_decode, {"ttft": 125.0})
    s = summarize(records, num_requests=6, duration=4.0, slos_ms=slos)
    assert s.good == 2 and s.request_goodput == 0.5
    assert s.slo_attainment == pytest.approx(2 / 6)  # failed requests count against attainment


# ----------------------------------------------------- against the fake server


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_timings_match_the_injected_latencies(server, endpoint):
    requests = [fake(ttft=50, itl=10, n=8, id=i) for i in range(4)]     # id: the server's key for its send times
    result = run(requests, server.base_url, endpoint=endpoint, request_rate=20.0)
    assert result.interrupted is None and len(result.records) == 4
    for r in result.records:
        assert r.succeeded and r.error is None and r.status == 200
        assert (r.output_tokens, r.token_count_method, len(r.chunk_times)) == (8, "usage", 8)
        assert near(ttft(r), 0.050)
        assert timed_as_sent(r, server.sent[requests[r.index].prompt])
        assert near(r.end_time - r.send_time, 0.050 + 7 * 0.010)
        assert r.text == "".join(f" t{i}" for i in range(8))
    s = summarize(result.records, num_requests=4, duration=result.duration)
    assert s.latency["itl"].median == pytest.approx(10.0, abs=4.0)
    assert s.completed == 4 and s.total_output_tokens == 32


def test_goodput_over_the_network_counts_exactly_the_good_requests(server):
    good = [fake(ttft=20, itl=5, n=5) for _ in range(4)]
    slow_first = [fake(ttft=1000, itl=5, n=5) for _ in range(2)]
    slow_decode = [fake(ttft=20, itl=300, n=4) for _ in range(2)]      # e2el 920 ms: only TPOT misses
    slow_total = [fake(ttft=20, itl=130, n=25) for _ in range(2)]      # TPOT 130 ms: only e2el misses
    broken = [fake(fail=500)]
    result = run(good + slow_first + slow_decode + slow_total + broken, server.base_url)
    # Margins: good ~40 ms e2el, so a stall of a few hundred ms on a busy machine still
    # leaves it good; the others miss their limit by >= 2x.
    slos = {"ttft": 500.0, "tpot": 150.0, "e2el": 1500.0}
    s = summarize(result.records, num_requests=11, duration=result.duration, slos_ms=slos)
    assert (s.completed, s.failed, s.good) == (10, 1, 4)
    assert s.slo_attainment == pytest.approx(4 / 11)
    assert s.request_goodput == pytest.approx(4 / result.duration)
    good_indices = {r.index for r in result.records if meets_slos(r, slos)}
    assert good_indices == {0, 1, 2, 3}


def test_failed_requests_are_counted_with_their_errors(server):
    requests = [fake(n=3), fake(fail=500), fake(fail=400), fake(fail="stream_error", n=6),
                fake(fail="abort", n=6), fake(n=0), fake(ttft=3000, n=2), fake(n=3)]
    result = run(requests, server.base_url, request_timeout=0.5)
    by_index = {r.index: r for r in result.records}
    assert [by_index[i].succeeded for i in range(8)] == [True, False, False, False, False, False, False, True]
    assert by_index[1].error == "HTTP 500: injected 500" and by_index[1].status == 500
    assert by_index[2].error == "HTTP 400: injected 400"
    assert by_index[3].error == "stream error: injected stream error"
    assert "ClientPayloadError" in by_index[4].error or "no data: [DONE]" in by_index[4].error
    assert "no output chunk" in by_index[5].error
    assert "timed out after 0.5 s" in by_index[6].error
    s = summarize(result.records, num_requests=8, duration=result.duration)
    assert (s.completed, s.failed) == (2, 6) and sum(s.error_counts.values()) == 6

    table = format_table(s)
    assert "Failed requests:" in table and "HTTP 500: injected 500" in table


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_an_output_ending_with_eos_is_timed_to_its_last_step(server, endpoint):
    # EOS is a step with no text (its chunk carries only the finish reason) and the usage counts it
    requests = [fake(ttft=40, itl=30, n=3, eos=1), fake(ttft=40, n=0, eos=1)]
    result = run(requests, server.base_url, endpoint=endpoint)
    ended, eos_first = sorted(result.records, key=lambda r: r.index)
    assert ended.succeeded and (ended.output_tokens, len(ended.chunk_times)) == (4, 4)
    assert ended.finish_reason == "stop" and ended.text == " t0 t1 t2"
    assert timed_as_sent(ended, server.sent[requests[0].prompt])     # to the EOS chunk, not the last text one
    assert eos_first.succeeded and eos_first.output_tokens == 1 and eos_first.text == ""
    assert near(ttft(eos_first), 0.040)

def test_a_request_the_server_aborted_is_a_failure_not_a_short_output(server):
    result = run([fake(n=4, finish="abort"), fake(n=4, finish="length"), fake(n=4, finish="error")],
                 server.base_url)
    by_index = {r.index: r for r in result.records}
    assert not by_index[0].succeeded and "ended the request with finish_reason 'abort'" in by_index[0].error
    assert by_index[1].succeeded and by_index[1].finish_reason == "length"
    assert not by_index[2].succeeded and "finish_reason 'error'" in by_index[2].error


def test_a_finished_stream_without_done_succeeds_and_a_cut_one_fails(server):
    result = run([fake(n=3, eos=1, done=0), fake(n=3, done=0)], server.base_url)
    finished, cut = sorted(result.records, key=lambda r: r.index)
    assert finished.succeeded and finished.output_tokens == 4
    assert not cut.succeeded and "before the output finished" in cut.error


def test_a_connection_cut_after_the_finish_reason_is_a_complete_request(server):
    result = run([fake(n=3, finish="length", reset=1), fake(n=3, reset=1)], server.base_url)
    finished, cut = sorted(result.records, key=lambda r: r.index)
    assert finished.succeeded and finished.error is None and len(finished.chunk_times) == 4
    assert not cut.succeeded and cut.error


def test_a_body_ending_at_eof_inside_an_event_is_a_cut_stream(server):
    # without chunked encoding the cut shows only as a last line with no newline
    result = run([fake(n=3, eof_cut="usage"), fake(n=3, eof_cut="output")], server.base_url)
    finished, cut = sorted(result.records, key=lambda r: r.index)
    assert finished.succeeded and finished.error is None and finished.finish_reason == "length"
    assert len(finished.chunk_times) == 3
    assert not cut.succeeded and "ended inside a stream event" in cut.error


def test_a_chunk_whose_error_field_is_null_is_output(server):
    (record,) = run([fake(n=3, error_null=1)], server.base_url).records
    assert record.succeeded and record.error is None and len(record.chunk_times) == 3


def test_a_json_body_where_a_stream_was_asked_for_is_reported_as_such(server):
    (record,) = run([fake(fail=200)], server.base_url).records
    assert not record.succeeded
    assert record.error == "HTTP 200 with a JSON body, not an event stream: injected 200"


def test_chat_ttft_skips_an_opening_chunk_with_empty_fields(server):
    result = run([fake(ttft=150, itl=5, n=4, refusal="null")], server.base_url, endpoint="/v1/chat/completions")
    (record,) = result.records
    assert record.succeeded and len(record.chunk_times) == 4
    assert near(ttft(record), 0.150)    # before: the opening chunk's ~0 ms


def test_an_unreachable_server_fails_every_request_without_crashing():
    result = run([fake(n=2)] * 3, f"http://127.0.0.1:{closed_port()}")
    assert len(result.records) == 3 and not any(r.succeeded for r in result.records)
    assert all("Connect" in r.error for r in result.records)


def test_output_tokens_without_usage_come_from_the_tokenizer_or_chunks(server):
    class WordCounter:
        def encode(self, text, add_special_tokens=False):
            return text.split() * 2

    requests = [fake(n=4, usage=0)]
    by_chunks = run(requests, server.base_url).records[0]
    by_tokenizer = run(requests, server.base_url, tokenizer=WordCounter()).records[0]
    assert (by_chunks.output_tokens, by_chunks.token_count_method) == (4, "chunks")
    assert (by_tokenizer.output_tokens, by_tokenizer.token_count_method) == (8, "tokenizer")


def test_max_concurrency_caps_requests_in_flight(server):
    result = run([fake(ttft=30, n=2) for _ in range(6)], server.base_url, max_concurrency=2)
    assert all(r.succeeded for r in result.records)
    assert server.max_in_flight == 2


def test_requests_are_sent_on_their_poisson_schedule(server, monkeypatch):
    paced_with = []

    def spy(offsets, start, **kwargs):
        paced_with.append((list(offsets), start))
        return paced(offsets, start, **kwargs)

    monkeypatch.setattr(runner_module, "paced", spy)
    result = run([fake(ttft=5, n=1) for _ in range(30)], server.base_url, request_rate=50.0, seed=4)
    offsets = arrival_offsets(30, 50.0, seed=4)
    # The run paces this schedule from its start (pacing itself: test_pacing_follows_the_schedule)
    assert paced_with == [(offsets, result.start_time)]
    lateness = [(r.send_time - result.start_time) - offsets[r.index] for r in result.records]
    # Never early; how late is the machine's load: only a systematic lag of 5 mean gaps (0.1 s) fails
    assert min(lateness) > -0.002 and statistics.median(lateness) < 0.1


def test_max_duration_ends_the_run_with_partial_results(server):
    requests = [fake(ttft=10, n=2)] * 3 + [fake(ttft=10, itl=100, n=50)] * 2
    result = run(requests, server.base_url, max_duration=0.5)
    assert result.interrupted == "--max-duration 0.5 s reached" and not result.cancelled
    assert 0.49 <= result.duration < 4.0      # not before the limit, nor at the long requests' end (4.9 s)
    s = summarize(result.records, num_requests=5, duration=result.duration)
    assert (s.completed, s.failed, s.unfinished) == (3, 2, 2)
    assert all("unfinished" in r.error for r in result.records if not r.succeeded)


def test_cancelling_the_run_returns_what_was_measured(server, monkeypatch):
    # cancelled once the second, short request is done and the first (5 s long) has streamed a chunk;
    # the other two are due a minute later, so they are never sent
    requests = [fake(ttft=10, itl=100, n=50), fake(ttft=10, n=2), fake(n=2), fake(n=2)]
    config = RunConfig(base_url=server.base_url, model=MODEL, disable_tqdm=True)
    sent: dict[int, RequestRecord] = {}
    real_send = runner_module.send_request

    async def send_request(session, url, payload, record, **kwargs):
        sent[record.index] = record
        await real_send(session, url, payload, record, **kwargs)

    monkeypatch.setattr(runner_module, "send_request", send_request)

    async def go():
        task = asyncio.ensure_future(run_benchmark(requests, config, offsets=[0.0, 0.05, 60.0, 60.0]))

        async def measured():
            while not (1 in sent and sent[1].end_time is not None and sent[0].chunk_times):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(measured(), 30)     # a hang guard only
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=30)
        assert done, "the cancelled run did not return"
        return task.result()

    result = asyncio.run(go())
    assert result.cancelled and result.interrupted == "interrupted (Ctrl-C)"
    by_index = {r.index: r for r in result.records}
    assert sorted(by_index) == [0, 1]                     # the rest were never sent
    assert by_index[0].unfinished and not by_index[0].succeeded and 0 < len(by_index[0].chunk_times) < 50
    assert by_index[1].succeeded and not by_index[1].unfinished


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="SIGINT handlers are set in the main thread only")
@pytest.mark.parametrize("runner", [
    pytest.param(asyncio.run, id="asyncio.run", marks=pytest.mark.skipif(
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
        reason="asyncio.run handles SIGINT only where Python's own handler is installed")),
    pytest.param(run_cancellable, id="run_cancellable")])
def test_ctrl_c_returns_partial_results(server, runner):
    # asyncio.run turns SIGINT into a cancellation only from Python 3.11; run_cancellable (what the
    # CLI uses) does on every version, and leaves Python's own handler in place after
    requests = [fake(ttft=10, n=2)] + [fake(ttft=10, itl=100, n=50)] * 2
    config = RunConfig(base_url=server.base_url, model=MODEL, disable_tqdm=True)

    async def go():
        asyncio.get_running_loop().call_later(0.3, signal.raise_signal, signal.SIGINT)
        return await run_benchmark(requests, config)

    result = runner(go())
    assert result.cancelled
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    s = summarize(result.records, num_requests=3, duration=result.duration)
    assert (s.completed, s.unfinished) == (1, 2)


def test_a_model_list_that_is_not_a_list_is_a_clear_error(server, capsys, monkeypatch):
    async def no_list(self, request):
        return web.json_response({"data": None})
    monkeypatch.setattr(FakeOpenAIServer, "_models", no_list)
    with FakeOpenAIServer() as odd:
        assert main(["loadtest", "--base-url", odd.base_url, "--num-prompts", "1"]) == 2
    assert "did not return an OpenAI model list" in capsys.readouterr().err


# --------------------------------------------------------------- report, plots


def test_percentile_keys_are_spelt_as_vllms():
    from bench.loadtest.report import percentile_name
    assert [percentile_name(p) for p in (99, 99.0, 99.9, 12.3456789, 99.99999)] == \
        ["p99", "p99", "p99.9", "p12.3456789", "p99.99999"]      # (the last was p100, a real p100's key)


def test_json_result_has_vllm_keys_and_per_request_records(server):
    result = run([fake(n=3), fake(fail=500)], server.base_url)
    s = summarize(result.records, num_requests=2, duration=result.duration, slos_ms={"ttft": 1000.0},
                  percentiles=(90, 99, 99.9))
    out = json.loads(json.dumps(build_result(result, s, meta={"dataset_name": "test"})))
    for key in ("request_throughput", "output_throughput", "request_goodput", "median_ttft_ms", "p99_ttft_ms",
                "median_tpot_ms", "p99_tpot_ms", "median_e2el_ms", "p90_itl_ms", "p99.9_e2el_ms", "mean_itl_ms",
                "std_tpot_ms", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "total_token_throughput", "slo_attainment", "error_counts", "input_lens", "output_lens", "ttfts",
                "itls", "generated_texts", "errors", "requests"):
        assert key in out, key
    assert out["request_rate"] == "inf" and out["dataset_name"] == "test"
    assert (out["backend"], out["model_id"], out["model"]) == ("openai", MODEL, MODEL)
    assert (out["completed"], out["failed"], out["request_goodput"]) == (1, 1, pytest.approx(1 / out["duration"]))
    assert out["error_counts"] == {"HTTP 500: injected 500": 1}
    assert len(out["requests"]) == 2 and {"ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"} <= set(out["requests"][0])


def test_json_peaks_zeros_for_metrics_without_values_and_failed_lengths_as_vllm_writes_them():
    from bench.loadtest.metrics import peaks
    from bench.loadtest.runner import RunConfig, RunResult
    # two successful requests sent at 0.0 and 0.5, one failed one whose stream carried usage
    a = record(0, send=0.0, chunks=[0.2, 0.4, 0.9, 1.2], end=1.3)
    b = record(1, send=0.5, chunks=[0.7], end=0.8, tokens=1)
    failed = record(2, send=0.6, chunks=[0.65, 0.7], end=0.9, tokens=7, ok=False, error="stream cut")
    # second 0: 4 chunks (a: 3, b: 1), second 1: 1; in flight in second 0: a and b
    assert peaks([a, b, failed]) == (4.0, 2)
    assert peaks([failed]) == (0.0, 0)
    # a server that streams several tokens a chunk: each chunk counts its request's tokens / chunks
    batched = record(3, send=0.0, chunks=[0.3, 0.6, 1.5], end=1.6, tokens=12)
    assert peaks([batched]) == (8.0, 1)          # (counted by chunks: 2)
    # five requests one after another within one second: never two in flight (per-second buckets said 5);
    # each is in flight to its last output, not to the stream's close (which came after the next send)
    serial = [record(i, send=0.2 * i, chunks=[0.2 * i + 0.1, 0.2 * i + 0.2], end=0.2 * i + 0.25) for i in range(5)]
    assert peaks(serial)[1] == 1
    config = RunConfig(base_url="http://x", model=MODEL)
    one_token = RunResult(config=config, records=[b], num_requests=1, start_time=0.5, duration=0.3, interrupted=None)
    s = summarize([b], num_requests=1, duration=0.3)
    result = build_result(one_token, s)
    assert result["mean_tpot_ms"] is None           # for this project's tables and plots: no value
    out = json.loads(json.dumps(vllm_json({"runs": [result]})))["runs"][0]
    # a one-token output has no TPOT and no ITL: in the file 0.0, as vLLM writes them, and named
    assert out["metrics_without_values"] == ["tpot", "itl"]
    assert (out["mean_tpot_ms"], out["p99_itl_ms"], out["median_ttft_ms"]) == (0.0, 0.0, pytest.approx(200.0))
    assert (out["max_output_tokens_per_s"], out["max_concurrent_requests"]) == (1.0, 1)
    mixed = RunResult(config=config, records=[a, failed], num_requests=2, start_time=0.0, duration=1.3,
                      interrupted=None)
    out = build_result(mixed, summarize([a, failed], num_requests=2, duration=1.3))
    assert out["output_lens"] == [4, 0]          # the failed request's usage is not an output


def sweep_result(rate: float, scale: float) -> dict:
    return {"request_rate": rate, "completed": 10, "failed": 0, "request_throughput": min(rate, 3.0),
            "request_goodput": min(rate, 2.0), "output_throughput": 30.0 * min(rate, 3.0),
            "slo_attainment": 1.0 / scale, "slos_ms": {"ttft": 100.0},
            **{f"{stat}_{m}_ms": base * scale for m in ("ttft", "tpot")
               for stat, base in (("median", 10.0), ("p90", 20.0), ("p99", 30.0))}}


def test_sweep_plots_are_written_as_png(tmp_path):
    results = [sweep_result(rate, scale) for rate, scale in ((0.5, 1.0), (1.0, 1.2), (4.0, 3.0))]
    paths = write_plots(results, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["slo_attainment.png", "throughput.png", "tpot.png", "ttft.png"]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in paths)
    assert "0.5" in format_sweep_table(results)


# ----------------------------------------------------------------------- datasets


def test_the_rates_of_a_sweep_see_one_mix_of_lengths_with_other_prompts(tokenizer):
    from types import SimpleNamespace

    from bench.loadtest.command import _build_dataset
    args = SimpleNamespace(dataset_name="random", num_prompts=30, random_input_len=40, random_output_len=10,
                           random_range_ratio=0.5, random_prefix_len=0)

    def dataset(seed):      # as the CLI builds a sweep's: seed + i per rate, the lengths from the first seed
        return _build_dataset(args, tokenizer, None, seed, lengths_seed=7)
    first, second = dataset(7), dataset(8)
    assert [(r.prompt_len, r.expected_output_len) for r in first] == \
        [(r.prompt_len, r.expected_output_len) for r in second]
    assert len({r.prompt_len for r in first}) > 5
    assert not {r.prompt for r in first} & {r.prompt for r in second}


def test_random_dataset_lengths(tokenizer):
    exact = random_dataset(tokenizer, num_prompts=20, input_len=64, output_len=8, seed=1)
    assert all(r.prompt_len == 64 and r.expected_output_len == 8 for r in exact)
    # counted as the server counts the prompt, its BOS included (vLLM's RandomDataset: 63 + the BOS)
    assert all(len(tokenizer.encode(r.prompt, add_special_tokens=True)) == r.prompt_len for r in exact)
    assert all(len(tokenizer.encode(r.prompt, add_special_tokens=False)) == 63 for r in exact)
    assert random_dataset(tokenizer, num_prompts=20, input_len=64, output_len=8, seed=1) == exact
    ranged = random_dataset(tokenizer, num_prompts=50, input_len=40, output_len=10, range_ratio=0.5, seed=2)
    assert all(20 <= r.prompt_len <= 60 and 5 <= r.expected_output_len <= 15 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 5
    assert length_range(10, 0.25) == (7, 13)
    with pytest.raises(DatasetError, match="--random-range-ratio"):
        random_dataset(tokenizer, num_prompts=1, input_len=8, output_len=8, range_ratio=1.0)


def test_the_context_warning_counts_a_bos_only_where_the_lengths_leave_it_out(tokenizer, capsys):
    from bench.loadtest.command import _warn_context
    from bench.loadtest.datasets import num_special_tokens
    bos = num_special_tokens(tokenizer)
    assert bos == 1                  # the tiny model's tokenizer adds a BOS
    random_prompts = random_dataset(tokenizer, num_prompts=3, input_len=40, output_len=24, seed=3)
    assert {r.prompt_len for r in random_prompts} == {40}          # the BOS counted in
    _warn_context(random_prompts, max_model_len=64)                # 40 + 24: exactly the context
    assert capsys.readouterr().err == ""
    prefix_prompts = prefix_dataset(tokenizer, num_prompts=3, prefix_len=20, suffix_len=20, num_prefixes=1,
                                    output_len=24, seed=3)
    assert {r.prompt_len for r in prefix_prompts} == {40}          # prefix + suffix, the BOS left out
    _warn_context(prefix_prompts, max_model_len=64, uncounted=bos)  # 1 + 40 + 24 > 64
    assert "3 of 3 requests may not fit the server's 64-token context" in capsys.readouterr().err


def test_prefix_dataset_shares_prefixes(tokenizer):
    requests = prefix_dataset(tokenizer, num_prompts=12, prefix_len=48, suffix_len=6, num_prefixes=3,
                              output_len=5, seed=0)
    heads = {r.prompt[:40] for r in requests}
    assert len(requests) == 12 and len(heads) == 3
    assert all(r.expected_output_len == 5 and 50 <= r.prompt_len <= 56 for r in requests)


def test_sharegpt_dataset_reads_the_public_format(tokenizer):
    requests = sharegpt_dataset(tokenizer, SHAREGPT, num_prompts=50, seed=0)
    assert len(requests) == 50
    prompts = {r.prompt for r in requests}
    # 43 entries: one-turn and empty ones skipped (an answer's length counts its BOS, as vLLM measures
    # it: a three-token answer is four, not too short), the rest reused
    assert len(prompts) == 41
    assert all(len(tokenizer.encode(r.prompt, add_special_tokens=True)) == r.prompt_len for r in requests)
    fixed = sharegpt_dataset(tokenizer, SHAREGPT, num_prompts=5, output_len=7, max_model_len=1024)
    assert all(r.expected_output_len == 7 for r in fixed)
    with pytest.raises(DatasetError, match="--dataset-path"):
        sharegpt_dataset(tokenizer, SHAREGPT.with_name("missing.json"), num_prompts=1)


def test_sharegpt_dataset_skips_what_vllm_skips(tokenizer, tmp_path):
    """vLLM's caps: a prompt over 1,024 tokens, or a prompt and answer over 2,048, is
    skipped whatever the server's context, so a seed picks the same requests."""
    def turn(words: int) -> str:
        return " ".join(f"w{i}" for i in range(words))

    def tokens(text: str) -> int:      # as vLLM measures both turns: with the BOS
        return len(tokenizer.encode(text, add_special_tokens=True))
    long_prompt, long_answer = turn(1200), turn(2200)
    assert tokens(long_prompt) > 1024 and tokens(long_answer) > 2048
    pairs = [(long_prompt, turn(10)), (turn(10), long_answer), (turn(10), turn(12))]
    data = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in pairs]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = sharegpt_dataset(tokenizer, path, num_prompts=3, max_model_len=32768)
    assert {r.prompt for r in requests} == {turn(10)}
    assert {r.expected_output_len for r in requests} == {tokens(turn(12))}
    # a fixed output length counts towards the 2,048 too
    assert sharegpt_dataset(tokenizer, path, num_prompts=1, output_len=100)[0].prompt == turn(10)
    with pytest.raises(DatasetError, match="a prompt of at most 1024"):
        sharegpt_dataset(tokenizer, path, num_prompts=1, output_len=2040)


# ----------------------------------------------------------------------- the CLI


def test_cli_run_prints_the_table_and_saves_vllm_json(server, tokenizer_dir, tmp_path, capsys):
    rc = main(["loadtest", "--base-url", server.base_url, "--tokenizer", str(tokenizer_dir),
               "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "4",
               "--request-rate", "50", "--goodput", "ttft:1000", "tpot:200", "--disable-tqdm",
               "--save-result", "--result-dir", str(tmp_path), "--result-file", "out.json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "Serving Benchmark Result" in out.out and "Mean TTFT (ms):" in out.out and "P99 E2EL (ms):" in out.out
    assert "tokenizer:" in out.err
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["model"] == MODEL and saved["completed"] == 6 and saved["failed"] == 0
    assert saved["request_goodput"] > 0 and saved["slo_attainment"] == 1.0
    assert saved["token_count_methods"] == {"usage": 6}
    # the prompt tokens the server counted (its usage), as vLLM reports them; the dataset's size per request beside
    assert saved["input_lens"] == [3] * 6 and saved["total_input_tokens"] == 18
    assert [r["prompt_len"] for r in saved["requests"]] == [16] * 6


def test_cli_sweep_writes_plots_and_results(server, tokenizer_dir, tmp_path, capsys):
    rc = main(["loadtest", "--base-url", server.base_url, "--tokenizer", str(tokenizer_dir),
               "--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt", "--dataset-path", str(SHAREGPT),
               "--sharegpt-output-len", "3", "--num-prompts", "5", "--sweep-rates", "20,40",
               "--goodput", "e2el:2000", "--disable-tqdm", "--plot", str(tmp_path / "plots"),
               "--save-result", "--result-dir", str(tmp_path), "--result-file", "sweep.json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "Rate sweep" in out.out
    pngs = sorted((tmp_path / "plots").glob("*.png"))
    assert [p.name for p in pngs] == ["slo_attainment.png", "throughput.png", "tpot.png", "ttft.png"]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in pngs)
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["sweep_rates"] == [20.0, 40.0] and [r["completed"] for r in saved["runs"]] == [5, 5]


def test_cli_without_a_model_tokenizer_counts_by_usage_and_says_so(server, tmp_path, capsys):
    rc = main(["loadtest", "--base-url", server.base_url, "--num-prompts", "3", "--random-input-len", "8",
               "--random-output-len", "3", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
               "--result-file", "out.json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "none found locally" in out.err and "approximate" in out.err
    assert "Output tokens counted by:                server usage (3)" in out.out
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["tokenizer"] is None and saved["tokenizer_id"] is None
    assert saved["prompt_lengths"].startswith("approximate")
    assert [r["usage_prompt_tokens"] for r in saved["requests"]] == [3, 3, 3]


def test_cli_unreachable_server_and_bad_arguments_exit_2(server, capsys):
    assert main(["loadtest", "--base-url", f"http://127.0.0.1:{closed_port()}"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err
    assert main(["loadtest", "--base-url", server.base_url, "--model", "other"]) == 2
    assert "serves fake-model" in capsys.readouterr().err
    assert main(["loadtest", "--plot", "x"]) == 2
    for bad in (["--goodput", "ttft=5"], ["--goodput", "speed:5"], ["--percentile-metrics", "ttft,foo"],
                ["--metric-percentiles", "101"], ["--sweep-rates", "1,inf"], ["--request-rate", "0"],
                ["--port", "70000"]):
        with pytest.raises(SystemExit) as exc:
            main(["loadtest", *bad])
        assert exc.value.code == 2
    assert "expected KEY:MS" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["loadtest", "--request-timeout", "inf"])
    assert "finite" in capsys.readouterr().err


@pytest.mark.parametrize("host, port, url", [("::1", "8100", "http://[::1]:8100"),
                                              (None, None, "http://127.0.0.1:8000"),
                                              ("gpu-node-3", "9000", "http://gpu-node-3:9000")])
def test_vllm_host_and_port_flags_make_the_base_url(host, port, url):
    from bench.loadtest.command import resolve_server_flags
    flags = ["loadtest"] + (["--host", host] if host else []) + (["--port", port] if port else [])
    args = build_parser().parse_args(flags)
    resolve_server_flags(args)
    assert args.base_url == url


def test_cli_takes_a_vllm_bench_serve_command_line(server, tokenizer_dir, tmp_path, capsys):
    port = server.base_url.rsplit(":", 1)[1]
    before = len(server.paths)
    rc = main(["loadtest", "--backend", "openai-chat", "--host", "127.0.0.1", "--port", port,
               "--tokenizer", str(tokenizer_dir), "--dataset-name", "prefix_repetition",
               "--prefix-repetition-prefix-len", "16", "--prefix-repetition-suffix-len", "4",
               "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3",
               "--num-prompts", "4", "--request-rate", "50", "--disable-tqdm", "--save-result",
               "--result-dir", str(tmp_path), "--result-file", "vllm.json", "--num-warmups", "2",
               "--ready-check-timeout-sec", "30"])
    assert rc == 0, capsys.readouterr().err
    assert server.paths[before:] == ["/v1/chat/completions"] * 7     # the ready check, 2 warm-ups, the run
    saved = json.loads((tmp_path / "vllm.json").read_text())
    assert saved["completed"] == 4 and saved["dataset_name"] == "prefix"
    assert [r["prompt_len"] for r in saved["requests"]] == [20] * 4
    for flags, message in ((["--backend", "openai-chat", "--endpoint", "/v1/completions"],
                            "--backend openai-chat sends to /v1/chat/completions, and --endpoint is"),
                           (["--base-url", server.base_url, "--port", port], "either --base-url or --host/--port")):
        assert main(["loadtest", *flags]) == 2
        assert message in capsys.readouterr().err


def test_cli_refuses_before_the_run_what_it_would_ignore_or_fail_on(server, tmp_path, capsys):
    assert main(["loadtest", "--base-url", server.base_url, "--dataset-path", str(SHAREGPT)]) == 2
    assert "--dataset-path apply to --dataset-name sharegpt" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(["loadtest", "--base-url", server.base_url, "--num-prompts", "2", "--save-result",
                 "--result-dir", str(a_file)]) == 2
    assert f"--result-dir {a_file}: it is a file, not a directory" in capsys.readouterr().err
    # a result file that cannot be written: refused before the run (after it, the result went to a
    # temporary file and the command still exited 0)
    assert main(["loadtest", "--base-url", server.base_url, "--num-prompts", "2", "--save-result",
                 "--result-file", str(a_file / "out.json")]) == 2
    assert f"--result-file {a_file / 'out.json'}: {a_file} is a file, not a directory" in capsys.readouterr().err
    # a plot directory that cannot be made: refused before the sweep (after it, the sweep's
    # results were lost with it)
    assert main(["loadtest", "--base-url", server.base_url, "--num-prompts", "2", "--sweep-rates", "5,10",
                 "--plot", str(a_file / "plots")]) == 2
    assert f"--plot {a_file / 'plots'}: cannot make the directory" in capsys.readouterr().err
    # the dataset's own flags, before a server is even asked for its models (after it, a user who
    # started one learned of them only then): a server that cannot be reached is not the error
    unreachable = f"http://127.0.0.1:{closed_port()}"
    for flags, message in ((["--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "none.json")],
                            f"--dataset-path {tmp_path / 'none.json'}: no such file"),
                           (["--dataset-name", "sharegpt", "--dataset-path", str(tmp_path)], "is a directory"),
                           (["--random-range-ratio", "1.5"], "--random-range-ratio must be in [0, 1), got 1.5")):
        assert main(["loadtest", "--base-url", unreachable, *flags]) == 2
        assert message in capsys.readouterr().err, flags
    for temperature in ("nan", "inf", "-1", "2.5"):     # (NaN went out in every body: all refused, exit 0)
        assert main(["loadtest", "--base-url", server.base_url, "--temperature", temperature]) == 2
        assert "--temperature must be in [0, 2]" in capsys.readouterr().err
    assert server.received == 0


def test_cli_sends_the_api_key_and_says_when_one_is_needed(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    with FakeOpenAIServer(api_key="sk-test") as keyed:
        assert main(["loadtest", "--base-url", keyed.base_url, "--num-prompts", "2"]) == 2
        assert "it wants an API key; pass --api-key KEY" in capsys.readouterr().err
        assert main(["loadtest", "--base-url", keyed.base_url, "--num-prompts", "2", "--api-key", "wrong"]) == 2
        assert "the API key given was refused" in capsys.readouterr().err
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        rc = main(["loadtest", "--base-url", keyed.base_url, "--num-prompts", "2", "--random-input-len", "8",
                   "--random-output-len", "3", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
                   "--result-filename", "keyed.json"])
        assert rc == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "keyed.json").read_text())
    assert (saved["completed"], saved["failed"]) == (2, 0)


def test_a_hub_model_id_finds_its_tokenizer_in_the_local_huggingface_cache(tmp_path, monkeypatch, model_dirs):
    """`--model org/name` with no --tokenizer: the tokenizer of that id in the local
    HuggingFace cache, as vLLM's benchmark loads it (it sized prompts with the
    built-in tiny tokenizer instead)."""
    import argparse
    import shutil

    from bench.loadtest.command import _resolve_tokenizer
    from engine.tokenizer import load_tokenizer
    snapshot = tmp_path / "hub" / "models--acme--chat-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    cached = model_dirs["tiny-qwen2"]          # a tokenizer that is not the built-in tiny one
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (cached / name).exists():
            shutil.copy(cached / name, snapshot / name)
    (tmp_path / "hub" / "models--acme--chat-model" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--chat-model" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    args = argparse.Namespace(tokenizer=None, model="acme/chat-model")
    tokenizer, source = _resolve_tokenizer(args, "chat-model")
    assert source == "acme/chat-model (the local HuggingFace cache)"
    text = "a quiet harbour"
    built_in = load_tokenizer(model_dirs["tiny"]).encode(text)
    assert tokenizer.encode(text) == load_tokenizer(cached).encode(text) != built_in
    assert _resolve_tokenizer(argparse.Namespace(tokenizer=None, model="acme/not-cached"), "x") == (None, None)


def test_a_ready_check_that_never_succeeds_stops_the_run_with_its_error(monkeypatch):
    """vLLM's ready check (--ready-check-timeout-sec): a server that cannot answer (here:
    nothing listens) is tried every READY_RETRY_S, then fails one untimed request with
    its error, not every request of the run."""
    from bench.loadtest import command
    monkeypatch.setattr(command, "READY_RETRY_S", 0.1)
    config = RunConfig(base_url=f"http://127.0.0.1:{closed_port()}", model=MODEL, disable_tqdm=True)
    start = time.monotonic()
    with pytest.raises(command.LoadtestError, match="the ready check's request failed: ClientConnectorError"):
        command._ready_check_and_warm_up(fake(n=2), config, None, 0.5, num_warmups=0)
    assert 0.4 < time.monotonic() - start < 5


def test_random_prompts_ignore_eos_as_vllms_benchmark_sets_it(server, capsys):
    """vllm bench serve turns --ignore-eos on for random prompts: each request generates its drawn
    length (a random model's EOS would otherwise cut its output short, and the two tools' figures apart)."""
    before = len(server.ignore_eos)
    assert main(["loadtest", "--base-url", server.base_url, "--num-prompts", "2", "--random-input-len", "8",
                 "--random-output-len", "3", "--disable-tqdm"]) == 0
    assert server.ignore_eos[before:] == [True, True]
    assert "random dataset: --ignore-eos on, as vllm bench serve sets it" in capsys.readouterr().err
    before = len(server.ignore_eos)
    assert main(["loadtest", "--base-url", server.base_url, "--dataset-name", "sharegpt", "--dataset-path",
                 str(SHAREGPT), "--num-prompts", "2", "--disable-tqdm"]) == 0
    assert server.ignore_eos[before:] == [None, None]      # not asked: EOS ends a ShareGPT reply
