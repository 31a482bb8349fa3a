"""bench/autoscale_live.py's accounting, on synthetic samples of the router's /metrics."""

from __future__ import annotations

import pytest

from bench.autoscale_live import autoscaled_replica_seconds


def test_replicas_starting_and_draining_count_as_held():
    # 1P+1D serving; decode asked for a second replica that takes two samples to start,
    # then prefill given back, its replica serving (draining) one more sample
    samples = [
        {"running": {"prefill": 1, "decode": 1}, "targets": {"prefill": 1, "decode": 1}},
        {"running": {"prefill": 1, "decode": 1}, "targets": {"prefill": 1, "decode": 2}},   # starting
        {"running": {"prefill": 1, "decode": 1}, "targets": {"prefill": 1, "decode": 2}},
        {"running": {"prefill": 1, "decode": 2}, "targets": {"prefill": 0, "decode": 2}},   # draining
        {"running": {"prefill": 0, "decode": 2}, "targets": {"prefill": 0, "decode": 2}},
        {"running": {}, "targets": {}},                                        # no figures yet: as deployed
    ]
    held = [2, 3, 3, 3, 2, 2]
    assert autoscaled_replica_seconds(samples, deployed=2, duration_s=12.0) == pytest.approx(sum(held) / 6 * 12.0)
    # (serving only, the starting and draining replicas were free: 2, 2, 2, 3, 2, 2)
