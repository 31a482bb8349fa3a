"""Prefix caching in the simulator: the engine's block hashes, hits counted by
hand, a cached prefix shortening the prefill by exactly its tokens, and
`pdserve simulate` on a shared-prefix dataset."""

from __future__ import annotations

import json

import pytest

from cluster.perf_model import LinearStepModel
from cluster.simulator import ClusterSpec, simulate
from cluster.simulator.cluster_sim import ReplicaSpec
from cluster.simulator.prefix_cache import PrefixCache, prompt_block_hashes
from engine.block_manager import BlockManager

PER_TOKEN = 1e-3
TOKENS = LinearStepModel((0.0, PER_TOKEN, 0.0, 0.0, 0.0))      # a step costs 1 ms per prompt token it computes


def test_block_hashes_are_the_engines():
    ids = list(range(100, 150))                       # 50 tokens: 3 full blocks of 16
    manager = BlockManager(num_blocks=8, block_size=16)
    table: list[int] = []
    assert manager.allocate(table, 50)
    manager.cache_full_blocks(ids, table, num_computed=50, num_already_cached=0)
    assert list(prompt_block_hashes(ids, 16)) == [manager.blocks[b].hash for b in table[:3]]
    # and what one finds the other finds: a prompt sharing the 3 blocks matches them in the engine
    assert manager.match_prefix(ids[:48] + [1, 2, 3], []) == 48


def test_a_match_is_the_leading_run_of_cached_blocks_short_of_the_last_token():
    cache = PrefixCache(capacity=100)
    a = prompt_block_hashes(list(range(64)), 16)                     # 4 blocks
    b = prompt_block_hashes(list(range(32)) + [999] * 32, 16)        # shares a's first 2 blocks
    cache.insert(a)
    assert cache.match(b, 64, 16) == 32
    assert cache.match(a, 64, 16) == 48          # 4 cached blocks, but the last token must run: 3
    assert cache.match(a, 65, 16) == 64
    assert cache.match(prompt_block_hashes([7] * 64, 16), 64, 16) == 0


def test_the_least_recently_used_prompts_blocks_go_first_their_tail_before_their_head():
    # as the engine frees a sequence's blocks last first: evicting a prompt's head first
    # left its other blocks cached and unreachable
    cache = PrefixCache(capacity=4)
    a = prompt_block_hashes(list(range(64)), 16)
    b = prompt_block_hashes(list(range(1000, 1064)), 16)
    cache.insert(a)
    cache.insert(b[:2])                          # a's last two blocks are now the oldest: evicted
    assert cache.match(a, 65, 16) == 32
    assert cache.match(b, 65, 16) == 32
    cache.insert(b[2:3])                         # a1, the oldest now, goes
    assert cache.match(b, 65, 16) == 48
    assert cache.match(a, 65, 16) == 16


def _one_replica(caching: bool = True) -> ClusterSpec:
    return ClusterSpec("colocated", decode=ReplicaSpec(TOKENS, 1000, 16, 256, 2048, enable_prefix_caching=caching))


def test_a_cached_prefix_shortens_the_prefill_by_exactly_its_tokens():
    # two 200-token prompts sharing their first 160 tokens (10 blocks), one after the other
    shared = list(range(160))
    prompts = [shared + list(range(1000, 1040)), shared + list(range(2000, 2040))]
    arrivals = [0.0, 1.0]
    result = simulate(_one_replica(), [(200, 1), (200, 1)], arrivals, prompt_token_ids=prompts)
    ttfts = [r.token_times[0] - r.send_time for r in result.requests]
    assert ttfts == pytest.approx([200 * PER_TOKEN, 40 * PER_TOKEN])
    assert result.cached_prompt_tokens == 160

    off = simulate(_one_replica(caching=False), [(200, 1), (200, 1)], arrivals, prompt_token_ids=prompts)
    assert [r.token_times[0] - r.send_time for r in off.requests] == pytest.approx([0.2, 0.2])
    assert off.cached_prompt_tokens == 0
    without_prompts = simulate(_one_replica(), [(200, 1), (200, 1)], arrivals)
    assert without_prompts.cached_prompt_tokens == 0


def test_a_disaggregated_prefill_replica_reuses_its_cache():
    model = LinearStepModel((0.0, PER_TOKEN, 0.0, 1e-3, 0.0))
    replica = ReplicaSpec(model, 1000, 16, 256, 2048)
    spec = ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=1, decode_replicas=1,
                       kv_bytes_per_token=1.0, kv_bandwidth_bytes_per_s=1e12)
    shared = list(range(320))
    prompts = [shared + [5000 + i] * 16 for i in range(4)]
    result = simulate(spec, [(336, 2)] * 4, [0.0, 1.0, 2.0, 3.0], prompt_token_ids=prompts)
    assert result.cached_prompt_tokens == 3 * 320
    ttfts = [r.token_times[0] - r.send_time for r in result.requests]
    assert ttfts[0] == pytest.approx(336 * PER_TOKEN)
    assert ttfts[1:] == pytest.approx([16 * PER_TOKEN] * 3)


def test_a_decode_replica_caches_the_prompt_blocks_a_hand_off_brought():
    # as the engine's Scheduler.mark_filled: a short prompt it then prefills itself (conditional
    # disaggregation) finds the shared prefix that came with a long prompt's KV
    model = LinearStepModel((0.0, PER_TOKEN, 0.0, 1e-3, 0.0))
    replica = ReplicaSpec(model, 1000, 16, 256, 2048)
    spec = ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=1, decode_replicas=1,
                       policy="conditional", local_prefill_max_tokens=128,
                       kv_bytes_per_token=1.0, kv_bandwidth_bytes_per_s=1e12)
    shared = list(range(64))
    prompts = [shared + list(range(1000, 1200)), shared + list(range(2000, 2016))]   # 264 (remote), 80 (local)
    result = simulate(spec, [(264, 2), (80, 1)], [0.0, 1.0], prompt_token_ids=prompts)
    assert [r.prefilled_locally for r in result.requests] == [False, True]
    assert result.cached_prompt_tokens == 64
    assert result.requests[1].token_times[0] - result.requests[1].send_time == pytest.approx(16 * PER_TOKEN)


def test_a_hand_off_reserves_the_prompts_blocks_only():
    # a 32-token prompt fills 2 blocks of 16: the third, for its first token's KV, comes with its
    # first decode step (the engine's reserve); the simulator asked for 3 and kept it waiting
    from cluster.simulator.replica import SimReplica, SimSequence
    decode = SimReplica("D0", TOKENS, num_blocks=2, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    seq = SimSequence(0, prompt_len=32, output_len=4, generated=1)
    assert decode.try_admit_prefilled(seq)
    assert decode.free_blocks == 0
    decode.commit_prefilled(seq)
    assert decode.free_blocks == 0 and decode.running == [seq]


def test_prompts_must_match_the_requests():
    with pytest.raises(ValueError, match="2 requests but 1 prompts"):
        simulate(_one_replica(), [(20, 1), (20, 1)], [0.0, 0.0], prompt_token_ids=[list(range(20))])


def test_pdserve_simulate_counts_the_prefix_cache_on_a_shared_prefix_dataset(tmp_path):
    from cluster.cli.main import main
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(LinearStepModel((1e-3, 1e-4, 0.0, 5e-5, 0.0)).to_json()))
    results = {}
    for name, dataset in (("prefix", ["--dataset-name", "prefix", "--prefix-repetition-prefix-len", "128",
                                      "--prefix-repetition-suffix-len", "16", "--prefix-repetition-num-prefixes",
                                      "2", "--prefix-repetition-output-len", "8"]),
                          ("random", ["--dataset-name", "random", "--random-input-len", "144",
                                      "--random-output-len", "8"])):
        code = main(["simulate", "--config", "configs/tiny-cpu.yaml", "--profile", str(profile), "--num-prompts", "20",
                     "--request-rate", "5", "--save-result", "--result-dir", str(tmp_path), "--result-file",
                     f"{name}.json", *dataset])
        assert code == 0
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    # 18 of the 20 prompts find their 128-token prefix (8 blocks of 16) computed by an earlier one
    assert results["prefix"]["cached_prompt_tokens"] == 18 * 128
    assert results["random"]["cached_prompt_tokens"] == 0
    assert results["prefix"]["median_ttft_ms"] < 0.5 * results["random"]["median_ttft_ms"]


def test_a_prompt_sharing_blocks_still_being_computed_waits_for_them_as_the_engine_does():
    # both 336-token prompts fit one 2048-token step, but the second shares the first's 320-token
    # prefix: it waits a step for those blocks and reads them from the cache (the engine's
    # set-aside rule, tests/test_shared_prompt_admission.py); computed together they took 672 ms
    shared = list(range(320))
    prompts = [shared + list(range(1000, 1016)), shared + list(range(2000, 2016))]
    result = simulate(_one_replica(), [(336, 1), (336, 1)], [0.0, 0.0], prompt_token_ids=prompts)
    assert [r.token_times[0] - r.send_time for r in result.requests] == pytest.approx([0.336, 0.352])
    assert result.cached_prompt_tokens == 320


def test_a_request_set_aside_keeps_its_seat_and_its_blocks_from_those_behind_it():
    from cluster.simulator.replica import SimReplica, SimSequence
    for seats, blocks in ((2, 100), (8, 9)):        # the last seat, or the blocks the second needs
        replica = SimReplica("R0", TOKENS, num_blocks=blocks, block_size=16, max_num_seqs=seats,
                             max_num_batched_tokens=2048, prefix_cache=PrefixCache(blocks))
        shared = prompt_block_hashes(list(range(64)), 16)
        other = prompt_block_hashes(list(range(500, 564)), 16)
        first, second, behind = (SimSequence(i, 64, 2, block_hashes=h) for i, h in enumerate((shared, shared, other)))
        for seq in (first, second, behind):
            replica.add(seq)
        _, work = replica.schedule()
        assert [seq.index for seq, _ in work] == [0], (seats, blocks)
        assert [seq.index for seq in replica.waiting] == [1, 2]
        replica.finish_step(work, 0.064)
        _, work = replica.schedule()
        assert [(seq.index, n) for seq, n in work] == [(0, 1), (1, 16)], (seats, blocks)
