"""bench/serving_overhead.py's summary over rounds: spreads of each figure, and
ratios taken within a round (never across rounds)."""

from bench.serving_overhead import rounds_summary, rounds_table, spread


def served(tps16: float, goodput4: float, tpot2: float) -> dict:
    return {"loads": {"c16": {"output_throughput": tps16, "request_goodput": 1.0},
                      "rate4": {"request_goodput": goodput4, "median_ttft_ms": 100.0},
                      "rate2": {"median_tpot_ms": tpot2}}}


def test_spread_of_odd_and_even_counts():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert spread([4.0, 1.0, 2.0, 10.0])["median"] == 3.0
    assert spread([]) is None


def test_ratios_pair_systems_within_a_round():
    # Round 1 is a slow period for everyone, round 2 a fast one: pdserve is 0.5x and
    # 0.8x the peer within each round, while the ratio of its medians to the peer's
    # would read 0.65 / 0.9 ... and mislead.
    rounds = [
        {"offline": {"output_throughput": 200.0}, "colocated": served(100.0, 3.0, 20.0),
         "vllm": served(200.0, 4.0, 10.0)},
        {"offline": {"output_throughput": 500.0}, "colocated": served(400.0, 4.0, 12.0),
         "vllm": served(500.0, 4.0, 12.0)},
    ]
    summary = rounds_summary(rounds, "vllm")
    tps = summary["colocated"]["tok/s@16"]
    assert tps["value"] == {"median": 250.0, "min": 100.0, "max": 400.0, "n": 2}
    assert tps["x_offline"]["min"] == 0.5 and tps["x_offline"]["max"] == 0.8
    assert tps["x_peer"]["min"] == 0.5 and tps["x_peer"]["max"] == 0.8
    assert summary["colocated"]["TPOT p50@2"]["x_peer"]["max"] == 2.0
    assert summary["colocated"]["goodput@4"]["x_peer"]["median"] == 0.875
    # The offline engine has tok/s only; the peer no ratio to itself.
    assert set(summary["offline"]) == {"tok/s@16"}
    assert summary["vllm"]["tok/s@16"]["x_peer"] is None
    table = rounds_table(summary, 2, "vllm")
    assert "colocated      tok/s@16" in table and "0.65 [0.50-0.80]" in table


def test_a_failed_round_is_left_out_of_the_spread():
    rounds = [{"colocated": served(100.0, 3.0, 20.0), "vllm": served(200.0, 4.0, 10.0)},
              {"colocated": {"error": "ServerFailed: no"}, "vllm": served(300.0, 4.0, 10.0)}]
    tps = rounds_summary(rounds, "vllm")["colocated"]["tok/s@16"]
    assert tps["value"]["n"] == 1 and tps["x_peer"]["median"] == 0.5
