"""bench/overload.py's ramp: every step offers exactly its rate over its own
window, with the same requests for every system."""

from __future__ import annotations

from bench.overload import step_load


def test_a_step_offers_its_rate_within_its_window(tokenizer):
    requests, arrivals = step_load(tokenizer, 3, rate=6.4, step_s=15.0)
    assert len(arrivals) == len(requests) == 96                # round(6.4 x 15)
    assert arrivals == sorted(arrivals)
    assert 0.0 <= arrivals[0] and arrivals[-1] < 15.0
    # spread over the window, not bunched at its start (Poisson given the count)
    assert 30 <= sum(t < 7.5 for t in arrivals) <= 66


def test_the_same_step_gives_every_system_the_same_load_and_steps_differ(tokenizer):
    requests, arrivals = step_load(tokenizer, 2, rate=3.0, step_s=10.0)
    again_requests, again_arrivals = step_load(tokenizer, 2, rate=3.0, step_s=10.0)
    assert arrivals == again_arrivals
    assert [r.prompt for r in requests] == [r.prompt for r in again_requests]
    other_requests, other_arrivals = step_load(tokenizer, 4, rate=3.0, step_s=10.0)
    assert other_arrivals != arrivals
    assert [r.prompt for r in other_requests] != [r.prompt for r in requests]


def test_a_light_step_still_sends_one_request(tokenizer):
    requests, arrivals = step_load(tokenizer, 0, rate=0.01, step_s=10.0)
    assert len(requests) == len(arrivals) == 1


def test_the_summary_survives_a_ramp_without_goodput():
    from bench.overload import summary
    ramp = [{"step": 1.0, "goodput": 0.0, "ttft_p99_ms": None, "admitted": 0},
            {"step": 10.0, "goodput": 0.0, "ttft_p99_ms": 800.0, "admitted": 3}]
    line = summary(ramp, 100.0, None)
    assert "n/a (no goodput at any step)" in line and "(3 admitted) is 8.0x the unloaded TTFT p99" in line


def test_an_admitted_request_that_fails_counts_against_the_admitted():
    """Admitted means not refused (429): one that fails afterwards missed its SLOs
    (it left the attainment's denominator, and the README's 100% could hide it)."""
    from bench.loadtest.client import RequestRecord
    from bench.overload import step_figures

    def rec(i, *, status=200, ok=True, first=0.1):
        return RequestRecord(i, prompt_len=5, expected_output_len=2, send_time=0.0, chunk_times=[first, first + 0.01],
                             end_time=first + 0.02, output_tokens=2, succeeded=ok, status=status)
    records = [rec(0), rec(1), rec(2, ok=False, first=0.5), rec(3, status=429, ok=False)]
    records[3].chunk_times = []
    figures = step_figures(records, {"ttft": 1000.0}, step_s=1.0)
    assert (figures["admitted"], figures["failed_other"], figures["goodput"]) == (3, 1, 2.0)
    assert figures["attainment_admitted"] == 2 / 3 and figures["refused_share"] == 1 / 4
    assert figures["ttft_max_ms"] == 500.0          # the failed one's first token is in the percentiles
    assert figures["unfinished"] == 0
    records[2].unfinished = True            # cut at the run's time limit: a failure, and said so
    assert step_figures(records, {"ttft": 1000.0}, step_s=1.0)["unfinished"] == 1
    # admitted requests in send order with their TTFTs (the refused one left out): where a tail came from
    records[1].scheduled_offset, records[2].scheduled_offset = 0.5, 0.25
    assert step_figures(records, {"ttft": 1000.0}, step_s=1.0)["admitted_ttfts"] == \
        [[0.0, 100.0], [0.25, 500.0], [0.5, 100.0]]


def test_the_time_limit_lets_every_step_drain_at_the_capacity():
    from bench.overload import time_limit_s
    # the default ramp: 18.5 steps' worth of requests drain at the capacity in 277.5 s
    assert time_limit_s([0.5, 1, 2, 5, 10], 15.0) == 900.0
    # 60 s steps: 1,110 s of draining, past the old fixed 900 s limit
    assert time_limit_s([0.5, 1, 2, 5, 10], 60.0) == 1.5 * 18.5 * 60 + 120
