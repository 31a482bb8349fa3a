"""Tensor parallelism on CPU with gloo: local rank processes, outputs equal to
TP 1 and to transformers, seeds independent of the TP degree, KV handed
between gangs of different TP degrees, and no process left behind."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import signal
import time

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.kv_head_map import kv_heads_of_rank, remap_kv_shards

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def _prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(3, 60))] for _ in range(n)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes only once reaped; multiprocessing reaps on join
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _until(condition, timeout_s: float = 30.0) -> None:
    """Polls `condition` until it holds; `timeout_s` is a hang guard, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still not true after {timeout_s:g} s"
        time.sleep(0.01)


def _signal_taken(pid: int, signum: int) -> bool:
    """The process has no `signum` pending: it took (or ignored) it. Gone counts as taken."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = dict(line.split(":", 1) for line in f if line.startswith(("SigPnd", "ShdPnd")))
    except FileNotFoundError:
        return True
    return not any(int(mask, 16) >> (signum - 1) & 1 for mask in masks.values())


@pytest.mark.parametrize("preset, tp", [("tiny", 2), ("tiny-qwen2", 2), ("tiny-mqa", 2), ("tiny-mqa", 4)])
def test_greedy_matches_transformers_and_tp1(preset, tp, model_dirs, reference):
    prompts = _prompts()
    ref = reference(preset)
    with LLM(str(model_dirs[preset]), max_model_len=256, tensor_parallel_size=tp) as llm:
        pids = llm.engine.rank_pids
        assert len(pids) == tp - 1 and all(_alive(p) for p in pids)
        worker = llm.engine.worker
        # rank 0's shard: its share of query heads, and KV heads by the sharding rule
        mc = worker.model_config
        attn = worker.model.model.layers[0].self_attn
        assert attn.num_local_heads == mc.num_heads // tp
        assert worker.kv_heads == kv_heads_of_rank(mc.num_kv_heads, tp, 0)
        outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == ref.greedy(tuple(p), 16)
    assert not any(_alive(p) for p in pids), "rank processes must be gone after shutdown"


def test_seeded_sampling_is_the_same_at_any_tp(model_dirs):
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=s, ignore_eos=True)
              for s in range(4)]
    prompts = _prompts(4, seed=1)
    single = [o.token_ids for o in LLM(str(model_dirs["tiny"]), max_model_len=256).generate(prompts, params)]
    with LLM(str(model_dirs["tiny"]), max_model_len=256, tensor_parallel_size=2) as llm:
        sharded = [o.token_ids for o in llm.generate(prompts, params)]
    assert sharded == single
    assert len({tuple(t) for t in single}) == 4  # the seeds really differ


@pytest.mark.parametrize("p, q", [(1, 2), (2, 1)])
def test_kv_handoff_between_tp_degrees(p, q, model_dirs, reference):
    """Prefill on a TP-p engine, map its per-rank KV shards onto a TP-q engine's
    ranks with the head mapping, decode there: equal to transformers."""
    preset = "tiny"
    d = str(model_dirs[preset])
    prompts = _prompts(4, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    with LLM(d, max_model_len=256, tensor_parallel_size=p) as pre, \
            LLM(d, max_model_len=256, tensor_parallel_size=q) as dec:
        prefill, decode = pre.engine, dec.engine
        for i, prompt in enumerate(prompts):
            prefill.add_request(str(i), prompt, params, hold_kv=True)
        firsts = {o.request_id: o.token_ids[0] for o in prefill.run_to_completion()}
        num_kv_heads = prefill.model_config.num_kv_heads
        for rid, first in firsts.items():
            src_blocks = prefill.held_sequence(rid).block_table
            shards = prefill.read_kv_shards(src_blocks)
            assert [s.shape[-2] for s in shards] == [len(kv_heads_of_rank(num_kv_heads, p, r)) for r in range(p)]
            dst_blocks = decode.reserve_prefilled(rid, prompts[int(rid)], first, params)
            decode.write_kv_shards(dst_blocks, remap_kv_shards(shards, num_kv_heads, q))
            prefill.release_kv(rid)
            decode.commit_prefilled(rid)
        got = {int(o.request_id): o.token_ids for o in decode.run_to_completion()}
    ref = reference(preset)
    for i, prompt in enumerate(prompts):
        assert got[i] == ref.greedy(tuple(prompt), 12)


@dataclasses.dataclass
class _Rank1RunsOutOfMemory(EngineConfig):
    """A config whose rank 1 fails while its worker loads, after the group formed."""

    def resolved_dtype(self, checkpoint_dtype):
        if multiprocessing.current_process().name == "pdserve-tp-rank1":
            raise MemoryError("rank 1 ran out of memory while loading")
        return super().resolved_dtype(checkpoint_dtype)


def test_a_rank_that_fails_to_start_fails_the_engine_fast(model_dirs):
    """Rank 1 fails while loading (rank 0 would wait for it in a collective): the
    start fails at once and names the rank, not the broken group rank 0 sees."""
    config = _Rank1RunsOutOfMemory(model=str(model_dirs["tiny"]), max_model_len=128, tensor_parallel_size=2)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"\['pdserve-tp-rank1'\] exited \(exit codes \[1\]\) after rank 1: "
                                           r"MemoryError: rank 1 ran out of memory while loading; .*while the "
                                           r"engine started"):
        LLMEngine(config)
    assert time.monotonic() - start < 60


def test_a_rank_that_fails_to_start_fails_the_engine_where_rank_0_would_wait_for_it_for_ever(model_dirs,
                                                                                          monkeypatch):
    """As under NCCL, whose collectives wait for a dead peer for ever (gloo's see its socket
    close): rank 0 loading its model blocks until released, and rank 1 fails. The start
    fails at once, naming rank 1 (before, it waited with rank 0 for ever)."""
    import threading

    from engine import llm_engine
    released = threading.Event()
    monkeypatch.setattr(llm_engine, "ModelWorker", lambda config, tp: released.wait())
    config = _Rank1RunsOutOfMemory(model=str(model_dirs["tiny"]), max_model_len=128, tensor_parallel_size=2)
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            LLMEngine(config)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)
    try:
        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        thread.join(60)
        assert outcome, "the engine's start still waits on rank 0's load 60 s after rank 1 failed"
        assert isinstance(outcome[0], RuntimeError)
        assert "['pdserve-tp-rank1'] exited (exit codes [1]) after rank 1: MemoryError" in str(outcome[0])
    finally:
        released.set()


def test_a_killed_rank_is_an_error_not_a_hang(model_dirs):
    llm = LLM(str(model_dirs["tiny"]), max_model_len=256, tensor_parallel_size=2)
    (pid,) = llm.engine.rank_pids
    try:
        os.kill(pid, signal.SIGKILL)
        _until(lambda: llm.engine.rank_problem() is not None)     # the engine sees it gone (reaped)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"\['pdserve-tp-rank1'\] exited \(exit codes \[-9\]\); see"):
            llm.generate(_prompts(2), GREEDY)
        assert time.monotonic() - start < 60
    finally:
        llm.shutdown()
    assert not _alive(pid)


def _rank_and_heads(worker, fail_on_rank: int | None):
    if worker.tp.rank == fail_on_rank:
        raise ValueError("asked to fail")
    return worker.tp.rank, list(worker.kv_heads)


def test_collective_rpc_runs_on_every_rank_and_reports_which_failed(model_dirs):
    from engine.model_worker import RankCallError
    with LLM(str(model_dirs["tiny"]), tensor_parallel_size=2, max_model_len=128) as llm:
        engine = llm.engine
        heads = engine.model_config.num_kv_heads
        assert engine.collective_rpc(_rank_and_heads, None) == [
            (r, list(kv_heads_of_rank(heads, 2, r))) for r in range(2)]
        with pytest.raises(RankCallError, match="rank 1: ValueError: asked to fail"):
            engine.collective_rpc(_rank_and_heads, 1)
        # the ranks are still in step: the next call and a generation work
        assert [r for r, _ in engine.collective_rpc(_rank_and_heads, None)] == [0, 1]
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def _unpicklable_result_on_rank_1(worker):
    import threading
    return threading.Lock() if worker.tp.rank == 1 else "fine"


def test_collective_rpc_calls_that_cannot_be_sent_or_answered_leave_the_ranks_in_step(model_dirs):
    from engine.model_worker import RankCallError
    with LLM(str(model_dirs["tiny"]), tensor_parallel_size=2, max_model_len=128) as llm:
        engine = llm.engine
        with pytest.raises(TypeError, match="picklable module-level function"):
            engine.collective_rpc(lambda worker: 1)
        with pytest.raises(RankCallError, match="rank 1: TypeError: cannot pickle"):
            engine.collective_rpc(_unpicklable_result_on_rank_1)
        assert [r for r, _ in engine.collective_rpc(_rank_and_heads, None)] == [0, 1]
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_ctrl_c_at_an_idle_prompt_leaves_the_ranks_serving(model_dirs):
    # a terminal's Ctrl-C reaches every process of its group: a rank that took it while waiting
    # for rank 0's next command died on that command, and the engine was gone for good
    import signal
    with LLM(str(model_dirs["tiny"]), max_model_len=128, tensor_parallel_size=2) as llm:
        first = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
        for pid in llm.engine.rank_pids:
            os.kill(pid, signal.SIGINT)
        for pid in llm.engine.rank_pids:
            _until(lambda: _signal_taken(pid, signal.SIGINT))    # delivered (or ignored), not still pending
        assert all(_alive(pid) for pid in llm.engine.rank_pids)
        assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids == first


def test_an_interrupt_mid_step_breaks_the_engine_instead_of_hanging_it(model_dirs):
    """Ctrl-C on rank 0 after the step went to the other ranks leaves them in a
    collective rank 0 never joins: the engine must refuse to step and stop them
    at once, not wait in the next broadcast for ever."""
    llm = LLM(str(model_dirs["tiny"]), max_model_len=128, tensor_parallel_size=2)
    (pid,) = llm.engine.rank_pids
    execute = llm.engine.worker.execute

    def interrupted(*args):
        raise KeyboardInterrupt

    try:
        llm.engine.worker.execute = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7]], GREEDY)
        llm.engine.worker.execute = execute
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="stopped after an error on a tensor-parallel rank"):
            llm.generate([[5, 6, 7]], GREEDY)
    finally:
        llm.shutdown()
    assert time.monotonic() - start < 15 and not _alive(pid)


def test_a_shut_down_engine_says_so(model_dirs):
    llm = LLM(str(model_dirs["tiny"]), max_model_len=128, tensor_parallel_size=2)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="the engine was shut down"):
        llm.generate([[5, 6, 7]], GREEDY)


def test_the_health_check_sees_a_dead_rank(model_dirs):
    import asyncio

    from engine import EngineConfig, LLMEngine
    from engine.async_engine import AsyncEngine
    from engine.errors import EngineStoppedError

    async def main():
        config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, tensor_parallel_size=2)
        engine = AsyncEngine(lambda: LLMEngine(config), name="tp-health", cost_warmup_steps=0)
        await engine.ready()
        try:
            engine.check_alive()
            (pid,) = engine.engine.rank_pids
            os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.5)
            with pytest.raises(EngineStoppedError, match="exited"):
                engine.check_alive()
        finally:
            engine.shutdown()
    asyncio.run(asyncio.wait_for(main(), 120))


def test_the_health_check_sees_a_rank_that_is_alive_but_stuck(model_dirs):
    # a stopped (SIGSTOP) follower holds rank 0 in the step's first collective, whose timeout is
    # days: the step's age tells the health check, so Serve can replace the replica
    import asyncio

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.async_engine import AsyncEngine
    from engine.errors import EngineStoppedError

    async def main():
        config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, tensor_parallel_size=2)
        engine = AsyncEngine(lambda: LLMEngine(config), name="tp-stuck", cost_warmup_steps=0, stuck_step_s=3.0)
        await engine.ready()
        (pid,) = engine.engine.rank_pids
        try:
            os.kill(pid, signal.SIGSTOP)
            await engine.call(lambda e: e.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4)))
            await asyncio.sleep(0.5)
            engine.check_alive()                   # in its step, not yet for long
            with pytest.raises(EngineStoppedError, match="stuck: its current step has run for"):
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    engine.check_alive()
                    await asyncio.sleep(0.05)
        finally:
            os.kill(pid, signal.SIGKILL)           # rank 0's collective fails; the engine thread ends
            engine.shutdown()
    asyncio.run(asyncio.wait_for(main(), 120))


def test_an_error_every_rank_hits_at_start_keeps_its_type(model_dirs):
    """A setting every rank refuses is the user's to fix: it stays a ValueError
    (the CLI prints it and exits 2), not a report of a rank that exited."""
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=10**7, tensor_parallel_size=2))


def test_a_model_that_cannot_be_split_so_is_refused_before_any_rank_starts(model_dirs, monkeypatch):
    """Refused by the engine up front: no rank process is started to fail the same
    check and print its traceback."""
    import engine.llm_engine as llm_engine

    started = []
    monkeypatch.setattr(llm_engine, "RankProcesses", lambda *args: started.append(args))
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, tensor_parallel_size=3))
    assert started == []


def test_shutting_down_an_engine_stuck_in_a_step_terminates_its_ranks(model_dirs):
    # a stopped rank holds rank 0's step in a collective; shutdown waited for the engine thread,
    # gave up, and returned with the rank processes still there (until the process exited)
    import asyncio

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.async_engine import AsyncEngine

    async def main():
        config = EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128, tensor_parallel_size=2)
        engine = AsyncEngine(lambda: LLMEngine(config), name="tp-stuck-shutdown", cost_warmup_steps=0)
        await engine.ready()
        (pid,) = engine.engine.rank_pids
        os.kill(pid, signal.SIGSTOP)
        await engine.call(lambda e: e.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4)))
        deadline = time.monotonic() + 30
        # the step under way: it waits in its collective with the stopped rank
        while (engine._working or (0.0, ""))[1] != "step":
            assert time.monotonic() < deadline, "the engine never stepped"
            await asyncio.sleep(0.01)
        engine.shutdown(timeout_s=1.0)
        return pid

    pid = asyncio.run(asyncio.wait_for(main(), 120))
    try:
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
