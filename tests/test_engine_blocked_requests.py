"""Requests that cannot start (their KV blocks held or reserved by hand-offs), and
a step that fails to launch: the engine waits instead of spinning, says so
offline instead of looping, keeps a preempted sequence's turn, and goes on."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.async_engine import AsyncEngine
from engine.tiny_model import ensure_preset_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def model() -> str:
    return str(ensure_preset_model("tiny"))


def _small_pool(model: str, **kw) -> LLMEngine:
    # 8 blocks of 8 tokens: two 30-token prompts held fill it
    return LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=64, block_size=8, num_kv_blocks=8, **kw))


def test_offline_run_to_completion_says_what_blocks_the_waiting_requests(model):
    engine = _small_pool(model)
    for i in range(3):
        engine.add_request(str(i), list(range(3 + i, 33 + i)), GREEDY, hold_kv=True)   # 4 blocks each
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="1 requests wait for KV blocks or sequence slots that 2 held"):
        engine.run_to_completion()
    assert time.monotonic() - start < 30
    engine.release_kv("0")
    assert [o.request_id for o in engine.run_to_completion()] == ["2"]      # now it fits


def test_a_chunked_prompt_whose_later_blocks_are_held_waits_instead_of_preempting_itself_forever(model):
    # 4 of 8 blocks held; a 40-token prompt (5 blocks) in chunks of 16 tokens: its first two chunks
    # fitted, the third preempted the prompt itself, and without the prefix cache it started over,
    # a step that was never empty, for ever
    engine = _small_pool(model, max_num_batched_tokens=16, enable_prefix_caching=False, async_scheduling=False)
    engine.add_request("held", list(range(3, 33)), GREEDY, hold_kv=True)          # 4 blocks
    while engine.has_unfinished_requests():
        engine.step(decode=False)
    engine.add_request("long", list(range(40, 80)), GREEDY)
    for _ in range(20):
        engine.step()
    assert engine.scheduler.num_preemptions == 0
    with pytest.raises(RuntimeError, match="1 requests wait for KV blocks or sequence slots that 1 held"):
        engine.run_to_completion()
    engine.release_kv("held")
    [out] = engine.run_to_completion()
    assert (out.request_id, len(out.token_ids)) == ("long", 4)


def test_the_engine_thread_polls_while_requests_wait_for_held_blocks(model):
    def fill(engine: LLMEngine) -> None:
        for i in range(2):
            engine.add_request(f"held{i}", list(range(3 + i, 33 + i)), GREEDY, hold_kv=True)   # 4 blocks each
        while engine.has_unfinished_requests():
            engine.step(decode=False)
        engine.add_request("waiting", list(range(40, 60)), GREEDY, hold_kv=True)

    async def steps_and_waits_in_a_second() -> tuple[int, list]:
        ae = AsyncEngine(lambda: _small_pool(model), decode=False, cost_warmup_steps=0, name="blocked-test")
        try:
            engine = await ae.ready()
            await ae.call(fill)
            calls, waits = 0, []
            real_step, real_wait = engine.step, ae._wake.wait

            def counting(**kw):
                nonlocal calls
                calls += 1
                return real_step(**kw)

            def recording_wait(timeout=None):
                waits.append(timeout)
                return real_wait(timeout)
            ae._wake.wait = recording_wait
            await ae.call(lambda e: setattr(e, "step", counting))
            await asyncio.sleep(1.0)
            assert engine.scheduler.waiting and engine.block_manager.num_free_blocks == 0
            return calls, waits
        finally:
            ae.shutdown()

    from engine.async_engine import _BUSY_POLL_S
    calls, waits = asyncio.run(steps_and_waits_in_a_second())
    # between steps it waits the 2 ms poll, not the idle wait (nor not at all: a spinning loop
    # makes 100,000s of steps a second); and it does poll, so the request starts once blocks free
    assert waits and set(waits[1:]) == {_BUSY_POLL_S}
    assert 10 < calls < 2000


def test_hand_offs_leave_room_for_a_preempted_sequence(model):
    engine = LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=64, block_size=4, num_kv_blocks=16,
                                    enable_prefix_caching=False, async_scheduling=False))
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("old", list(range(3, 27)), long)        # 6 blocks each, growing to 16 together
    engine.add_request("young", list(range(30, 54)), long)
    while not engine.scheduler.num_preemptions:
        engine.step()
    victim = engine.scheduler.waiting[0]
    admitted = 0
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for k in range(200):        # a hand-off arrives before every step, as the decode worker's ticker does
        if engine.reserve_prefilled(f"h{k}", list(range(60, 68)), 5, short) is not None:
            engine.commit_prefilled(f"h{k}")
            admitted += 1
        engine.step()
        if victim.status.value != "waiting":
            break
    assert victim.status.value != "waiting", f"still waiting after {admitted} hand-offs went ahead of it"
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(outputs[victim.request_id].token_ids) == 40


def test_hand_offs_leave_a_batch_slot_for_a_waiting_request(model):
    # a decode worker at max_num_seqs: every slot that frees went to the next hand-off, and a
    # prompt waiting to be prefilled there got no first token for as long as they came
    engine = LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=64, block_size=4, num_kv_blocks=64,
                                    max_num_seqs=2, async_scheduling=False))
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("local", [5, 6, 7, 8], short)
    handed_off, finished_at = 0, None
    for step in range(200):
        while engine.reserve_prefilled(f"h{handed_off}", [9, 10, 11], 12, short) is not None:
            engine.commit_prefilled(f"h{handed_off}")
            handed_off += 1
        if any(o.request_id == "local" and o.finished for o in engine.step()):
            finished_at = step
            break
    assert finished_at is not None and finished_at <= 6, (finished_at, handed_off)
    assert handed_off >= 1          # the other slot kept taking hand-offs meanwhile


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_that_fails_to_launch_leaves_the_engine_able_to_go_on(model, async_scheduling):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=64))
    reference.add_request("a", list(range(3, 13)), params)
    expected = reference.run_to_completion()[0].token_ids

    engine = LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=64, async_scheduling=async_scheduling))
    engine.add_request("a", list(range(3, 13)), params)
    engine.step()
    engine.step()
    real_launch, failures = engine.runner.launch, []

    def fails_once(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise RuntimeError("a transient failure (out of memory, say)")
        return real_launch(*args, **kwargs)
    engine.runner.launch = fails_once
    with pytest.raises(RuntimeError, match="transient"):
        engine.step()
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert done[0].token_ids == expected


def _finished_token_ids(engine: LLMEngine) -> dict[str, list[int]]:
    """Steps until nothing is left (100 steps at most: a lost step left requests that never
    finish); {request id: token ids} of the requests that finished meanwhile."""
    done = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done


@pytest.mark.parametrize("where", ["waiting for the samples", "in the rows", "beside a step read back at once"])
def test_an_interrupted_read_back_leaves_the_engine_able_to_go_on(model, where):
    """Async scheduling: Ctrl-C while a step reads back the previous step's samples (waiting for
    them, or midway through its rows). That step and the one launched on its samples were lost,
    and every later step failed ("pending input tokens but no launched step"): a stream open
    beside the interrupted generate was dead. Now the next step reads back what is left, and
    every request goes on to its greedy tokens, each token once. "beside a step read back at
    once": the launched step was not overlapped (a request asking for logprobs joined it)."""
    from engine.output_processor import RequestTextState
    from engine.runner import LaunchedStep

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [("a", list(range(3, 13)), params), ("b", list(range(20, 27)), params)]
    if where == "beside a step read back at once":
        requests.append(("c", list(range(30, 36)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                                   logprobs=1)))
    reference = LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=64))
    for request in requests[:2]:
        reference.add_request(*request)
    expected = {o.request_id: o.token_ids for o in reference.run_to_completion()}
    if len(requests) == 3:
        reference.add_request(*requests[2])
        expected.update({o.request_id: o.token_ids for o in reference.run_to_completion()})

    engine = LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=64, async_scheduling=True))
    for request in requests[:2]:
        engine.add_request(*request)
    engine.step()
    engine.step()
    if len(requests) == 3:
        engine.add_request(*requests[2])
    patched = (RequestTextState, "append") if where == "in the rows" else (LaunchedStep, "result")
    real, calls = getattr(*patched), []

    def interrupted_once(self, *args):
        calls.append(1)
        if len(calls) == (2 if where == "in the rows" else 1):     # (in the rows: at the second row)
            raise KeyboardInterrupt
        return real(self, *args)

    setattr(*patched, interrupted_once)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        done = _finished_token_ids(engine)
    finally:
        setattr(*patched, real)
    assert done == expected


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("where", ["detokenizing a row's token", "freeing a finished sequence's blocks"])
def test_ctrl_c_amid_a_rows_bookkeeping_waits_for_it_to_end(model, where, async_scheduling):
    """A SIGINT after a row's token joined its sequence but before its text did, or after a
    finished sequence left the running queue but before its blocks were freed: the token was
    appended again on the next step (the sequence diverged from what it gives alone), or the
    blocks were never freed. The interrupt now comes once the row's bookkeeping is whole."""
    import os
    import signal

    from engine.block_manager import BlockManager
    from engine.detokenizer import IncrementalDetokenizer

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    requests = [("a", list(range(3, 13)), params), ("b", list(range(20, 27)), params)]
    reference = LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=64))
    for request in requests:
        reference.add_request(*request)
    expected = {o.request_id: o.token_ids for o in reference.run_to_completion()}

    engine = LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=64, async_scheduling=async_scheduling))
    for request in requests:
        engine.add_request(*request)
    patched = (IncrementalDetokenizer, "add_token") if where.startswith("detok") else (BlockManager, "free")
    real, calls = getattr(*patched), []

    def interrupted_once(self, *args):
        calls.append(1)
        if len(calls) == (3 if where.startswith("detok") else 1):      # (the first finished sequence's free)
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args)

    setattr(*patched, interrupted_once)
    done = {}
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in range(100):
                done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        done.update(_finished_token_ids(engine))
    finally:
        setattr(*patched, real)
    assert done == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_call_that_ends_the_engine_thread_answers_its_caller(model):
    # a BaseException (SystemExit, KeyboardInterrupt) in a call stops the engine thread; its
    # caller had waited for ever, the call taken off the queue and never answered
    from engine.errors import EngineStoppedError

    def exits(engine):
        raise SystemExit("stop")

    async def main():
        ae = AsyncEngine(lambda: _small_pool(model), decode=False, cost_warmup_steps=0, name="exit-test")
        try:
            await ae.ready()
            with pytest.raises(EngineStoppedError, match="the engine thread stopped: SystemExit"):
                await asyncio.wait_for(ae.call(exits), 30)
            with pytest.raises(EngineStoppedError):
                await asyncio.wait_for(ae.call(lambda engine: None), 30)    # and no later call waits either
        finally:
            ae.shutdown()
    asyncio.run(main())
