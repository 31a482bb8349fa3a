"""How Serve picks a prefill or decode replica for each call (a Serve request
router, configured per deployment by the app builder).

- A call that names `target_replica=<replica unique id>` goes to that replica
  only: the prefill replica that holds a request's KV is asked to send or
  release it. If that replica is gone (this router saw it before and Serve no
  longer lists it; or a list Serve gave this router LISTED_AFTER_S or more
  after the call was made lacks it; or it has not appeared within
  TARGET_GRACE_S), the call fails with ReplicaGoneError instead of waiting for
  it for ever.
- A replica chosen for a call goes to that call (Serve's match by request id),
  never to an older waiting one as Serve's FIFOMixin would do: an older call
  may be addressed to another replica.
- A call that names `avoid_replica=<id>` (a retry after a failed KV transfer)
  goes elsewhere when another replica is available.
- Any other call goes to the replica whose load is best: its last reported
  figure (`record_routing_stats`: the fewest queued prefill tokens for
  prefill, the most free KV blocks for decode), less the prompt tokens of the
  calls this router chose it for over the last RECENT_S, which no report may
  show yet (reports come every ~0.5 s, and reach the router later still:
  without this, every prompt of a burst went to the replica that looked best
  at its start). A call is charged to the replica it is ranked first for, at
  once (the replica's answer that it took the call comes too late for a burst
  that arrives in a few milliseconds); chosen again, it moves. A
  figure in blocks counts a token as 1 / `per_unit` of a block (`per_unit`
  names the replica's stat holding the block size). Ties go to the replica
  with the fewest calls this router has in flight to it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque

from ray.serve.request_router import (
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from cluster.serving.messages import ReplicaGoneError

TARGET_REPLICA = "target_replica"
AVOID_REPLICA = "avoid_replica"
TARGET_GRACE_S = 10.0      # a target this router has never seen may still be starting
LISTED_AFTER_S = 1.0       # ... unless a replica list this much newer than the call lacks it
RECENT_S = 1.5             # sent prompts count against a replica this long (a report's period and delay)
SEEN_KEPT = 4096           # the most recently listed replica ids kept to tell "gone" from "not started yet"


class LoadAwareRouter(RequestRouter):
    def initialize_state(self, stat: str = "num_waiting", prefer: str = "min", per_unit: str | None = None,
                         **kwargs) -> None:
        """Routes by the replicas' `stat`, lowest first (`prefer` "min") or highest
        ("max"); `per_unit`: the stat holding how many tokens one unit of `stat`
        is (None: `stat` counts tokens)."""
        if prefer not in ("min", "max"):
            raise ValueError(f"prefer must be 'min' or 'max', got {prefer!r}")
        self._stat, self._sign, self._per_unit = stat, (1.0 if prefer == "min" else -1.0), per_unit
        self._in_flight: dict[str, int] = {}
        self._recent: dict[str, deque[list]] = {}    # replica id -> [time chosen, prompt tokens, call key]
        self._charged: dict[object, tuple[str, list]] = {}   # call key -> (replica id, its entry there)
        self._seen: OrderedDict[str, None] = OrderedDict()   # replica ids it has had as candidates, latest last
        self._listed_at = 0.0                        # when Serve last gave this router its replicas (wall clock)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._saw(candidate_replicas)
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
            target = pending_request.kwargs.get(TARGET_REPLICA)
            if target:
                chosen = [[r] for r in candidate_replicas if r.replica_id.unique_id == target]
                if not chosen:
                    self._fail_if_gone(pending_request, target)
                if pending_request.future.done():
                    # Serve's routing task looks at the call's future only when handed a
                    # replica: with nothing it would back off and ask again for ever,
                    # holding one of its few routing slots (2 per replica) from live calls
                    return [candidate_replicas[:1]]
                return chosen
            avoid = pending_request.kwargs.get(AVOID_REPLICA)
            others = [r for r in candidate_replicas if r.replica_id.unique_id != avoid]
            if avoid and others:
                candidate_replicas = others

        now = time.monotonic()
        if pending_request is not None:
            self._uncharge(pending_request)     # ranked again: its own prompt is not yet anywhere

        def load(replica: RunningReplica) -> tuple[float, int]:
            stats = replica.routing_stats or {}
            if stats.get("engine_stopped"):
                return math.inf, 0       # last, whatever the others' load: it cannot serve
            per_unit = float(stats.get(self._per_unit, 1.0)) if self._per_unit else 1.0
            tokens = float(stats.get(self._stat, 0.0)) * per_unit
            uid = replica.replica_id.unique_id
            return self._sign * tokens + self._recent_tokens(uid, now), self._in_flight.get(uid, 0)
        ranked = sorted(candidate_replicas, key=load)
        if pending_request is not None and ranked:
            self._charge(pending_request, ranked[0].replica_id.unique_id, now)
        return [[r] for r in ranked]

    def _charge(self, pending_request, replica_id: str, now: float) -> None:
        """Counts the call's prompt tokens against `replica_id`."""
        tokens = _prompt_tokens(pending_request)
        if not tokens:
            return
        key = _call_key(pending_request)
        entry = [now, tokens, key]
        self._recent.setdefault(replica_id, deque()).append(entry)
        self._charged[key] = (replica_id, entry)

    def _uncharge(self, pending_request) -> None:
        previous = self._charged.pop(_call_key(pending_request), None)
        if previous is not None:
            try:
                self._recent[previous[0]].remove(previous[1])
            except (KeyError, ValueError):
                pass      # its replica is gone

    def _recent_tokens(self, replica_id: str, now: float) -> int:
        """Prompt tokens of the calls this router chose `replica_id` for over the last RECENT_S."""
        recent = self._recent.get(replica_id)
        if not recent:
            return 0
        while recent and recent[0][0] < now - RECENT_S:
            self._charged.pop(recent.popleft()[2], None)
        return sum(entry[1] for entry in recent)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._saw(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        self._listed_at = time.time()
        for gone in [uid for uid in self._recent if uid not in live]:
            for entry in self._recent.pop(gone):
                self._charged.pop(entry[2], None)
        for gone in [uid for uid in self._in_flight if uid not in live]:   # (replicas come and go for ever)
            del self._in_flight[gone]
        self._fail_calls_to_gone_targets()

    def _saw(self, replicas: list[RunningReplica]) -> None:
        """Remembers the replicas' ids, forgetting the longest unlisted past SEEN_KEPT
        (replicas come and go for ever)."""
        for replica in replicas:
            self._seen[replica.replica_id.unique_id] = None
            self._seen.move_to_end(replica.replica_id.unique_id)
        while len(self._seen) > SEEN_KEPT:
            self._seen.popitem(last=False)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._fail_calls_to_gone_targets()

    def _fail_calls_to_gone_targets(self) -> None:
        """Serve asks choose_replicas nothing while a deployment has no replica at
        all (its only one died): calls waiting for a replica that is gone fail here."""
        live = {replica_id.unique_id for replica_id in self.curr_replicas}
        for pending in list(getattr(self, "_pending_requests_to_fulfill", ())):
            target = pending.kwargs.get(TARGET_REPLICA)
            if target and target not in live:
                self._fail_if_gone(pending, target)

    def _fail_if_gone(self, pending_request: PendingRequest, target: str) -> None:
        waited = time.time() - pending_request.created_at
        # a target that answered before the call was made was running then: a list of the replicas
        # given after the call that lacks it says it is gone (one never seen may still be starting);
        # a second's margin, as a list can reach this router later than the controller made it
        listed_after = self._listed_at - pending_request.created_at
        if target in self._seen or waited > TARGET_GRACE_S or listed_after >= LISTED_AFTER_S:
            future = pending_request.future
            if not future.done():
                future.set_exception(ReplicaGoneError(f"replica {target} is not running (any more)"))
                if hasattr(self, "_pending_requests_by_id"):   # Serve's index of waiting calls
                    self._remove_pending_request_from_indices(pending_request)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        self._in_flight[replica_id.unique_id] = self._in_flight.get(replica_id.unique_id, 0) + 1

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        n = self._in_flight.get(replica_id.unique_id)
        if n is not None:        # (none: a replica no longer listed, its count dropped)
            self._in_flight[replica_id.unique_id] = max(0, n - 1)


def _prompt_tokens(pending_request) -> int:
    """The prompt tokens a call brings its replica: prefill(request id, prompt ids, params)
    or generate(DecodeRequest); 0 for any other call."""
    for arg in getattr(pending_request, "args", ()):
        ids = getattr(arg, "prompt_token_ids", arg)
        if isinstance(ids, list):
            resume = getattr(arg, "resume", None)
            return len(ids) + (len(resume.token_ids) if resume is not None else 0)
    return 0


def _call_key(pending_request) -> object:
    return getattr(getattr(pending_request, "metadata", None), "internal_request_id", None) or id(pending_request)
