"""The colocated worker: one engine that prefills and decodes, no KV transfer
(the baseline every disaggregated benchmark compares against; plain class,
decode_server.py wraps it for Ray Serve).

    generate(request) ─▶ waiting ─▶ running (prefill, then decode in the same batch)
                      ─▶ finished (blocks freed)   or aborted when the caller stops reading
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from engine.async_engine import AsyncEngine
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class ColocatedWorker:
    def __init__(self, config: EngineConfig, *, name: str = "colocated"):
        """Call from a running event loop, then `await start()`."""
        self.config = config
        self.name = name
        self._engine = AsyncEngine(lambda: LLMEngine(config), name=f"{name}-engine")

    async def start(self) -> None:
        await self._engine.ready()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs until finished; closing early aborts the request."""
        stream = self._engine.open_stream(request_id)
        finished = False
        try:
            await self._engine.call(_add_request, request_id, prompt_token_ids, params)
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._engine.close_stream(request_id)
            if not finished:
                try:
                    await asyncio.shield(self._engine.call(_abort, request_id))
                except Exception:  # noqa: BLE001 - the engine is gone; nothing left to free
                    log.debug("abort of %s after the engine stopped", request_id)

    def check_health(self) -> None:
        """Raises when the engine loop has stopped (a step failed, or a TP rank died)."""
        self._engine.check_alive()

    def stats(self) -> dict[str, float]:
        engine = self._engine.engine
        if engine is None:
            return {}
        bm = engine.block_manager
        return {
            "free_kv_blocks": float(bm.num_free_blocks),
            "num_waiting": float(len(engine.scheduler.waiting)),
            "num_running": float(len(engine.scheduler.running)),
            "kv_cache_usage": 1.0 - bm.num_free_blocks / bm.num_blocks,
        }

    def shutdown(self) -> None:
        self._engine.shutdown()


def _add_request(engine: LLMEngine, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
    engine.add_request(request_id, prompt_token_ids, params)


def _abort(engine: LLMEngine, request_id: str) -> None:
    engine.abort_request(request_id)
