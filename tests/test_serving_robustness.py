"""A live disaggregated deployment (one prefill, one decode replica, on a Ray
cluster the size of a 2-core machine) under hostile clients: schemathesis
requests generated from the server's own OpenAPI spec, valid and invalid,
get no 5xx; 1,000 streams abandoned at random phases leave no KV block in use
on any worker; and the server still answers right afterwards."""

from __future__ import annotations

import asyncio
import random
import urllib.request

import pytest

ray = pytest.importorskip("ray")
schemathesis = pytest.importorskip("schemathesis")
aiohttp = pytest.importorskip("aiohttp")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from ray import serve  # noqa: E402

from tests.test_serving_e2e import _wait_kv_idle, check_completions, counter, deploy  # noqa: E402

EXAMPLES_PER_OPERATION = 40      # per generation mode
ABANDONED_STREAMS = 1000
CONCURRENT_STREAMS = 48          # more than the engines batch at once: some wait in queues
ABORTED = 'pdserve_requests_total{finish_reason="abort"}'


@pytest.fixture(scope="module")
def live(ray_cluster, model_dirs):
    """The deployment's base URL (no /v1)."""
    # A client that leaves during its hand-off leaves a send in flight towards a receiver that
    # gave up: the prefill side frees that KV when the transfer times out. The abandoned-streams
    # test waits 20 s for every block to be free: longer than this timeout, shorter than the lease.
    base = deploy(ray_cluster, model_dirs["tiny"], "robust", limits={"max_tokens": 16},
                  kv_transfer={"timeout_s": 8, "lease_s": 30})
    yield base.removesuffix("/v1")
    serve.delete("robust")


def test_fuzzed_requests_get_no_server_error(live, reference, tokenizer):
    """Every generated request gets a 2xx or a 4xx whose body is OpenAI's error
    object (never FastAPI's own `detail`), and the server stays up and right."""
    schema = schemathesis.openapi.from_url(f"{live}/openapi.json")
    statuses: dict[str, dict[int, int]] = {}
    wrong: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            seen = statuses.setdefault(f"{label} {mode.value}", {})

            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def call(case):
                response = case.call(base_url=live, timeout=60)
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                if response.status_code >= 500 or (response.status_code >= 400 and not _openai_error(response)):
                    wrong.append(f"{label}: {case.body!r} -> {response.status_code} {response.text[:200]}")

            try:
                call()
            except Unsatisfiable:   # an operation without inputs has no invalid variant
                assert mode is schemathesis.GenerationMode.NEGATIVE
    assert not wrong, wrong
    refused = statuses["POST /v1/completions negative"]
    assert sum(refused.values()) >= EXAMPLES_PER_OPERATION // 2 and set(refused) <= {400, 404, 413, 422}, statuses
    check_completions(f"{live}/v1", reference, tokenizer)   # alive, and still right


def _openai_error(response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


def test_abandoned_streams_leave_no_block_in_use(live, reference, tokenizer):
    """Each stream is dropped at a random phase: after a random delay (queued,
    prefilling, or being handed off), right after its first token (the KV not
    yet moved), or after a few decoded tokens."""
    rng = random.Random(7)
    words = ["story", "fox", "river", "stone", "light", "garden", "music", "window"]

    async def one(session: aiohttp.ClientSession, gate: asyncio.Semaphore, i: int) -> int:
        """Chunks read before leaving."""
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(4, 60)))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "stream": True, "ignore_eos": True}
        leave_after = {0: None, 1: 1, 2: rng.randint(2, 12)}[i % 3]
        chunks = 0

        async def read() -> None:
            nonlocal chunks
            async with session.post(f"{live}/v1/completions", json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                        chunks += 1
                        if chunks == leave_after:
                            response.close()   # drops the connection, as a client that goes away
                            return

        async with gate:   # the clock of a timed leave starts once the request can go out
            if leave_after is None:
                try:
                    await asyncio.wait_for(read(), rng.uniform(0.0, 0.3))
                except asyncio.TimeoutError:
                    pass
            else:
                await read()
        return chunks

    async def main() -> list[int]:
        gate = asyncio.Semaphore(CONCURRENT_STREAMS)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await asyncio.gather(*(one(session, gate, i) for i in range(ABANDONED_STREAMS)))

    before = counter(f"{live}/v1", ABORTED)
    read = asyncio.run(main())
    left_early = sum(n == 0 for n in read)
    assert left_early > 0 and sum(n == 1 for n in read) > 0 and sum(n > 1 for n in read) > 0, read
    _wait_kv_idle(f"{live}/v1", timeout_s=20)     # past the transfer timeout (8 s), inside the lease (30 s)
    held = [line for line in urllib.request.urlopen(f"{live}/metrics", timeout=10).read().decode().splitlines()
            if line.startswith("pdserve_worker_kv_holds{")]
    assert held and all(float(line.split()[-1]) == 0 for line in held), held
    assert counter(f"{live}/v1", ABORTED) - before > 0    # some were cut off before they finished
    check_completions(f"{live}/v1", reference, tokenizer)
