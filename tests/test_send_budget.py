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
