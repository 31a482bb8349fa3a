"""A live disaggregated deployment whose KV caches hold only a few requests,
under many more concurrent requests than that: the calls that free a prefill
replica's held KV (a decode replica's send_kv and release) must reach it while
dozens of prompts wait in its engine for those very blocks. When Serve bounded
the calls in flight to a worker replica (64), the waiting prompts took every
slot, the send_kv calls waited behind them until the holds' leases ran out,
and the requests were prefilled again (or failed)."""

from __future__ import annotations

import asyncio

import pytest

ray = pytest.importorskip("ray")
aiohttp = pytest.importorskip("aiohttp")

from ray import serve  # noqa: E402

from tests.test_serving_e2e import _wait_kv_idle, counter, deploy  # noqa: E402

CONCURRENT = 160           # well past the 64 calls Serve used to let into a worker replica
MAX_TOKENS = 16
LEASE_S = 6                # short: a hold whose send_kv is held back expires within the test
MIGRATIONS = "pdserve_request_migrations_total"
ERRORS_SAMPLE = "pdserve_request_errors_total"


@pytest.fixture(scope="module")
def tight(ray_cluster, model_dirs):
    """The tiny checkpoint with ~50 KV blocks of 8 tokens per worker: ~6 of the
    ~50-token prompts below held on the prefill side, ~5 running on the decode side."""
    base = deploy(ray_cluster, model_dirs["tiny"], "tight",
                  engine={"block_size": 8, "max_num_seqs": 4, "max_num_batched_tokens": 256,
                          "kv_cache_memory_gib": 0.0002},
                  kv_transfer={"timeout_s": 20, "lease_s": LEASE_S})
    yield base
    serve.delete("tight")


async def _complete(session: aiohttp.ClientSession, base: str, n: int) -> tuple[int, int]:
    prompt = " ".join(f"word{(n * 7 + i) % 50}" for i in range(40))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    async with session.post(f"{base}/completions", json=body) as response:
        payload = await response.json()
        return response.status, (payload.get("usage") or {}).get("completion_tokens", 0)


def test_kv_is_handed_off_while_more_prompts_wait_than_the_caches_hold(tight):
    before = counter(tight, MIGRATIONS), counter(tight, ERRORS_SAMPLE)

    async def burst():
        timeout = aiohttp.ClientTimeout(total=240)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await asyncio.gather(*(_complete(session, tight, n) for n in range(CONCURRENT)))

    results = asyncio.run(burst())
    assert results == [(200, MAX_TOKENS)] * CONCURRENT
    # every hand-off found its KV still held: nothing was prefilled a second time
    assert (counter(tight, MIGRATIONS), counter(tight, ERRORS_SAMPLE)) == before
    _wait_kv_idle(tight)
