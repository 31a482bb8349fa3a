"""One load-test run: send the requests on their arrival schedule and collect the records.

Life cycle of a run (`run_benchmark`):
1. The arrival schedule is fixed up front (arrivals.arrival_offsets).
2. At each arrival time a task starts for that request; with --max-concurrency
   it first waits for one of that many slots, and is sent (and timed) only once
   it has one.
3. The run ends when every request has finished, or early: at --max-duration,
   or when the run is cancelled (Ctrl-C cancels the main task: `run_cancellable`).
   Stopping early cancels the requests in flight; they are recorded as failed
   and `unfinished`, requests not yet sent are left out, and the result says
   why it stopped (`interrupted`). A cancelled run returns its partial result
   instead of raising, so Ctrl-C still prints what was measured.

The connection pool is unbounded: concurrency is the arrival process's and the
semaphore's to decide, never a hidden pool limit.
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from tqdm import tqdm

from bench.loadtest.arrivals import arrival_offsets, paced
from bench.loadtest.client import RequestRecord, build_payload, send_request
from bench.loadtest.datasets import SampleRequest

T = TypeVar("T")


@dataclass(frozen=True)
class RunConfig:
    """How to run one benchmark; validated on construction (ValueError names the flag)."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    max_duration: float = 600.0
    request_timeout: float = 300.0
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int = 0
    disable_tqdm: bool = False
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not self.endpoint.rstrip("/").endswith("completions"):
            raise ValueError(f"--endpoint must be /v1/completions or /v1/chat/completions, got {self.endpoint}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"--burstiness must be a positive number, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.max_duration > 0:
            raise ValueError(f"--max-duration must be > 0 seconds, got {self.max_duration}")
        if not (self.request_timeout > 0 and math.isfinite(self.request_timeout)):
            raise ValueError(f"--request-timeout must be a finite number of seconds > 0, got {self.request_timeout}")

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")


@dataclass(frozen=True)
class RunResult:
    """The requests that were sent, in send order; times are perf_counter() seconds."""

    config: RunConfig
    records: list[RequestRecord]
    num_requests: int
    start_time: float
    duration: float
    interrupted: str | None  # why the run stopped early; None when every request ran to its end
    cancelled: bool = False  # stopped by a cancellation (Ctrl-C), not by the time limit


async def run_benchmark(requests: Sequence[SampleRequest], config: RunConfig, *,
                        tokenizer: Any = None, offsets: Sequence[float] | None = None) -> RunResult:
    """Run `requests` against the server (see the module docstring for the life cycle).

    `tokenizer` counts output tokens when the server sends no usage. `offsets`:
    each request's send time in seconds from the start (default: drawn from the
    config's rate and burstiness). Never raises for failed requests; a
    cancellation ends the run with a partial result.
    """
    if offsets is None:
        offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
    elif len(offsets) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(offsets)} send times")
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    records: list[RequestRecord] = []
    tasks: list[asyncio.Future] = []
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    progress = tqdm(total=len(requests), desc=f"{rate} req/s", unit="req", disable=config.disable_tqdm)
    failures = 0

    async def one(session: aiohttp.ClientSession, request: SampleRequest, record: RequestRecord) -> None:
        nonlocal failures
        payload = build_payload(request, model=config.model, chat=config.chat,
                                temperature=config.temperature, ignore_eos=config.ignore_eos)
        if slots is None:
            await send_request(session, config.url, payload, record, chat=config.chat,
                               timeout_s=config.request_timeout, tokenizer=tokenizer, api_key=config.api_key)
        else:
            async with slots:
                await send_request(session, config.url, payload, record, chat=config.chat,
                                   timeout_s=config.request_timeout, tokenizer=tokenizer, api_key=config.api_key)
        progress.update(1)
        if not record.succeeded:
            failures += 1
            progress.set_postfix(failed=failures)

    async def drive(session: aiohttp.ClientSession, start: float) -> None:
        async for index in paced(offsets, start):
            request = requests[index]
            record = RequestRecord(index, request.prompt_len, request.expected_output_len,
                                   scheduled_offset=offsets[index])
            records.append(record)
            tasks.append(asyncio.ensure_future(one(session, request, record)))
        await asyncio.gather(*tasks)

    interrupted, cancelled = None, False
    # limit=0: no pool limit (see the module docstring).
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        driver = asyncio.ensure_future(drive(session, start))
        try:
            done, _ = await asyncio.wait({driver}, timeout=config.max_duration)
            if done:
                driver.result()  # a bug in the driver must not pass for a finished run
            else:
                interrupted = f"--max-duration {config.max_duration:g} s reached"
        except asyncio.CancelledError:
            interrupted, cancelled = "interrupted (Ctrl-C)", True
            _uncancel_current_task()
        finally:
            driver.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(driver, *tasks, return_exceptions=True)
            stop = time.perf_counter()
            progress.close()
    sent = [r for r in records if r.send_time is not None]
    for record in sent:
        if record.end_time is None:
            record.end_time = stop
            record.unfinished = True
            record.error = f"unfinished when the run stopped ({interrupted})"
    return RunResult(config, sent, len(requests), start, stop - start, interrupted, cancelled)


def run_cancellable(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(coro) where the first Ctrl-C (SIGINT) cancels the coroutine's
    task, so a run returns what it measured, on every Python version (asyncio.run
    does so itself only from 3.11); a second one raises KeyboardInterrupt. Off the
    main thread it is plain asyncio.run."""
    async def main() -> T:
        task = asyncio.ensure_future(coro)
        loop = asyncio.get_running_loop()

        def on_sigint() -> None:
            task.cancel()
            loop.remove_signal_handler(signal.SIGINT)   # the next Ctrl-C is Python's KeyboardInterrupt

        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        except (RuntimeError, ValueError, NotImplementedError):   # not the main thread, or no signals here
            return await task
        try:
            return await task
        finally:
            loop.remove_signal_handler(signal.SIGINT)
    return asyncio.run(main())


def _uncancel_current_task() -> None:
    """Mark the cancellation we answer with a partial result as handled (Python 3.11+), so
    the caller's task does not stay "cancelling" (which would trip its later timeouts)."""
    task = asyncio.current_task()
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()
