"""The event loop: arrivals, routing, replica steps, KV hand-offs.

Routing follows the live router (router/serving_backend.py,
router/disaggregation_policy.py, cluster/serving/replica_routing.py):
- colocated: the replica with the most free KV blocks;
- disaggregated, policy "always": every prompt to the prefill replica with the
  fewest queued prompt tokens; after its first token the decode replica with
  the most free blocks reserves blocks for the sequence (or it waits for
  some), the KV moves (latency + bytes / bandwidth; a (prefill, decode) pair's
  transfers one after another, each with its latency, as the transport sends
  each and waits for its acknowledgement before the next), the prefill side
  frees its copy and the decode side decodes;
- disaggregated, policy "conditional": the router's own class decides
  (router/disaggregation_policy.py): prompts of at most local_prefill_max_tokens
  are prefilled on a decode replica; longer ones too, when the prefill pool's
  predicted wait exceeds max_remote_wait and the decode replica's predicted
  time to first token is shorter, priced with the replicas' measured cost
  figures (below), the prompt tokens sent to each side and not yet answered
  with a first token, and the hand-offs' measured time.
A request's time on the router and the HTTP path (`request_overhead_s`) is
added to all its token times.

Admission control (`ClusterSpec.admission`): the router's own class
(router/admission.py) decides each arrival, on the simulated clock. It and
the disaggregation policy read the cost figures each replica measures on its
simulated steps (engine/step_cost.py
EngineCosts, as the engines do; the start-up figure is the model's time for
the engine's calibration prompt), read every `stats_period_s` as the router
refreshes them. A refused request ends at once with a 429, as a load-test
client records it.

Replicas sharing one machine's CPU cores (`shared_cores`, CPU deployments):
the steps running at any moment share them (processor sharing): each runs at
min(1, cores / demand) of its own speed, where the demand is the threads of
every replica in a step plus `serving_cores_per_stream` for each request
streaming tokens (the router, the HTTP path and the client; a request still
waiting for its first token costs them nothing). Replicas with devices of their
own (GPUs) leave `shared_cores` None and take the model's time.

Idle cores lent (`lend_idle_cores`, engine/core_lending.py): replicas in the
core ledger (`ReplicaSpec.in_core_ledger`: one-rank CPU pools) lend the cores
they own while they have no work; a decode or colocated replica with a
`wide_model` (its step time with every shared core as a thread) starts each
step with its own threads plus the owned cores of idle replicas that no replica
at work already borrows, and runs at the step time interpolated between its
own and its wide model (linear in 1 / threads). It keeps them for the whole
step even when the lender goes back to work meanwhile (the cores are then
oversubscribed), as the engine does.

With an autoscaler (cluster/simulator/autoscaling.py) the pools change while
the requests run: a replica asked for joins its pool once its start-up time
has passed; a replica scaled down takes nothing new, finishes what it holds,
then leaves. Replica-seconds count from asking to leaving.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from cluster.perf_model.step_shape import StepShape, StepTimeModel
from cluster.simulator.prefix_cache import PrefixCache, prompt_block_hashes
from cluster.simulator.replica import SimReplica, SimSequence
from engine.core_lending import lendable_cores
from engine.step_cost import CALIBRATION_TOKENS, EngineCosts
from router.admission import AdmissionSettings, Admitted, Overloaded, admission_for
from router.disaggregation_policy import DisaggregationPolicy, DisaggregationSettings


@dataclass(frozen=True)
class ReplicaSpec:
    model: StepTimeModel
    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    threads: int = 1                 # CPU threads of one replica's ranks together (for shared_cores)
    in_core_ledger: bool = False     # lends its cores while idle (ClusterSpec.lend_idle_cores)
    wide_model: StepTimeModel | None = None   # its step time at shared_cores threads: it borrows idle cores
    enable_prefix_caching: bool = True  # reuses cached prompt blocks (when simulate() gets the prompts' tokens)
    enable_chunked_prefill: bool = True  # False: a prompt runs whole in one step (engine.enable_chunked_prefill)

    def __post_init__(self) -> None:
        # as the engine: no more sequences run than a step has tokens (EngineConfig.max_running_seqs)
        object.__setattr__(self, "max_num_seqs", min(self.max_num_seqs, self.max_num_batched_tokens))


@dataclass(frozen=True)
class ClusterSpec:
    mode: str                                  # "disaggregated" | "colocated"
    prefill: ReplicaSpec | None = None
    decode: ReplicaSpec | None = None          # also the colocated replicas' spec
    prefill_replicas: int = 0
    decode_replicas: int = 1                   # colocated: the number of colocated replicas
    policy: str = "always"                     # "always" | "conditional"
    local_prefill_max_tokens: int = 128
    max_remote_wait_s: float = 0.5
    kv_bytes_per_token: float = 0.0
    kv_bandwidth_bytes_per_s: float = 1e9
    kv_latency_s: float = 0.0
    request_overhead_s: float = 0.0
    shared_cores: float | None = None          # CPU cores all replicas share; None: a device each
    serving_cores_per_stream: float = 0.0      # cores the serving path keeps busy per request streaming
    lend_idle_cores: bool = False              # with shared_cores: idle replicas' cores are lent (module doc)
    admission: AdmissionSettings | None = None # the router's admission control; None: every request admitted
    stats_period_s: float = 1.0                # how often the router reads the replicas' cost figures
    max_model_len: int | None = None           # the router answers 400 past it (prompt + max_tokens); None: no limit

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if self.decode is None or self.decode_replicas < 1:
            raise ValueError("need at least one decode (or colocated) replica")
        if self.mode == "disaggregated" and (self.prefill is None or self.prefill_replicas < 1):
            raise ValueError("disaggregated mode needs at least one prefill replica")
        if self.policy not in ("always", "conditional"):
            raise ValueError(f"policy must be always or conditional, got {self.policy!r}")
        if self.shared_cores is not None and self.shared_cores <= 0:
            raise ValueError(f"shared_cores must be > 0 (or None), got {self.shared_cores}")
        if self.serving_cores_per_stream < 0:
            raise ValueError(f"serving_cores_per_stream must be >= 0, got {self.serving_cores_per_stream}")
        if self.lend_idle_cores and self.shared_cores is None:
            raise ValueError("lend_idle_cores needs shared_cores: cores are lent only between replicas "
                             "sharing one machine's")
        if self.stats_period_s <= 0:
            raise ValueError(f"stats_period_s must be > 0, got {self.stats_period_s}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (or None), got {self.max_model_len}")
        if self.kv_bandwidth_bytes_per_s <= 0 or self.kv_latency_s < 0 or self.request_overhead_s < 0:
            raise ValueError("the KV bandwidth must be > 0, the KV latency and the request overhead >= 0")


@dataclass
class SimRequestLog:
    index: int
    prompt_len: int
    output_len: int
    scheduled: float                 # when the arrival process meant to send it
    send_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    end_time: float | None = None
    prefilled_locally: bool = False
    refused: Overloaded | None = None  # admission control's 429 (end_time: when it was answered)
    invalid: str | None = None         # the router's 400 (past max_model_len; end_time: when it was answered)


@dataclass
class SimulationResult:
    requests: list[SimRequestLog]
    duration: float
    num_steps: int
    num_preemptions: int
    num_local_prefills: int
    replica_seconds: dict[str, float] = field(default_factory=dict)   # per role
    replica_spans: list[tuple[str, float, float]] = field(default_factory=list)   # (role, placed, stopped or end)
    timeline: list[dict] = field(default_factory=list)                # the autoscaler's intervals
    mean_stretch: dict[str, float] = field(default_factory=dict)      # per role: step time / model's time
    cached_prompt_tokens: int = 0                                     # prompt tokens served by prefix caches
    refusals: dict[str, int] = field(default_factory=dict)            # admission control's, per reason
    interrupted: str | None = None                                    # why it stopped before every request ended

    def records(self):
        """The requests as `pdserve loadtest` RequestRecords (times in seconds from 0)."""
        from bench.loadtest.client import RequestRecord
        records = []
        for r in self.requests:
            if r.send_time is None:
                continue
            if r.refused is not None or r.invalid is not None:
                status, message = (429, r.refused.message) if r.refused is not None else (400, r.invalid)
                records.append(RequestRecord(
                    index=r.index, prompt_len=r.prompt_len, expected_output_len=r.output_len,
                    scheduled_offset=r.scheduled, send_time=r.send_time, end_time=r.end_time, status=status,
                    error=f"HTTP {status}: {message}"))
                continue
            done = r.end_time is not None
            records.append(RequestRecord(      # one cut off in flight as pdserve loadtest records it
                index=r.index, prompt_len=r.prompt_len, expected_output_len=r.output_len,
                scheduled_offset=r.scheduled, send_time=r.send_time, chunk_times=list(r.token_times),
                end_time=r.end_time if done else self.duration, output_tokens=len(r.token_times),
                token_count_method="usage", usage_prompt_tokens=r.prompt_len, status=200 if done else None,
                succeeded=done, unfinished=not done,
                error=None if done else f"unfinished when the run stopped ({self.interrupted})"))
        return records


def simulate(spec: ClusterSpec, lengths: Sequence[tuple[int, int]], arrivals: Sequence[float], *,
             max_concurrency: int | None = None, max_duration: float = float("inf"),
             autoscaler=None, prompt_token_ids: Sequence[Sequence[int]] | None = None) -> SimulationResult:
    """Runs requests (prompt_len, output_len) arriving at offsets `arrivals` (s).
    `autoscaler`: a cluster.simulator.autoscaling.SimAutoscaler, or None for fixed pools.
    `prompt_token_ids`: each request's prompt, for prefix caching (without them
    no prompt shares anything with another)."""
    if len(lengths) != len(arrivals):
        raise ValueError(f"{len(lengths)} requests but {len(arrivals)} arrival times")
    sim = _Simulation(spec, max_concurrency, max_duration, autoscaler)
    if prompt_token_ids is not None:
        if len(prompt_token_ids) != len(lengths):
            raise ValueError(f"{len(lengths)} requests but {len(prompt_token_ids)} prompts")
        sizes = {rs.block_size for rs in (spec.prefill, spec.decode) if rs is not None}
        if len(sizes) != 1:
            raise ValueError(f"prefix caching needs one block size for every replica, got {sorted(sizes)}")
        block_size = sizes.pop()
        sim.block_hashes = [prompt_block_hashes(ids, block_size) for ids in prompt_token_ids]
    return sim.run(lengths, arrivals)


class _Simulation:
    def __init__(self, spec: ClusterSpec, max_concurrency: int | None, max_duration: float, autoscaler=None):
        self.spec = spec
        self.autoscaler = autoscaler
        self.retired: list[SimReplica] = []
        self.arrived: list[SimRequestLog] = []           # in arrival order (the autoscaler reads them)
        self.finished: list[SimRequestLog] = []          # in finishing order
        self.max_concurrency = max_concurrency
        self.max_duration = max_duration
        self.now = 0.0
        self.events: list = []
        self.counter = itertools.count()
        self.logs: list[SimRequestLog] = []
        self.in_flight = 0
        self.streaming = 0                              # requests in flight past their first token
        self.pending: list[SimRequestLog] = []          # held back by max_concurrency
        self.awaiting_decode: list[tuple[SimSequence, SimReplica]] = []   # prefilled, no decode blocks yet
        self.prefill_pool = [self._replica(f"prefill-{i}", spec.prefill, borrows=False)
                             for i in range(spec.prefill_replicas)] if spec.mode == "disaggregated" else []
        role = "decode" if spec.mode == "disaggregated" else "colocated"
        self.decode_pool = [self._replica(f"{role}-{i}", spec.decode, borrows=True)
                            for i in range(spec.decode_replicas)]
        self.num_local_prefills = 0
        self.names = itertools.count(max(spec.prefill_replicas, spec.decode_replicas))
        self.block_hashes: list[tuple[int, ...]] | None = None   # per request (simulate's prompt_token_ids)
        self.tickets: dict[int, Admitted] = {}           # admitted requests' admission tickets, by index
        self.refused: list[SimRequestLog] = []           # in refusal order (the autoscaler reads them)
        self.num_invalid = 0                               # answered 400 (past max_model_len)
        self.policy = DisaggregationPolicy(DisaggregationSettings(
            spec.policy, spec.local_prefill_max_tokens, spec.max_remote_wait_s)) \
            if spec.mode == "disaggregated" else None
        self.admission = admission_for(spec.admission, spec.mode, self.policy, clock=lambda: self.now)
        self.prefilling: dict[int, tuple[bool, int]] = {}   # index -> (on a decode replica, prompt tokens)
        self.link_free_at: dict[tuple[str, str], float] = {}  # (prefill, decode) replica -> its last transfer's end

    def _replica(self, name: str, rs: ReplicaSpec, *, borrows: bool) -> SimReplica:
        """`borrows`: a decode (colocated) replica, which may borrow idle cores."""
        replica = SimReplica(name, rs.model, rs.num_kv_blocks, rs.block_size, rs.max_num_seqs,
                             rs.max_num_batched_tokens, started_at=self.now, threads=rs.threads,
                             enable_chunked_prefill=rs.enable_chunked_prefill)
        if self.spec.lend_idle_cores and rs.in_core_ledger:
            replica.in_core_ledger = True
            replica.wide_model = rs.wide_model if borrows else None
        if rs.enable_prefix_caching:
            replica.prefix_cache = PrefixCache(rs.num_kv_blocks)
        calibration = min(CALIBRATION_TOKENS, rs.max_num_batched_tokens)    # engine/step_cost.py's prompt
        replica.costs = EngineCosts(start_prefill_s_per_token=_prefill_time(rs.model, calibration) / calibration)
        replica.on_token = self._on_token
        replica.on_prefilled = lambda seq, t, r=replica: self._on_prefilled(seq, r)
        return replica

    # ---- the loop -------------------------------------------------------------------------
    def at(self, time: float, action: Callable[[], None]) -> None:
        if time < self.now:
            raise RuntimeError(f"an event at {time} s scheduled at {self.now} s: the clock would run backwards")
        heapq.heappush(self.events, (time, next(self.counter), action))

    def run(self, lengths, arrivals) -> SimulationResult:
        for i, ((prompt, output), offset) in enumerate(zip(lengths, arrivals)):
            if prompt < 1 or output < 1:
                raise ValueError(f"request {i}: prompt and output lengths must be >= 1, got {prompt}, {output}")
            log = SimRequestLog(i, prompt, output, offset)
            self.logs.append(log)
            self.at(offset, lambda log=log: self._arrive(log))
        if self.autoscaler is not None:
            self.autoscaler.attach(self)
        if self.admission is not None or self.policy is not None:
            self._refresh_worker_stats()
        cut = False
        while self.events:
            time, _, action = heapq.heappop(self.events)
            if time > self.max_duration:
                cut = self.unfinished      # (past every request's end, only ticks and refreshes are left)
                break
            self.now = time
            action()
        ends = [r.end_time for r in self.logs if r.end_time is not None]
        duration = self.max_duration if cut else max(ends, default=0.0)
        pools = self.prefill_pool + self.decode_pool + self.retired
        spans = [(self.role_of(r), r.started_at, r.stopped_at or duration) for r in pools]
        seconds: dict[str, float] = {}
        for role, start, stop in spans:
            seconds[role] = seconds.get(role, 0.0) + max(0.0, stop - start)
        timeline = self.autoscaler.timeline if self.autoscaler is not None else []
        stretch: dict[str, list[float]] = {}
        for r in pools:
            totals = stretch.setdefault(self.role_of(r), [0.0, 0])
            totals[0] += r.stretch_sum
            totals[1] += r.num_steps
        return SimulationResult(
            self.logs, duration, sum(r.num_steps for r in pools), sum(r.num_preemptions for r in pools),
            self.num_local_prefills, replica_seconds=seconds, replica_spans=spans, timeline=timeline,
            mean_stretch={role: total / n for role, (total, n) in stretch.items() if n},
            cached_prompt_tokens=sum(r.cached_prompt_tokens for r in pools),
            refusals=dict(Counter(log.refused.reason for log in self.refused)),
            interrupted=f"--max-duration {self.max_duration:g} s reached" if cut else None)

    # ---- pools ------------------------------------------------------------------------------
    @property
    def unfinished(self) -> bool:
        return len(self.finished) + len(self.refused) + self.num_invalid < len(self.logs)

    def role_of(self, replica: SimReplica) -> str:
        return replica.name.rsplit("-", 1)[0]

    def pool(self, role: str) -> list[SimReplica]:
        return self.prefill_pool if role == "prefill" else self.decode_pool

    def add_replica(self, role: str) -> SimReplica:
        """A new replica of `role` (prefill, decode or colocated), serving from now."""
        spec = self.spec.prefill if role == "prefill" else self.spec.decode
        replica = self._replica(f"{role}-{next(self.names)}", spec, borrows=role != "prefill")
        self.pool(role).append(replica)
        self._admit_awaiting()
        return replica

    def drain_replica(self, replica: SimReplica) -> None:
        """Takes nothing new; leaves its pool once it holds nothing."""
        replica.draining = True
        self._retire_if_done(replica)

    def _retire_if_done(self, replica: SimReplica) -> None:
        if replica.draining and replica.idle and replica.stopped_at is None:
            replica.stopped_at = self.now
            self.pool(self.role_of(replica)).remove(replica)
            self.retired.append(replica)
            if self.autoscaler is not None:
                self.autoscaler.on_retire()

    @staticmethod
    def _live(pool: list[SimReplica]) -> list[SimReplica]:
        return [r for r in pool if not r.draining] or pool

    # ---- requests -------------------------------------------------------------------------
    def _arrive(self, log: SimRequestLog) -> None:
        if self.max_concurrency is not None and self.in_flight >= self.max_concurrency:
            self.pending.append(log)
            return
        log.send_time = self.now
        self.arrived.append(log)
        limit = self.spec.max_model_len
        # as the live router: a prompt that leaves no room, or an output past the context, is refused
        # (400); an output the prompt leaves less room for is cut to the room left
        if limit is not None and (log.prompt_len >= limit or log.output_len > limit):
            log.invalid = (f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{log.prompt_len} tokens in the prompt and {log.output_len} in the completion.")
            log.end_time = self.now
            self.num_invalid += 1
            self._send_pending()
            return
        output_len = log.output_len if limit is None else min(log.output_len, limit - log.prompt_len)
        if self.admission is not None:
            try:
                arrival = self.admission.check_before_tokenizing()
                self.tickets[log.index] = self.admission.admit(log.prompt_len, output_len, arrival)
            except Overloaded as exc:
                self._refuse(log, exc)
                return
        self.in_flight += 1
        seq = SimSequence(log.index, log.prompt_len, output_len)
        if self.block_hashes is not None:
            seq.block_hashes = self.block_hashes[log.index]
        # an empty prefill pool (the autoscaler retired its last replica since the router's last look):
        # the decode replicas prefill, as the live router does once it sees none running
        local = self.policy is None or self.policy.prefill_locally(seq.prompt_len) or not self.prefill_pool
        if self.policy is not None:
            self.policy.started(local, seq.prompt_len)
            self.prefilling[seq.index] = (local, seq.prompt_len)
        if local:
            log.prefilled_locally = self.spec.mode == "disaggregated"
            self.num_local_prefills += log.prefilled_locally
            replica = max(self._live(self.decode_pool), key=lambda r: r.decode_routing_key)
        else:
            seq.hold_after_first = True
            replica = min(self._live(self.prefill_pool), key=lambda r: r.queued_prefill_tokens)
        replica.add(seq)
        self._kick(replica)

    def _refuse(self, log: SimRequestLog, refusal: Overloaded) -> None:
        log.refused = refusal
        log.end_time = self.now + self.spec.request_overhead_s
        self.refused.append(log)
        self._send_pending()

    def _send_pending(self) -> None:
        """A request ended: the next one held back by max_concurrency is sent, once
        everything else at this instant has happened."""
        if self.pending:
            log = self.pending.pop(0)
            self.at(self.now, lambda: self._arrive(log))

    def _on_token(self, seq: SimSequence, time: float) -> None:
        log = self.logs[seq.index]
        log.token_times.append(time + self.spec.request_overhead_s)
        streaming = self.streaming
        self.streaming += len(log.token_times) == 1
        ticket = self.tickets.get(seq.index)
        if ticket is not None and len(log.token_times) == 1:
            self.admission.first_token(ticket)
        if seq.index in self.prefilling and len(log.token_times) == 1:
            self.policy.first_token(*self.prefilling.pop(seq.index))
        if seq.finished:
            log.end_time = time + self.spec.request_overhead_s
            self.finished.append(log)
            self.in_flight -= 1
            self.streaming -= 1
            if ticket is not None:
                self.admission.finished(self.tickets.pop(seq.index), len(log.token_times))
            self._send_pending()
        if self.streaming != streaming:
            self._share_cores()

    def _refresh_worker_stats(self) -> None:
        """The router's periodic read of every replica's cost figures (router/ingress.py)."""
        roles = [("colocated", self.decode_pool)] if self.spec.mode == "colocated" else \
            [("prefill", self.prefill_pool), ("decode", self.decode_pool)]
        for role, pool in roles:
            stats = [r.costs.stats() for r in pool if not r.draining]
            if self.admission is not None:
                self.admission.observe_workers(role, stats)
            if self.policy is not None:
                self.policy.observe_workers(role, stats)
        if self.unfinished and self.events:    # (nothing else to come: the run is over, or stuck for good)
            self.at(self.now + self.spec.stats_period_s, self._refresh_worker_stats)

    # ---- the hand-off ---------------------------------------------------------------------
    def _on_prefilled(self, seq: SimSequence, source: SimReplica) -> None:
        self.awaiting_decode.append((seq, source))
        self._admit_awaiting()

    def _admit_awaiting(self) -> None:
        still = []
        for seq, source in self.awaiting_decode:
            target = max(self._live(self.decode_pool), key=lambda r: r.decode_routing_key)
            if not target.try_admit_prefilled(seq):
                still.append((seq, source))
                continue
            done = self._transfer_end(seq, source, target)
            self.at(done, lambda s=seq, src=source, dst=target: self._transferred(s, src, dst))
            self.policy.observe_handoff(done - self.now)     # (the router hears it when the decode side admits it)
        self.awaiting_decode = still

    def _transfer_end(self, seq: SimSequence, source: SimReplica, target: SimReplica) -> float:
        """When `seq`'s KV is in on `target`, a transfer asked for now: it starts once the
        pair's transfers before it are through, and takes its latency and its bytes'
        time (cluster/transport/pair_group_sender.py sends a header, the bytes, and
        waits for the receiver's acknowledgement, one transfer at a time)."""
        spec = self.spec
        pair = (source.name, target.name)
        start = max(self.now, self.link_free_at.get(pair, 0.0))
        self.link_free_at[pair] = start + spec.kv_latency_s + \
            seq.prompt_len * spec.kv_bytes_per_token / spec.kv_bandwidth_bytes_per_s
        return self.link_free_at[pair]

    def _transferred(self, seq: SimSequence, source: SimReplica, target: SimReplica) -> None:
        source.release_held(seq)
        seq.hold_after_first = False
        target.commit_prefilled(seq)
        self._kick(source)
        self._kick(target)
        self._retire_if_done(source)

    # ---- replica steps --------------------------------------------------------------------
    def _kick(self, replica: SimReplica) -> None:
        """Starts the replica's next step once everything else at this instant has
        happened (requests arriving together share a step, as the engine's loop
        would pick them up together)."""
        if replica.busy or replica.step_pending or not replica.has_work:
            return
        replica.step_pending = True
        self.at(self.now, lambda: self._start_step(replica))

    def _start_step(self, replica: SimReplica) -> None:
        replica.step_pending = False
        if replica.busy:
            return
        shape, work = replica.schedule()
        if not work:
            return        # blocked on KV blocks held elsewhere: kicked again when they are freed
        replica.busy = True
        seconds = self._step_seconds(replica, shape)
        if self.spec.shared_cores is None:
            replica.stretch_sum += 1.0
            self.at(self.now + seconds, lambda: self._step_done(replica, work, shape, seconds))
            return
        replica.step = _SharedStep(work, shape, seconds, started=self.now, left=seconds)
        self._share_cores()

    def _step_seconds(self, replica: SimReplica, shape: StepShape) -> float:
        """The step's time alone on its cores: with its own threads, or with the
        idle cores it borrows now (lend_idle_cores)."""
        replica.borrowed = self._lendable_to(replica) if replica.wide_model is not None else 0
        if replica.borrowed == 0:
            return replica.model.step_time(shape)
        return lent_step_time(replica.model, replica.wide_model, shape, own_threads=replica.threads,
                              threads=replica.threads + replica.borrowed, cores=int(self.spec.shared_cores))

    def _lendable_to(self, borrower: SimReplica) -> int:
        """What the engines' ledger would lend `borrower` now (engine/core_lending.py)."""
        others = [(r.threads, r.borrowed, r.busy or r.has_work)
                  for r in self.prefill_pool + self.decode_pool + self.retired
                  if r is not borrower and r.in_core_ledger and r.stopped_at is None]
        return lendable_cores(int(self.spec.shared_cores), borrower.threads, others)

    # ---- steps on shared cores ------------------------------------------------------------
    def _share_cores(self) -> None:
        """Shares the cores among the steps running now (processor sharing): each runs
        at min(1, cores / demand) of its own speed until the demand changes, where the
        demand is their threads plus the serving path's cores per request streaming."""
        spec = self.spec
        if spec.shared_cores is None:
            return
        running = [r for r in self.prefill_pool + self.decode_pool + self.retired if r.step is not None]
        demand = sum(r.threads + r.borrowed for r in running) + spec.serving_cores_per_stream * self.streaming
        speed = min(1.0, spec.shared_cores / demand) if demand > 0 else 1.0
        for replica in running:
            step = replica.step
            step.left -= (self.now - step.since) * step.speed
            step.since, step.speed = self.now, speed
            step.version = version = next(self.counter)     # unique: no other step's old end matches
            self.at(self.now + max(0.0, step.left) / speed,
                    lambda r=replica, v=version: self._shared_step_done(r, v))

    def _shared_step_done(self, replica: SimReplica, version: int) -> None:
        step = replica.step
        if step is None or step.version != version:
            return            # the sharing changed since this end was scheduled
        replica.step = None
        seconds = self.now - step.started
        replica.stretch_sum += seconds / step.model_seconds if step.model_seconds > 0 else 1.0
        self._step_done(replica, step.work, step.shape, seconds)
        self._share_cores()

    def _step_done(self, replica: SimReplica, work, shape: StepShape, seconds: float) -> None:
        replica.busy = False
        replica.finish_step(work, self.now)
        replica.costs.observe(shape.decode_seqs, shape.prefill_tokens, seconds, borrowed_cores=replica.borrowed > 0)
        if self.autoscaler is not None:
            self.autoscaler.on_step(replica, shape, seconds)
        if not replica.has_work:
            replica.borrowed = 0      # idle: gives back what it borrowed
        if self.awaiting_decode and replica in self.decode_pool:
            self._admit_awaiting()
        self._kick(replica)
        self._retire_if_done(replica)


@dataclass
class _SharedStep:
    """A step running on shared cores: `left` model-seconds of it remain as of `since`,
    run at `speed` (a fraction of its own); `version` names its one live end event."""
    work: object
    shape: StepShape
    model_seconds: float
    started: float
    left: float
    since: float = 0.0
    speed: float = 1.0
    version: int = -1

    def __post_init__(self) -> None:
        self.since = self.started


def lent_step_time(model: StepTimeModel, wide_model: StepTimeModel, shape: StepShape, *, own_threads: int,
                   threads: int, cores: int) -> float:
    """A step's time with `threads` (own plus borrowed) where `model` runs it with
    `own_threads` and `wide_model` with `cores`: interpolated linearly in 1 / threads."""
    own = model.step_time(shape)
    if threads <= own_threads or cores <= own_threads:
        return own
    share = (1 / own_threads - 1 / min(threads, cores)) / (1 / own_threads - 1 / cores)
    return own + (wide_model.step_time(shape) - own) * share


def _prefill_time(model: StepTimeModel, tokens: int) -> float:
    return model.step_time(StepShape.build([(0, tokens)])) if tokens > 0 else 0.0
