"""The decode worker's per-subscriber outbox: one delta per request per batch,
and stream batching that holds mid-stream tokens back for the interval but
never a request's first delta or a finish. The interval here is 60 s, so "held back"
and "taken at once" are told apart without timing anything closely."""

from __future__ import annotations

import asyncio

import pytest

from decode_workers.delta_outbox import DeltaOutbox
from engine.outputs import RequestOutput

LONG_INTERVAL_S = 60.0


def _output(request_id: str, token_ids: list[int], new: int, *, finished: bool = False) -> RequestOutput:
    """The engine's cumulative output after `token_ids`, the last `new` of them new this step."""
    return RequestOutput(request_id, [1, 2, 3], text="".join(f"<{t}>" for t in token_ids), token_ids=token_ids,
                         delta_text="".join(f"<{t}>" for t in token_ids[-new:]), delta_token_ids=token_ids[-new:],
                         finished=finished, finish_reason="length" if finished else None,
                         arrival_time=0.0, first_scheduled_time=0.1, first_token_time=0.2)


async def _taken_within(outbox: DeltaOutbox, seconds: float):
    """The batch take() returns within `seconds`, or None when it is still waiting."""
    try:
        return await asyncio.wait_for(outbox.take(), seconds)
    except asyncio.TimeoutError:
        return None


def test_without_an_interval_every_step_is_taken_at_once_and_merged_per_request():
    async def main():
        outbox = DeltaOutbox()
        outbox.put([_output("a", [5], 1)])
        first = await _taken_within(outbox, 5)
        outbox.put([_output("a", [5, 6], 1), _output("b", [9], 1)])
        outbox.put([_output("a", [5, 6, 7], 1)])
        second = await _taken_within(outbox, 5)
        return first, second
    first, second = asyncio.run(main())
    assert [(d.request_id, d.token_ids) for d in first] == [("a", [5])]
    assert sorted((d.request_id, d.token_ids, d.text) for d in second) == [
        ("a", [6, 7], "<6><7>"), ("b", [9], "<9>")]


def test_stream_batching_holds_mid_stream_tokens_until_an_urgent_delta_arrives():
    async def main():
        outbox = DeltaOutbox(min_interval_s=LONG_INTERVAL_S)
        outbox.put([_output("a", [5], 1)])                      # a's first token: urgent
        first = await _taken_within(outbox, 5)
        outbox.put([_output("a", [5, 6], 1)])                   # mid-stream: held for the interval
        outbox.put([_output("a", [5, 6, 7], 1)])
        held = await _taken_within(outbox, 0.3)
        outbox.put([_output("b", [9], 1)])                      # b's first token: takes a's along
        released = await _taken_within(outbox, 5)
        outbox.put([_output("a", [5, 6, 7, 8], 1)])
        outbox.put([_output("a", [5, 6, 7, 8, 4], 1, finished=True)])   # the finish goes at once
        last = await _taken_within(outbox, 5)
        return first, held, released, last
    first, held, released, last = asyncio.run(main())
    assert [(d.request_id, d.token_ids) for d in first] == [("a", [5])]
    assert first[0].first_token_times is not None
    assert held is None
    assert sorted((d.request_id, d.token_ids) for d in released) == [("a", [6, 7]), ("b", [9])]
    assert [(d.request_id, d.token_ids, d.finished) for d in last] == [("a", [8, 4], True)]


def test_a_handed_off_requests_first_delta_is_not_held_though_it_carries_no_first_token():
    """On a decode replica the first token came from the prefill replica; the
    first tokens decoded here follow it at once, not after the interval."""
    async def main():
        outbox = DeltaOutbox(min_interval_s=LONG_INTERVAL_S)
        outbox.put([_output("a", [5], 1)])
        await _taken_within(outbox, 5)
        outbox.put([_output("a", [5, 6], 1)])                   # a mid-stream: held
        held = await _taken_within(outbox, 0.3)
        outbox.put([_output("h", [3, 8], 1)])                   # h was prefilled elsewhere: token 3 came from there
        released = await _taken_within(outbox, 5)
        outbox.put([_output("h", [3, 8, 2], 1)])                # h's later tokens wait like any others
        later = await _taken_within(outbox, 0.3)
        return held, released, later
    held, released, later = asyncio.run(main())
    assert held is None
    assert sorted((d.request_id, d.token_ids, d.first_token_times is None) for d in released) == [
        ("a", [6], True), ("h", [8], True)]
    assert later is None


def test_stream_batching_releases_held_tokens_once_the_interval_has_passed():
    async def main():
        outbox = DeltaOutbox(min_interval_s=0.2)
        outbox.put([_output("a", [5], 1)])
        await _taken_within(outbox, 5)
        outbox.put([_output("a", [5, 6], 1)])
        return await _taken_within(outbox, 30)
    batch = asyncio.run(main())
    assert [(d.request_id, d.token_ids) for d in batch] == [("a", [6])]


@pytest.mark.parametrize("interval_s", [0.0, LONG_INTERVAL_S])
def test_an_engine_failure_reaches_the_reader_after_what_was_pending(interval_s):
    async def main():
        outbox = DeltaOutbox(min_interval_s=interval_s)
        outbox.put([_output("a", [5], 1)])
        outbox.fail(RuntimeError("rank died"))
        batch = await _taken_within(outbox, 5)
        with pytest.raises(RuntimeError, match="rank died"):
            await asyncio.wait_for(outbox.take(), 5)
        return batch
    assert [d.token_ids for d in asyncio.run(main())] == [[5]]


def test_a_first_delta_merged_with_the_next_keeps_the_prompt_logprobs():
    from engine.sampler import TokenLogprobs
    scored = [None, TokenLogprobs(2, -1.5, 3, []), TokenLogprobs(3, -0.5, 1, [])]

    async def main():
        outbox = DeltaOutbox()
        first = _output("a", [5], 1)
        first.prompt_logprobs = scored
        outbox.put([first])
        outbox.put([_output("a", [5, 6], 1)])     # before the take: one delta for both steps
        return await _taken_within(outbox, 5)
    (delta,) = asyncio.run(main())
    assert delta.token_ids == [5, 6] and delta.prompt_logprobs == scored
