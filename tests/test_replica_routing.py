"""The Serve request router that picks prefill and decode replicas: load
ranking, ties, targeted calls and retries steered away from a replica."""

from __future__ import annotations

import asyncio
import time
from collections import deque, namedtuple
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID as ServeReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from cluster.serving.replica_routing import (
    AVOID_REPLICA,
    LISTED_AFTER_S,
    SEEN_KEPT,
    TARGET_GRACE_S,
    TARGET_REPLICA,
    LoadAwareRouter,
    ReplicaGoneError,
)

ReplicaID = namedtuple("ReplicaID", "unique_id")


def replica(uid: str, **stats):
    return SimpleNamespace(replica_id=ReplicaID(uid), routing_stats=stats)


def pending(created_at: float | None = None, **kwargs):
    loop = asyncio.new_event_loop()
    return SimpleNamespace(kwargs=kwargs, routing_context=SimpleNamespace(should_backoff=False),
                           created_at=time.time() if created_at is None else created_at, future=loop.create_future())


def router(stat: str, prefer: str) -> LoadAwareRouter:
    r = LoadAwareRouter.__new__(LoadAwareRouter)   # the ranking needs none of Serve's router state
    r.initialize_state(stat=stat, prefer=prefer)
    return r


def ranked(r: LoadAwareRouter, replicas, request=None) -> list[str]:
    ranks = asyncio.run(r.choose_replicas(replicas, request))
    return [rank[0].replica_id.unique_id for rank in ranks]


def test_prefill_prefers_the_fewest_queued_tokens_and_decode_the_most_free_blocks():
    reps = [replica("a", queued_prefill_tokens=900, free_kv_blocks=10),
            replica("b", queued_prefill_tokens=0, free_kv_blocks=500),
            replica("c", queued_prefill_tokens=300, free_kv_blocks=80)]
    assert ranked(router("queued_prefill_tokens", "min"), reps, pending()) == ["b", "c", "a"]
    assert ranked(router("free_kv_blocks", "max"), reps, pending()) == ["b", "c", "a"]
    assert ranked(router("free_kv_blocks", "min"), reps, pending()) == ["a", "c", "b"]


def test_a_replica_whose_engine_stopped_ranks_last_whatever_the_others_load():
    # a stopped engine reports no free block; a live decode replica that is full (or charged
    # with a burst) scored as low or lower, and ties went to the one with fewer calls in flight
    stopped = {"free_kv_blocks": 0.0, "queued_prefill_tokens": 1e18, "engine_stopped": 1.0}
    for stat, prefer, live in (("free_kv_blocks", "max", {"free_kv_blocks": 0.0, "kv_block_size": 16}),
                               ("queued_prefill_tokens", "min", {"queued_prefill_tokens": 5e4})):
        r = router(stat, prefer)
        reps = [replica("live", **live), replica("dead", **stopped)]
        r.on_request_routed(None, reps[0].replica_id, None)       # the live one has a call in flight
        assert ranked(r, reps, pending(prompt_token_ids=[1] * 64)) == ["live", "dead"], stat


def test_a_worker_whose_engine_stopped_answers_no_stats():
    # the router's /health and figures leave it out (its last figures were reported as a
    # replica serving: /health said 200 with the only decode engine stopped)
    from cluster.serving.worker_deployment import WorkerDeployment
    from engine.errors import EngineStoppedError

    class StoppedWorker:
        def check_health(self):
            raise EngineStoppedError("the engine is not running: a TP rank died")

        def stats(self):
            return {"free_kv_blocks": 120.0}
    deployment = WorkerDeployment.__new__(WorkerDeployment)
    deployment.worker, deployment.replica_id = StoppedWorker(), "r1"
    with pytest.raises(EngineStoppedError):
        deployment.stats()
    deployment.worker = None        # (its __del__ shuts nothing down)


def test_ties_go_to_the_replica_with_fewer_calls_in_flight():
    r = router("queued_prefill_tokens", "min")
    reps = [replica("a", queued_prefill_tokens=0), replica("b", queued_prefill_tokens=0)]
    for _ in range(2):
        r.on_request_routed(None, reps[0].replica_id, None)
    assert ranked(r, reps, pending()) == ["b", "a"]
    r.on_request_completed(reps[0].replica_id, "x")
    r.on_request_completed(reps[0].replica_id, "y")
    r.on_request_completed(reps[0].replica_id, "z")   # never below zero
    assert ranked(r, reps, pending()) == ["a", "b"]


def test_the_calls_in_flight_of_a_replica_no_longer_listed_are_forgotten():
    # replicas come and go for as long as the router runs (autoscaling, failures): their counts went on
    async def main():      # (Serve's router needs a running loop)
        r = _serve_router([FakeServeReplica("a"), FakeServeReplica("b")])
        for uid in ("a", "b"):
            r.on_request_routed(None, ServeReplicaID(uid, _DEPLOYMENT), None)
        r.update_replicas([FakeServeReplica("b")])
        r.on_request_completed(ServeReplicaID("a", _DEPLOYMENT), "late")     # its call ends after it went
        return r._in_flight
    assert asyncio.run(main()) == {"b": 1}


def test_prompts_sent_since_the_last_report_count_against_their_replica(monkeypatch):
    # a burst between two reports: without counting what was chosen, every prompt went to "a"
    from cluster.serving import replica_routing
    from cluster.serving.messages import DecodeRequest
    from engine.sampling_params import SamplingParams
    clock = [1000.0]
    monkeypatch.setattr(replica_routing.time, "monotonic", lambda: clock[0])

    def call(i: int, *args):
        request = pending()
        request.args, request.metadata = list(args), SimpleNamespace(internal_request_id=f"call-{i}")
        return request

    prefill = router("queued_prefill_tokens", "min")
    reps = [replica("a", queued_prefill_tokens=0), replica("b", queued_prefill_tokens=200)]
    # prefill(request id, prompt token ids, params): 150 tokens each, charged as they are ranked
    chosen = [ranked(prefill, reps, call(i, f"r{i}", [7] * 150, None))[0] for i in range(4)]
    # a: 0 -> 150 -> 300 (b at 200 is lower) ...; b: 200 -> 350
    assert chosen == ["a", "a", "b", "a"]
    # a call ranked again (Serve backed off) moves its charge instead of counting twice
    assert ranked(prefill, reps, call(3, "r3", [7] * 150, None)) == ["a", "b"]
    assert prefill._recent_tokens("a", clock[0]) == 450 and prefill._recent_tokens("b", clock[0]) == 150
    clock[0] += replica_routing.RECENT_S + 0.1      # by now the reports show them
    assert ranked(prefill, reps, pending()) == ["a", "b"] and not prefill._charged
    # decode: free blocks of 16 tokens; a 320-token prompt takes 20 of "a"'s 30-block lead
    decode = router("free_kv_blocks", "max")
    decode.initialize_state(stat="free_kv_blocks", prefer="max", per_unit="kv_block_size")
    reps = [replica("a", free_kv_blocks=130, kv_block_size=16), replica("b", free_kv_blocks=100, kv_block_size=16)]
    request = DecodeRequest("r", [7] * 320, SamplingParams(), "router-0")
    assert ranked(decode, reps, call(10, request)) == ["a", "b"]
    assert ranked(decode, reps, call(11, request)) == ["a", "b"]
    assert ranked(decode, reps, call(12, request)) == ["b", "a"]
    # a: 2080 - 640 = 1440 free tokens, b: 1600 - 320; calls that bring no prompt (stats, release) count nothing
    assert ranked(decode, reps, call(13, "stats")) == ["a", "b"]
    assert decode._recent_tokens("a", clock[0]) == 640 and decode._recent_tokens("b", clock[0]) == 320


def test_a_targeted_call_goes_only_to_its_replica_and_a_retry_avoids_one():
    r = router("free_kv_blocks", "max")
    reps = [replica("a", free_kv_blocks=900), replica("b", free_kv_blocks=5)]
    assert ranked(r, reps, pending(**{TARGET_REPLICA: "b"})) == ["b"]
    assert ranked(r, reps, pending(**{AVOID_REPLICA: "a"})) == ["b"]
    assert ranked(r, reps[:1], pending(**{AVOID_REPLICA: "a"})) == ["a"]   # the only one left


def test_a_call_to_a_replica_that_is_gone_fails_instead_of_waiting():
    r = router("free_kv_blocks", "max")
    reps = [replica("a", free_kv_blocks=900), replica("b", free_kv_blocks=5)]
    ranked(r, reps, pending())                                  # the router has seen a and b
    # b died: Serve lists only a; a call to b fails at once with ReplicaGoneError
    call = pending(**{TARGET_REPLICA: "b"})
    ranked(r, reps[:1], call)
    assert isinstance(call.future.exception(), ReplicaGoneError)
    # a replica this router never saw may still be starting: it waits, up to the grace period
    young = pending(**{TARGET_REPLICA: "new"})
    assert ranked(r, reps, young) == [] and not young.future.done()
    old = pending(created_at=time.time() - TARGET_GRACE_S - 1, **{TARGET_REPLICA: "new"})
    ranked(r, reps, old)
    assert isinstance(old.future.exception(), ReplicaGoneError)


def test_the_replicas_seen_are_bounded_and_a_gone_one_still_fails_at_once(monkeypatch):
    # replicas come and go for as long as the router runs: it keeps the latest SEEN_KEPT ids
    monkeypatch.setattr("cluster.serving.replica_routing.SEEN_KEPT", 3)
    r = router("free_kv_blocks", "max")
    for uid in ("a", "b", "c", "d", "e"):
        ranked(r, [replica(uid, free_kv_blocks=1), replica("live", free_kv_blocks=1)])
    assert list(r._seen) == ["d", "e", "live"]        # "live", listed every time, is never the oldest
    call = pending(**{TARGET_REPLICA: "d"})             # d was replaced by e: gone, fails at once
    ranked(r, [replica("e"), replica("live")], call)
    assert isinstance(call.future.exception(), ReplicaGoneError)
    assert SEEN_KEPT >= 1000


def test_replica_gone_is_one_class_in_every_process():
    """Serve ships the request router to each replica by value (cloudpickle), a
    module's own classes included: the error it raises must be the one a caller in
    that process can catch, not a copy made by the unpickling."""
    import subprocess
    import sys

    import cloudpickle

    import cluster.serving.replica_routing as routing
    cloudpickle.register_pickle_by_value(routing)        # as RequestRouterConfig does
    try:
        shipped = cloudpickle.dumps(routing.LoadAwareRouter)
    finally:
        cloudpickle.unregister_pickle_by_value(routing)
    check = ("import sys, cloudpickle\n"
             "from cluster.serving.replica_routing import ReplicaGoneError\n"   # as callers import it
             "router = cloudpickle.loads(sys.stdin.buffer.read())\n"
             "print(router._fail_if_gone.__globals__['ReplicaGoneError'] is ReplicaGoneError)")
    out = subprocess.run([sys.executable, "-c", check], input=shipped, capture_output=True, check=True)
    assert out.stdout.decode().strip() == "True"


def test_calls_to_the_only_replica_fail_when_it_dies():
    """With no replica left Serve never asks choose_replicas: the death itself fails the calls
    waiting for that replica (others keep waiting for a replacement)."""
    r = router("queued_prefill_tokens", "min")
    only = replica("a")
    r._replicas, r._replicas_list, r._replica_id_set = {only.replica_id: only}, [only], {only.replica_id}
    r._queue_len_gauge_last_update = {}
    ranked(r, [only], pending())                                # the router has seen a
    to_a, to_any = pending(**{TARGET_REPLICA: "a"}), pending()
    r._pending_requests_to_fulfill = deque([to_a, to_any])
    r.on_replica_actor_died(only.replica_id)
    assert isinstance(to_a.future.exception(), ReplicaGoneError) and not to_any.future.done()


def test_prefer_must_be_min_or_max():
    with pytest.raises(ValueError, match="prefer must be 'min' or 'max'"):
        router("free_kv_blocks", "most")


# ---- with Serve's own routing machinery (its routing tasks, queues and backoff) ---------------
_DEPLOYMENT = DeploymentID(name="PrefillServer", app_name="pdserve")

class FakeServeReplica:
    """What Serve's RequestRouter reads of a replica: id, limit, queue length."""

    def __init__(self, uid: str):
        self.replica_id = ServeReplicaID(uid, _DEPLOYMENT)
        self.routing_stats, self.max_ongoing_requests = {}, 64
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "node", None, set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _serve_router(*replica_sets: list[FakeServeReplica]) -> LoadAwareRouter:
    r = LoadAwareRouter(deployment_id=_DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(stat="queued_prefill_tokens", prefer="min")
    for replicas in replica_sets:   # the router's view over time
        r.update_replicas(replicas)
    return r


def _route(r: LoadAwareRouter, call_id: str, **kwargs) -> asyncio.Task:
    """One call's replica choice, as a Serve handle starts it."""
    request = PendingRequest(args=[], kwargs=kwargs,
                             metadata=RequestMetadata(request_id=call_id, internal_request_id=call_id))
    return asyncio.ensure_future(r._choose_replica_for_request(request))




def test_a_call_to_a_replica_never_seen_fails_once_a_newer_list_lacks_it():
    """A decode replica that started after the prefill replica holding a request's
    KV died has never seen that replica: a list Serve gives its router after the
    call, without the target, says the target is gone (the call used to wait the
    whole grace period, past the KV transfer's deadline). A call made after the
    latest list still waits: its target may be starting."""
    async def scenario():
        a = FakeServeReplica("a")
        r = _serve_router([a])
        waiting = _route(r, "to-dead", **{TARGET_REPLICA: "dead"})
        await asyncio.sleep(0.2)
        r.update_replicas([a, FakeServeReplica("b")])          # too soon after the call to tell
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await asyncio.sleep(LISTED_AFTER_S)
        r.update_replicas([a, FakeServeReplica("b")])          # Serve's next list: no "dead" in it
        with pytest.raises(ReplicaGoneError, match="replica dead is not running"):
            await asyncio.wait_for(waiting, 2.0)
        later = _route(r, "to-starting", **{TARGET_REPLICA: "starting"})
        await asyncio.sleep(0.2)
        assert not later.done()
        later.cancel()
    asyncio.run(scenario())


def test_calls_to_a_scaled_down_replica_do_not_hold_up_calls_to_the_live_one():
    """Serve runs at most 2 routing tasks per replica. A call whose target is gone
    must free its task: two such calls used to hold both for ever, and the next
    send_kv to the surviving prefill replica waited out its 60 s timeout."""
    async def scenario():
        a, b = FakeServeReplica("a"), FakeServeReplica("b")
        r = _serve_router([a, b], [b])                    # a was scaled down
        for n in range(3):
            with pytest.raises(ReplicaGoneError, match="replica a is not running"):
                await asyncio.wait_for(_route(r, f"to-a-{n}", **{TARGET_REPLICA: "a"}), 2.0)
        chosen = await asyncio.wait_for(_route(r, "to-b", **{TARGET_REPLICA: "b"}), 2.0)
        assert chosen.replica_id.unique_id == "b"
    asyncio.run(scenario())


def test_a_replica_chosen_for_one_call_is_not_handed_to_an_older_call_for_another():
    """An older call waits for a replica that is still starting; a newer call to b
    gets b, and the older one keeps waiting for its own replica (Serve's FIFO
    hand-over gave it b, sending a send_kv or a stream to the wrong replica)."""
    async def scenario():
        b = FakeServeReplica("b")
        r = _serve_router([b])
        waiting = _route(r, "to-new", **{TARGET_REPLICA: "new"})
        await asyncio.sleep(0.05)
        chosen = await asyncio.wait_for(_route(r, "to-b", **{TARGET_REPLICA: "b"}), 2.0)
        assert chosen.replica_id.unique_id == "b"
        await asyncio.sleep(0.2)
        assert not waiting.done()
        new = FakeServeReplica("new")
        r.update_replicas([b, new])                        # it started
        assert (await asyncio.wait_for(waiting, 2.0)).replica_id.unique_id == "new"
    asyncio.run(scenario())
