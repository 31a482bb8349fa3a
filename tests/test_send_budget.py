"""SendBudget (a prefill worker's bound on packed KV copies in flight) and the
bytes a hand-off packs on its busiest prefill rank."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cluster.transport.kv_handoff import packed_bytes_per_rank
from prefill_workers.send_budget import SendBudget


@pytest.mark.parametrize("num_kv_heads, src_tp, dst_tp, heads_packed", [
    (8, 8, 8, 1),     # one head per rank, to its twin
    (8, 1, 8, 8),     # one prefill rank sends all its heads, one to each decode rank
    (8, 8, 1, 1),
    (8, 2, 4, 4),
    (2, 1, 4, 4),     # each head replicated on two decode ranks: packed twice
    (2, 2, 8, 4),
])
def test_packed_bytes_count_heads_sent_to_several_decode_ranks_once_each(num_kv_heads, src_tp, dst_tp,
                                                                         heads_packed):
    assert packed_bytes_per_rank(3, 1000, num_kv_heads, src_tp, dst_tp) == 3 * 1000 * heads_packed


def test_a_send_past_the_budget_waits_for_earlier_ones_to_end():
    async def main():
        budget, order = SendBudget(100), []

        async def send(tid, nbytes):
            await budget.acquire(tid, nbytes)
            order.append(tid)

        await send("a", 60)
        waiting = asyncio.create_task(send("b", 60))
        await asyncio.sleep(0.05)
        assert order == ["a"] and budget.in_flight_bytes == 60
        threading.Thread(target=budget.release, args=("a",)).start()   # the engine thread ends it
        await asyncio.wait_for(waiting, 5)
        assert order == ["a", "b"] and budget.in_flight_bytes == 60
        budget.release("b")
        budget.release("b")     # idempotent
        await asyncio.sleep(0)
        assert budget.in_flight_bytes == 0
    asyncio.run(main())


def test_a_send_larger_than_the_budget_goes_alone():
    async def main():
        budget = SendBudget(100)
        await asyncio.wait_for(budget.acquire("huge", 500), 1)       # nothing else in flight
        assert budget.in_flight_bytes == 500
        small = asyncio.create_task(budget.acquire("small", 1))
        await asyncio.sleep(0.05)
        assert not small.done()
        budget.release("huge")
        await asyncio.wait_for(small, 5)
        assert budget.in_flight_bytes == 1
    asyncio.run(main())


def test_no_budget_never_waits():
    async def main():
        budget = SendBudget(None)
        for i in range(5):
            await asyncio.wait_for(budget.acquire(str(i), 10**12), 1)
        assert budget.in_flight_bytes == 5 * 10**12
    asyncio.run(main())


def test_waiting_sends_go_in_the_order_they_came():
    """A small send that would fit does not overtake a larger one waiting before it
    (else a stream of small sends could hold a large one back for ever)."""
    async def main():
        budget, order = SendBudget(100), []

        async def send(tid, nbytes):
            await budget.acquire(tid, nbytes, timeout_s=5)
            order.append(tid)

        await send("a", 60)
        large = asyncio.create_task(send("large", 60))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(send("small", 30))        # 60 + 30 fits, but "large" came first
        await asyncio.sleep(0.05)
        assert order == ["a"] and not budget.fits(1)
        budget.release("a")
        await asyncio.wait_for(asyncio.gather(large, small), 5)
        assert order == ["a", "large", "small"] and budget.in_flight_bytes == 90
    asyncio.run(main())


def test_a_send_that_cannot_start_in_time_is_refused_and_counts_nothing():
    async def main():
        budget = SendBudget(100)
        await budget.acquire("a", 80)
        with pytest.raises(TimeoutError, match="80 bytes of KV sends are in flight on a budget of 100"):
            await budget.acquire("late", 50, timeout_s=0.05)
        assert budget.in_flight_bytes == 80
        behind = asyncio.create_task(budget.acquire("next", 50, timeout_s=5))   # the refused one left the queue
        await asyncio.sleep(0.01)
        budget.release("a")
        await asyncio.wait_for(behind, 5)
        assert budget.in_flight_bytes == 50
    asyncio.run(main())


def test_a_cancelled_wait_leaves_the_queue_to_the_sends_behind_it():
    async def main():
        budget = SendBudget(100)
        await budget.acquire("a", 80)
        first = asyncio.create_task(budget.acquire("first", 90, timeout_s=5))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(budget.acquire("second", 20, timeout_s=5))
        await asyncio.sleep(0.01)
        first.cancel()
        await asyncio.wait_for(second, 5)       # 80 + 20 fits once "first" no longer waits before it
        assert budget.in_flight_bytes == 100
    asyncio.run(main())
