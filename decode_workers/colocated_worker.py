"""The colocated worker: one engine that prefills and decodes, no KV transfer
(the baseline every disaggregated benchmark compares against; plain class,
decode_server.py wraps it for Ray Serve).

    generate(request) ─▶ waiting ─▶ running (prefill, then decode in the same batch)
                      ─▶ finished (blocks freed)   or aborted when the caller stops reading
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from engine.async_engine import AsyncEngine
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


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
            async for out in self._engine.outputs(stream):
                finished = out.finished
                yield out
        finally:
            self._engine.close_stream(request_id)
            if not finished:
                await self._engine.call_for_cleanup(_abort, request_id)

    def check_health(self) -> None:
        """Raises when the engine loop has stopped (a step failed, or a TP rank died)."""
        self._engine.check_alive()

    def stats(self) -> dict[str, float]:
        """Load figures for routing and metrics."""
        return self._engine.load_stats()

    def shutdown(self) -> None:
        self._engine.shutdown()


def _add_request(engine: LLMEngine, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
    engine.add_request(request_id, prompt_token_ids, params)


def _abort(engine: LLMEngine, request_id: str) -> None:
    engine.abort_request(request_id)
