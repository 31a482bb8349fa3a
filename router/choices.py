"""One request's generations: a Generation per choice (its backend stream, its
timings and metrics, its admission ticket), and Choices, the `n` of them read as
one stream of (choice index, output)."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time

from engine.outputs import RequestOutput, joined
from engine.sampling_params import SamplingParams
from router.admission import AdmissionControl, Admitted
from router.backend import BackendUnavailableError, GenerationBackend
from router.metrics import ServingMetrics
from router.timings import RequestTimings

log = logging.getLogger(__name__)


def params_of_choice(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling parameters: a seed moves on by the index (vLLM's), so
    seeded choices differ from each other and each is reproducible. The seed is taken as
    64 bits unsigned (the generator's), so it wraps past 2**64 and a choice of seed -2 + 1
    is seeded (-1 is a request's "no seed", never a choice's)."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2**64)


class Choices:
    """A request's generations, one per choice, read as one stream of (choice index,
    output), in the order the outputs come. One choice is read directly; several,
    each by a task of its own, in a context of its own: each choice's calls to the
    workers are then requests of their own, not calls of the HTTP request (Ray
    Serve matches the calls one request makes to replicas by the request's id, and
    two at once under one id could wait for ever); `close` cleans up after them."""

    def __init__(self, generations: list[Generation], prompt_tokens: int | None = None):
        """`prompt_tokens`: the request's prompts' tokens, each prompt once (default: the
        first generation's prompt, which the others share)."""
        self.generations = generations
        self.n = len(generations)
        self.prompt_tokens = generations[0].timings.prompt_tokens if prompt_tokens is None else prompt_tokens
        self._finished: set[int] = set()
        self._arrivals: asyncio.Queue | None = None    # (index, output | None at its end | an exception)
        self._readers: list[asyncio.Task] = []

    @property
    def all_finished(self) -> bool:
        return len(self._finished) == self.n

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next output of any choice; None when a choice's stream ended before its
        last output (every other output is delivered first when there is one choice)."""
        if self.n == 1:
            out = await self.generations[0].next()
            item = None if out is None else (0, out)
        else:
            if self._arrivals is None:
                self._arrivals = asyncio.Queue()
                loop = asyncio.get_running_loop()
                self._readers = [contextvars.Context().run(loop.create_task, self._read(i)) for i in range(self.n)]
            while True:
                index, out = await self._arrivals.get()
                if isinstance(out, BaseException):
                    raise out
                if out is not None or index not in self._finished:
                    break                       # (a finished choice's end marker: read on)
            item = None if out is None else (index, out)
        if item is not None and item[1].finished:
            self._finished.add(item[0])
        return item

    async def _read(self, index: int) -> None:
        gen = self.generations[index]
        try:
            while True:
                out = await gen.next()
                self._arrivals.put_nowait((index, out))
                if out is None or out.finished:
                    return
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise                 # close(): this reader is being stopped
            # a cancel raised from below (a call the replica's side ended): the choice failed; left
            # unsaid, next() would wait for ever on a reader that is gone
            self._arrivals.put_nowait((index, BackendUnavailableError.public(
                f"choice {index}'s stream was cancelled")))
        except Exception as exc:  # noqa: BLE001 - the reader of the stream hears it
            self._arrivals.put_nowait((index, exc))

    async def run_to_end(self) -> list[RequestOutput]:
        """Each choice's finished output, with its whole text, token ids and logprobs (the
        backend's outputs are deltas)."""
        if self.n == 1:
            final = await self.generations[0].run_to_end()
            self._finished.add(0)
            return [final]
        deltas: list[list[RequestOutput]] = [[] for _ in range(self.n)]
        while not self.all_finished:
            item = await self.next()
            if item is None:
                raise BackendUnavailableError.public("the generation stream ended before the request finished")
            deltas[item[0]].append(item[1])
        return [joined(d) for d in deltas]

    async def close(self, finish_reason: str | None) -> None:
        """Stops reading and closes every choice's stream: a choice that finished with its
        own finish reason, the others with `finish_reason` (see Generation.close)."""
        cancelled = False
        for task in self._readers:
            task.cancel()
        for task in self._readers:     # each must leave its stream before the stream is closed
            while not task.done():
                try:
                    await asyncio.wait({task})
                except asyncio.CancelledError:    # this close itself: finish it, then pass the cancel on
                    cancelled = True
        for index, gen in enumerate(self.generations):    # every one, even when this close is cancelled
            ended = index in self._finished and gen.last is not None
            try:
                await gen.close(gen.last.finish_reason if ended else finish_reason)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError


class Generation:
    """One request's backend stream plus the router's timings; metrics recorded once, on close."""

    def __init__(self, backend: GenerationBackend, metrics: ServingMetrics, admission: AdmissionControl | None,
                 request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float,
                 admitted: Admitted | None, shares_prompt: bool = False, offered: bool = True,
                 max_tokens_asked: int | None = None, output_returned: bool = True):
        """`admitted`: admission control's ticket for it (None: admission control is off).
        `shares_prompt`: a later choice of the same prompt, which reads the prompt from the
        prefix cache: an arrival to decode, with no prompt of its own to prefill.
        `offered`: counted as an arrival (not a client's retry, counted when first offered).
        `max_tokens_asked`: the arrival's output bound (None: only the context's room).
        `output_returned` False: the token generated only to score the prompt (echo with
        max_tokens 0) is not returned, so not counted as generated either."""
        self._backend, self._metrics, self._admission = backend, metrics, admission
        self.request_id = request_id
        self.outputs = backend.generate(request_id, prompt_ids, params)
        self.timings = RequestTimings(arrival_time=arrival, prompt_tokens=len(prompt_ids))
        if offered:
            metrics.observe_arrival(0 if shares_prompt else len(prompt_ids), max_tokens_asked)
        self.last: RequestOutput | None = None
        self._closed = False
        self._admitted = admitted
        self._waiting = admitted is not None     # counted by admission control until its first token
        self._output_returned = output_returned

    def _done_waiting(self) -> None:
        if self._waiting:
            self._waiting = False
            self._admission.first_token(self._admitted)

    async def next(self) -> RequestOutput | None:
        """The next output, or None when the backend's stream ended."""
        try:
            out = await anext(self.outputs)
        except StopAsyncIteration:
            return None
        now = time.monotonic()
        if self.timings.first_token_time is None and out.num_output_tokens:
            self.timings.first_token_time = now
            self._metrics.observe_first_token(self.timings.time_to_first_token)
            self._done_waiting()
        if out.finished:
            self.timings.finished_time = now
        self.last = out
        return out

    async def run_to_end(self) -> RequestOutput:
        """The finished output, with the whole text, token ids and logprobs (the
        backend's outputs are deltas)."""
        deltas = []
        while (out := await self.next()) is not None:
            deltas.append(out)
            if out.finished:
                return joined(deltas)
        raise BackendUnavailableError.public("the generation stream ended before the request finished")

    async def close(self, finish_reason: str | None) -> None:
        """Close the backend stream (aborting the request if it is still running), record metrics."""
        if self._closed:
            return
        self._closed = True
        self._done_waiting()
        generated = self.last.num_output_tokens if self.last is not None else 0
        if self._admitted is not None:
            ran_to_end = self.last is not None and self.last.finished and finish_reason in ("stop", "length")
            self._admission.finished(self._admitted, generated if ran_to_end else None)
        aclose = getattr(self.outputs, "aclose", None)
        try:
            if aclose is not None:
                await aclose()
        except Exception:
            # The response is decided by now; a failed abort must not turn it into an error.
            log.exception("closing the backend stream of %s failed", self.request_id)
        finally:   # a close cancelled while it aborts still counts the request and drops its phases
            self._record(generated, finish_reason)

    def _record(self, generated: int, finish_reason: str | None) -> None:
        t = self.timings
        if t.finished_time is None:
            t.finished_time = time.monotonic()
        t.generation_tokens = generated if self._output_returned else 0
        t.finish_reason = finish_reason
        phases = self._backend.phase_timings(self.request_id)
        if phases is not None:
            t.phases = phases
        self._metrics.observe_request(t)
