"""A new engine's first steps stay out of the cost estimates it reports (the
per-token prefill cost and the decode step fit admission control prices
requests with): they are slow, and a replica joining a pool would otherwise
make the router refuse requests until its estimates settled. Until then it
reports the prefill cost it calibrated at start-up."""

from __future__ import annotations

import asyncio
import time

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.async_engine import AsyncEngine


class _Finished:
    def __init__(self, loop):
        self._loop = loop
        self.done = loop.create_future()

    def put(self, outputs):
        if any(o.finished for o in outputs):
            self._loop.call_soon_threadsafe(self.done.set_result, None)

    def fail(self, exc):
        self._loop.call_soon_threadsafe(self.done.set_exception, exc)


def test_the_first_steps_stay_out_of_the_cost_estimates(model_dirs):
    config = EngineConfig(model=str(model_dirs["tiny"]), dtype="float32", device="cpu", max_model_len=128,
                          cpu_threads=1)

    async def run() -> list:
        engine = AsyncEngine(lambda: LLMEngine(config), decode=False, name="warmup-test", cost_warmup_steps=3)
        await engine.ready()
        costs = [engine.load_stats().get("prefill_s_per_token")]     # before any request
        for i in range(5):                 # one prompt, one step each
            sink = _Finished(asyncio.get_running_loop())
            engine.attach(f"r{i}", sink)
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            engine.submit(lambda e, rid=f"r{i}": e.add_request(rid, [1, 5, 9, 13, 2 + i], params))
            await asyncio.wait_for(sink.done, 60)
            deadline = time.monotonic() + 30       # the step is measured after its outputs go out
            while engine.costs.num_steps < i + 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            costs.append(engine.load_stats().get("prefill_s_per_token"))
        steps = [index for index, _ in engine.take_step_samples()]
        engine.shutdown()
        return costs, steps

    costs, steps = asyncio.run(run())
    assert steps == [1, 2, 3, 4, 5]        # every step is still sampled (the autoscaler skips its own warm-up)
    calibrated = costs[0]
    assert calibrated is not None and calibrated > 0
    assert costs[1:4] == [calibrated] * 3  # the warm-up steps change nothing
    # measured from the fourth step on: the 5-token prompts' own steps replace the calibration
    assert costs[4] != calibrated and costs[5] != costs[4]


def test_the_engines_preemptions_are_in_its_load_stats(model_dirs):
    # the scheduler counted them for metrics and nothing exported them (pdserve_worker_preemptions_total)
    config = EngineConfig(model=str(model_dirs["tiny"]), dtype="float32", device="cpu", max_model_len=48,
                          cpu_threads=1, block_size=4, num_kv_blocks=12)

    async def run() -> tuple[float, int]:
        engine = AsyncEngine(lambda: LLMEngine(config), decode=True, name="preemption-test")
        await engine.ready()
        assert engine.load_stats()["num_preemptions"] == 0
        sinks = []
        for i in range(2):      # two sequences of 4 + 24 tokens: 7 blocks each, 12 in all
            sink = _Finished(asyncio.get_running_loop())
            engine.attach(f"r{i}", sink)
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            engine.submit(lambda e, rid=f"r{i}": e.add_request(rid, [1, 5, 9, 13 + i], params))
            sinks.append(sink)
        for sink in sinks:
            await asyncio.wait_for(sink.done, 60)
        stats = engine.load_stats()["num_preemptions"]
        scheduled = await engine.call(lambda e: e.scheduler.num_preemptions)
        engine.shutdown()
        return stats, scheduled

    stats, scheduled = asyncio.run(run())
    assert stats == scheduled >= 1
