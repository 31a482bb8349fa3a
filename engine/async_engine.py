"""An LLMEngine on its own thread, for asyncio servers.

    asyncio callers ── call(fn) ──▶ calls queue ─┐
                   ◀──────── output sinks ───────┤ engine thread:
                                                 │   run queued calls
                                                 │   run tickers (transfer polling, leases)
                                                 │   engine.step() → outputs → one put per sink
                                                 └── sleep until woken (or a ticker is busy)

On CPU an engine may lend its cores to other engines on the machine while it
sleeps, and borrow theirs while it steps (engine/core_lending.py,
EngineConfig.cpu_core_ledger); a prefill-only engine lends but never borrows.

Every touch of the engine happens on the engine thread, so the engine needs no
locks; the event loop never blocks on a forward pass. A ticker is a function
called with the engine once per loop iteration; it returns True while it has
work in flight (the loop then polls again soon instead of sleeping).

Outputs go to the sink each request was attached to (`attach`): one `put` per
step with all of that sink's requests' outputs (a server's per-subscriber
outbox, or one request's first-token handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from engine.core_lending import NoLending, join_ledger
from engine.errors import EngineStoppedError
from engine.llm_engine import LLMEngine, StepStats
from engine.outputs import RequestOutput
from engine.step_cost import COST_WARMUP_STEPS, EngineCosts, calibrate_prefill_cost

log = logging.getLogger(__name__)

Ticker = Callable[[LLMEngine], bool]
_BUSY_POLL_S = 0.002
_IDLE_WAIT_S = 0.5
REPEATED_FAILURE_LOG_S = 60.0    # a ticker failing the same way again is logged this often, with a count
# a step that has run this long is stuck (a TP rank alive but hung, a kernel that never returns):
# the health check says so, and Serve replaces the replica; far past any real step, first ones included
STUCK_STEP_S = 300.0


class OutputSink(Protocol):
    """Where a request's outputs go. Both methods are called on the engine thread."""

    def put(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs of this sink's requests (never empty)."""

    def fail(self, exc: BaseException) -> None:
        """The engine stopped: every request of this sink has ended with `exc`."""


class AsyncEngine:
    def __init__(self, make_engine: Callable[[], LLMEngine], *, prefill: bool = True, decode: bool = True,
                 name: str = "engine", cost_warmup_steps: int = COST_WARMUP_STEPS,
                 stuck_step_s: float = STUCK_STEP_S):
        """Starts the thread, which builds the engine with `make_engine()`;
        await `ready()` before anything else. The first `cost_warmup_steps`
        steps stay out of the cost estimates; a step running for longer than
        `stuck_step_s` fails `check_alive`."""
        _resolve_lazy_imports()
        self._make_engine = make_engine
        self._step_kwargs = {"prefill": prefill, "decode": decode}
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._calls_lock = threading.Lock()   # a call is queued before the thread stops taking calls, or refused
        self._calls_closed = False
        self._everything_failed = False       # _fail_everything ran (under _calls_lock)
        self._call_in_flight: asyncio.Future | None = None   # the future of the call the engine thread runs
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sinks: dict[str, OutputSink] = {}
        self._sinks_lock = threading.Lock()
        # fed on the engine thread, read by load_stats on others (each figure one attribute)
        self.costs = EngineCosts(warmup_steps=cost_warmup_steps)
        self._recent_steps: deque[tuple[int, StepStats]] = deque(maxlen=512)
        self._tickers: list[Ticker] = []
        # ticker name -> (its last error's type, failures since it was logged, when): polled every few
        # ms, a ticker that keeps failing would log a traceback each time
        self._ticker_failures: dict[str, tuple[str, int, float]] = {}
        self._stop_hooks: list[Callable[[BaseException], None]] = []
        self._failure: BaseException | None = None
        self._cores = NoLending()
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self.engine: LLMEngine | None = None
        self.stuck_step_s = stuck_step_s
        # (monotonic start, what) of the engine thread's work now: a step, a call, a ticker
        self._working: tuple[float, str] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    async def ready(self) -> LLMEngine:
        """Waits for the engine to be built; raises what building it raised."""
        return await asyncio.shield(self._ready)

    def check_alive(self) -> None:
        """Raises EngineStoppedError when the engine thread is gone, a
        tensor-parallel rank process of its engine died (the engine thread may
        then wait in a collective for good), or its current step has run for
        longer than `stuck_step_s`, and so has a call or a ticker, which run
        collectives and transport calls too (a rank that is alive but hung holds
        the others in a collective, whose timeout is days)."""
        self._check_running()
        self._check_not_stuck()

    def _check_not_stuck(self) -> None:
        working = self._working
        if working is not None and (running := time.monotonic() - working[0]) > self.stuck_step_s:
            raise EngineStoppedError(f"the engine is stuck: its current {working[1]} has run for {running:.0f} s "
                                     f"(more than {self.stuck_step_s:g} s); a tensor-parallel rank, a kernel or "
                                     "a transfer hangs")

    # ---- asyncio side -------------------------------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn(engine, *args) on the engine thread between steps; returns its result."""
        future = asyncio.get_running_loop().create_future()
        self._enqueue(fn, args, future)
        return await future

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs fn(engine, *args) on the engine thread between steps, without
        waiting for it; a failure is logged."""
        self._enqueue(fn, args, None)

    def _check_running(self) -> None:
        """check_alive without the stuck verdict: the thread and the ranks are there."""
        if self._failure is not None or self._stop.is_set() or not self._thread.is_alive():
            raise EngineStoppedError(f"the engine is not running: {self._failure or 'shut down'}")
        if self.engine is not None and (problem := self.engine.rank_problem()):
            raise EngineStoppedError(f"the engine is not running: {problem}")

    def _enqueue(self, fn: Callable[..., Any], args: tuple, future: asyncio.Future | None,
                 check: Callable[[], None] | None = None) -> None:
        """Queues a call, or raises EngineStoppedError: never a call the stopping thread leaves unanswered.
        `check` (default check_alive) says whether the engine takes calls."""
        with self._calls_lock:
            if self._calls_closed:
                raise EngineStoppedError(f"the engine is not running: {self._failure or 'shut down'}")
            (check or self.check_alive)()
            self._calls.put((fn, args, future))
        self._wake.set()

    def attach(self, request_id: str, sink: OutputSink) -> None:
        """Sends the request's outputs to `sink`. Attach before the request is added."""
        with self._sinks_lock:
            self._sinks[request_id] = sink

    def detach(self, request_id: str) -> None:
        """Stops delivering the request's outputs to its sink."""
        with self._sinks_lock:
            self._sinks.pop(request_id, None)

    async def call_for_cleanup(self, fn: Callable[..., Any], *args: Any) -> None:
        """`call` for clean-up paths (freeing a request's blocks): it runs even if
        the caller is being cancelled or the engine looks stuck (then without
        waiting for it), and a stopped engine has nothing left to free."""
        try:
            try:
                self._check_not_stuck()
                future = asyncio.get_running_loop().create_future()
            except EngineStoppedError:
                # queued unanswered: it runs should the long step end, and nobody waits on an engine
                # that may never take it
                future = None
            self._enqueue(fn, args, future, check=self._check_running)
            if future is not None:
                await asyncio.shield(future)
        except EngineStoppedError:
            log.debug("clean-up %s skipped: the engine has stopped", getattr(fn, "__name__", fn))

    def load_stats(self) -> dict[str, float]:
        """The engine's load for routing and metrics (read from another thread
        without locking: approximate); empty before the engine is built."""
        engine = self.engine
        if engine is None:
            return {}
        blocks = engine.block_manager
        stats = {
            "free_kv_blocks": float(blocks.num_free_blocks),
            "num_kv_blocks": float(blocks.num_blocks),
            "kv_block_size": float(blocks.block_size),
            "num_waiting": float(len(engine.scheduler.waiting)),
            "num_running": float(len(engine.scheduler.running)),
            "kv_cache_usage": 1.0 - blocks.num_free_blocks / blocks.num_blocks,
            "torch_threads": float(engine.worker.num_threads),
            "cpu_cores_borrowed": float(self._cores.borrowed),
            "cpu_borrowed_steps": float(self._cores.steps_with_borrowed),
            "num_preemptions": float(engine.scheduler.num_preemptions),
            "prefix_cache_queried_tokens": float(engine.scheduler.prefix_cache_queried_tokens),
            "prefix_cache_hit_tokens": float(engine.scheduler.prefix_cache_hit_tokens),
        }
        stats.update(self.costs.stats())
        return stats

    def add_ticker(self, ticker: Ticker) -> None:
        """Registers a function the engine thread calls every iteration."""
        self._tickers.append(ticker)
        self._wake.set()

    def add_stop_hook(self, hook: Callable[[BaseException], None]) -> None:
        """Registers a function the engine thread calls once, with the reason, when
        its loop ends: to fail the waits that only the loop would have settled.
        Register it before the loop can end (with the tickers)."""
        self._stop_hooks.append(hook)

    def wake(self) -> None:
        self._wake.set()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stops the thread and the engine (its TP ranks). Idempotent. A thread that does not
        stop within `timeout_s` (stuck in a step) has the TP ranks terminated under it."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive() and self.engine is not None:
                log.warning("%s: the engine thread did not stop within %.0f s; terminating its tensor-parallel "
                            "ranks", self._thread.name, timeout_s)
                self.engine.kill_ranks()
            if self._thread.is_alive():   # stuck for good (a kernel, an NCCL peer killed under it): its
                # waiters would wait with it; they hear now (the thread, should it end, finds them answered)
                self._fail_everything(EngineStoppedError(f"the engine thread did not stop within {timeout_s:g} s"))

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._make_engine()
        except BaseException as exc:  # noqa: BLE001 - handed to ready()
            self._failure = exc
            settle_from_thread(self._ready, exc=exc)
            self._fail_everything(exc)
            return
        try:
            self.costs.prefill_s_per_token = calibrate_prefill_cost(self.engine)
        except Exception:  # noqa: BLE001 - a figure for estimates: the engine serves without it
            log.exception("calibrating the prefill cost failed; estimates wait for measured steps")
        self._cores = _join_core_ledger(self.engine, borrows=self._step_kwargs["decode"])
        settle_from_thread(self._ready, self.engine)
        try:
            self._serve(self.engine)
        except BaseException as exc:  # noqa: BLE001 - a step failed: every waiter hears why
            log.exception("the engine loop stopped")
            self._failure = exc
        finally:
            try:
                self._fail_everything(self._failure or EngineStoppedError("the engine was shut down"))
            finally:
                try:
                    self._cores.close()
                finally:
                    self.engine.shutdown()

    def _serve(self, engine: LLMEngine) -> None:
        while not self._stop.is_set():
            self._run_calls(engine)
            busy = False
            for ticker in self._tickers:
                name = getattr(ticker, "__qualname__", "ticker")
                try:
                    with self._at_work(f"poll {name}"):
                        busy |= bool(ticker(engine))
                    if name in self._ticker_failures and (unsaid := self._ticker_failures.pop(name)[1]):
                        log.warning("ticker %s works again (%d failures since the last logged)", name, unsaid)
                except Exception as exc:  # noqa: BLE001 - one bad poll must not stop every request ...
                    if problem := engine.rank_problem():     # ... but no rank call can work again
                        raise EngineStoppedError(f"a tensor-parallel rank cannot serve: {problem}") from None
                    self._log_ticker_failure(name, exc)
                    busy = True
            if engine.has_unfinished_requests():
                self._cores.at_work()
                with self._at_work("step"):
                    outputs = engine.step(**self._step_kwargs)
                self.deliver(outputs)
                self._measure(engine)
                if not engine.last_step_empty:
                    continue
                # requests wait for blocks held or reserved (KV to send, KV arriving): poll, not spin
                busy = True
            self._cores.idle()
            self._wake.wait(_BUSY_POLL_S if busy else _IDLE_WAIT_S)
            self._wake.clear()

    def _log_ticker_failure(self, name: str, exc: Exception) -> None:
        """Logs a ticker's failure with its traceback, unless it failed with the same kind of
        error (its text may name ids that change) within REPEATED_FAILURE_LOG_S: then it is
        counted, and the count logged with the next one."""
        error, now = type(exc).__qualname__, time.monotonic()
        last, unsaid, said = self._ticker_failures.get(name, ("", 0, float("-inf")))
        if error == last and now - said < REPEATED_FAILURE_LOG_S:
            self._ticker_failures[name] = (error, unsaid + 1, said)
            return
        log.exception("ticker %s failed%s", name, f" (and {unsaid} times more since it was last logged)"
                      if unsaid else "")
        self._ticker_failures[name] = (error, 0, now)

    @contextlib.contextmanager
    def _at_work(self, what: str):
        """Engine thread: marks `what` as running, for check_alive's stuck check."""
        self._working = (time.monotonic(), what)
        try:
            yield
        finally:
            self._working = None

    def _run_calls(self, engine: LLMEngine) -> None:
        while True:
            try:
                fn, args, future = self._calls.get_nowait()
            except queue.Empty:
                return
            self._call_in_flight = future
            try:
                with self._at_work(f"call {getattr(fn, '__qualname__', 'call')}"):
                    result = fn(engine, *args)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller
                if future is None:
                    log.exception("engine call %s failed", getattr(fn, "__qualname__", fn))
                elif isinstance(exc, Exception):
                    settle_from_thread(future, exc=exc)
                else:       # the engine thread ends: its caller is answered, not left waiting
                    settle_from_thread(future, exc=EngineStoppedError(f"the engine thread stopped: {exc!r}"))
                if not isinstance(exc, Exception):
                    raise
            else:
                if future is not None:
                    settle_from_thread(future, result)
            finally:
                self._call_in_flight = None

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Engine thread only: one put per sink with all of its requests' outputs
        (a step's, or ones a call made outside a step)."""
        batches: dict[int, tuple[OutputSink, list[RequestOutput]]] = {}
        with self._sinks_lock:
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    batches.setdefault(id(sink), (sink, []))[1].append(out)
        for sink, batch in batches.values():
            sink.put(batch)

    def take_step_samples(self) -> list[tuple[int, StepStats]]:
        """The steps run since the last call (at most the last 512), each with
        its index in this engine's life (a young engine's first steps are slow:
        warm-up). Any thread."""
        samples = []
        while True:
            try:
                samples.append(self._recent_steps.popleft())
            except IndexError:
                return samples

    def _measure(self, engine: LLMEngine) -> None:
        """Keeps the last step for take_step_samples and folds it into the cost
        estimates (EngineCosts: past the warm-up, on the engine's own cores)."""
        step, engine.last_step = engine.last_step, None
        if step is None:
            return
        self.costs.observe(step.num_decode_seqs, step.num_prefill_tokens, step.duration_s,
                           borrowed_cores=bool(step.borrowed_threads))
        self._recent_steps.append((self.costs.num_steps, step))

    def _fail_everything(self, exc: BaseException) -> None:
        """Refuses new calls and fails every waiter: queued calls, sinks, stop hooks (once, from
        whichever thread comes first: the engine thread as it ends, or a shutdown it outlived)."""
        with self._calls_lock:
            self._calls_closed = True
            if self._everything_failed:
                return
            self._everything_failed = True
        in_flight = self._call_in_flight       # (a stuck call's, when a shutdown outlived the thread)
        if in_flight is not None:
            settle_from_thread(in_flight, exc=EngineStoppedError(str(exc)))
        while True:
            try:
                _, _, future = self._calls.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                settle_from_thread(future, exc=EngineStoppedError(str(exc)))
        with self._sinks_lock:
            sinks = {id(sink): sink for sink in self._sinks.values()}
        for sink in sinks.values():
            try:
                sink.fail(exc)
            except Exception:  # noqa: BLE001 - the other sinks and the hooks still hear
                log.exception("failing the output sink %r failed", sink)
        for hook in self._stop_hooks:
            try:
                hook(exc)
            except Exception:  # noqa: BLE001 - the other hooks still run
                log.exception("stop hook %s failed", getattr(hook, "__qualname__", hook))


def _join_core_ledger(engine: LLMEngine, *, borrows: bool):
    """The engine's slot in its CPU core ledger: CPU engines of one rank with
    a ledger configured (a TP gang's ranks keep their threads)."""
    config = engine.config
    if engine.worker.device.type != "cpu" or config.tensor_parallel_size != 1:
        return NoLending()
    return join_ledger(config.cpu_core_ledger, engine.worker.num_threads, borrows=borrows)


def _resolve_lazy_imports() -> None:
    """transformers resolves its top-level names lazily, and two threads doing
    that at once can fail ("cannot import name 'AutoConfig'"): resolve the ones
    the engine uses here, on the caller's thread, before any engine thread runs."""
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401


def settle_from_thread(future: asyncio.Future, value: Any = None, *, exc: BaseException | None = None) -> None:
    """Sets `future`'s result (or exception) from any thread, on its own event
    loop; a future that is already done (e.g. cancelled) is left alone."""
    def settle() -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value)
    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:   # its loop is closed: nobody waits on it any more
        pass
