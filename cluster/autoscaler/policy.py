"""The goodput autoscaling policy: once per interval, replicas per role from
the predicted load, the performance model and what the live system reports.
A plain class (no Ray): Serve's application policy (cluster/autoscaler/
serve_policy.py) and the simulator (cluster/simulator/autoscaling.py) feed it
the same Observation.

Per interval:
1. The request rate (arrivals over the window, the ones admission control
   refused included) goes into the load predictor; prompt and output lengths
   into running means. The output length is learnt from finished requests,
   raised early by the running ones (their tokens so far) and, where nearly
   every request runs to its max_tokens (`length_finish_share` of those
   finishing; load tests, fixed answer budgets), by the arrivals' max_tokens:
   a shift to longer outputs then shows as the requests arrive, where
   finished requests show it tens of seconds later. A shorter max_tokens
   lowers it only through the requests that finish. The demand is the rate
   predicted one start-up horizon ahead (a replica asked for now serves
   then), plus what the queues need to drain within that horizon.
2. Each role's step model is corrected by the steps its warm replicas measured
   (OnlineCorrection); a replica's first steps (warming up) are left out.
3. One replica's capacity at the SLOs (cluster/autoscaler/capacity.py) gives
   the replicas each role needs: ceil(demand / capacity). When those exceed
   the budget (in ranks: replicas times TP), the split that maximises the
   smaller of the two pools' capacities is taken instead (the goodput of a
   disaggregated pipeline is its narrower stage), if it serves `split_margin`
   more than the current split (no see-saw between two near-equal splits),
   or serves more at all and gives a replica to a role seen short (4).
4. What is observed outranks the model: a TTFT p90 over the SLO adds a
   prefill (or colocated) replica, a TPOT p90 over it a decode replica, when
   the model alone would not; so do admission control's refusals on a role's
   account past `refusal_pressure` of the last `pressure_window_s`'s
   arrivals (a refused request misses its SLO and never shows in the latency);
   not while the replica last asked for the role is starting or in its first
   interval serving, and refusals from before it served count no more.
5. Guards, per role: min/max and the budget; replicas still starting count as
   capacity already coming; scaling up waits `upscale_cooldown_s` after the
   last scale-up, scaling down `downscale_cooldown_s` after any change of the
   role (the pools as deployed count as one, except for a re-split towards a
   role whose finished requests miss its SLO: then the split deployed is
   shown wrong), goes
   one replica at a time, never while one of the role is starting; and unless
   the budget needs the replica elsewhere, only when requests finished in the
   interval with the role's latency (TTFT for prefill, TPOT for decode) at
   most `downscale_headroom` of its SLO, and the remaining replicas are
   predicted to hold the load with `downscale_headroom` to spare (Dynamo's
   N-1 rule) in every interval of the last `downscale_window_s`: the most
   replicas any of them needed, as Kubernetes' stabilisation window takes the
   highest recommendation over the window (and Ray Serve delays a
   downscale), so a lull shorter than the window, or a capacity estimate that
   jumps for an interval, does not give back a replica that takes a start-up
   to return; the pools as deployed count in the window too (the first
   intervals' rates rest on a few arrivals). When another role needs the
   rank, the latest interval is enough, at the replicas' capacity (which the
   SLOs already bound) without the headroom: a re-split does not wait.

On a CPU machine whose one-rank replicas lend idle cores to each other
(`lend_idle_cores`, and the machine's cores given as `shared_cores`), a decode
pool's capacity counts the prefill replicas' idle cores it borrows, at the
speed-up its own borrowed steps showed (cluster/autoscaler/lending.py): a
split whose one decode replica runs on the cores of idle prefill replicas is
not re-split for a second decode replica that would add no compute. There one
role takes a rank from another only when it is seen short, not on the model's
figures alone: its observed latency past `slo_headroom` of its SLO, or
admission control refusing more than `refusal_pressure` of what arrives on its
account over the last `pressure_window_s` (refused requests never show in the
latency, so under overload the refusals are the pressure). That holds for a
load past the budget too (step 3's best split).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from cluster.autoscaler.capacity import (
    ReplicaLimits,
    colocated_capacity,
    decode_capacity,
    decode_shape,
    prefill_capacity,
    prefill_seconds,
)
from cluster.autoscaler.lending import LentCoreSpeedup, ScaledStepModel, decode_threads
from cluster.autoscaler.load_predictor import LoadPredictor
from cluster.perf_model.online import OnlineCorrection
from cluster.perf_model.step_shape import StepShape, StepTimeModel

DISAGGREGATED_ROLES = ("prefill", "decode")
COLOCATED_ROLES = ("colocated",)


@dataclass(frozen=True)
class AutoscaleSettings:
    ttft_slo_s: float
    tpot_slo_s: float
    mode: str = "disaggregated"               # "disaggregated" | "colocated"
    min_replicas: dict[str, int] = field(default_factory=dict)    # per role; default 1
    max_replicas: dict[str, int] = field(default_factory=dict)    # per role; default: the budget
    tensor_parallel: dict[str, int] = field(default_factory=dict)  # ranks per replica; default 1
    budget: int = 8                           # ranks (GPUs, or CPU ranks) all roles may use together
    interval_s: float = 10.0
    startup_s: float = 30.0                   # from asking for a replica to its first request
    upscale_cooldown_s: float = 0.0
    downscale_cooldown_s: float = 60.0
    downscale_window_s: float = 120.0         # a scale-down must hold every interval of this window
    ttft_percentile: float = 0.9              # the share of TTFTs a prefill replica's capacity holds within the SLO
    slo_headroom: float = 0.8                 # the model's mean decode step is held to this share of the TPOT SLO
    downscale_headroom: float = 0.8           # N-1 replicas must hold the load at this share of capacity
    split_margin: float = 0.2                 # at the budget, a new split must serve this much more
    predictor: str = "ewma"
    warmup_steps: int = 20                    # a replica's first steps are left out of the correction
    correct_models: bool = True               # scale the step models by the steps replicas measure
    lend_idle_cores: bool = False             # CPU: one-rank replicas lend idle cores to each other
    refusal_pressure: float = 0.1             # on shared cores: refusals (share of arrivals) that show a role short
    pressure_window_s: float = 30.0           # ... over this window
    length_finish_share: float = 0.9          # finished requests running to max_tokens past this share: the
                                              # arrivals' max_tokens is their output length (> 1: never)

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("the TTFT and TPOT SLOs must be > 0")
        if self.interval_s <= 0 or self.startup_s < 0 or self.downscale_window_s < 0:
            raise ValueError("interval_s must be > 0, startup_s and downscale_window_s >= 0")
        if not 0 < self.slo_headroom <= 1 or not 0 < self.downscale_headroom <= 1:
            raise ValueError("slo_headroom and downscale_headroom must be in (0, 1]")
        if not 0 < self.ttft_percentile < 1:
            raise ValueError("ttft_percentile must be in (0, 1)")
        if not 0 <= self.refusal_pressure <= 1 or self.pressure_window_s <= 0:
            raise ValueError("refusal_pressure must be in [0, 1] and pressure_window_s > 0")
        if self.length_finish_share <= 0:
            raise ValueError("length_finish_share must be > 0 (above 1: max_tokens is never taken as the length)")
        floor = sum(self.min_for(r) * self.tp(r) for r in self.roles)
        if floor > self.budget:
            raise ValueError(f"the minimum replicas need {floor} ranks, more than the budget of {self.budget}: "
                             "raise the budget (autoscaling.budget; pdserve serve --max-replicas N) or lower "
                             "autoscaling.min_replicas")
        for role in self.roles:
            if self.max_for(role) < self.min_for(role):
                raise ValueError(f"{role}: max_replicas {self.max_for(role)} < min_replicas {self.min_for(role)}")

    @property
    def roles(self) -> tuple[str, ...]:
        return DISAGGREGATED_ROLES if self.mode == "disaggregated" else COLOCATED_ROLES

    def tp(self, role: str) -> int:
        return self.tensor_parallel.get(role, 1)

    def min_for(self, role: str) -> int:
        return self.min_replicas.get(role, 1)

    def max_for(self, role: str) -> int:
        return self.max_replicas.get(role, self.budget // self.tp(role))

    def can_move(self) -> bool:
        """Whether any split but the minimum one fits the bounds and the budget: one more
        replica of some role on top of the minimums (in time linear in the roles, whatever
        the budget)."""
        floor = sum(self.min_for(r) * self.tp(r) for r in self.roles)
        return any(self.min_for(r) < self.max_for(r) and floor + self.tp(r) <= self.budget for r in self.roles)


@dataclass(frozen=True)
class StepSample:
    """One engine step a replica measured."""
    shape: StepShape
    seconds: float
    warm: bool = True                 # False for a replica's first steps (warm-up): kept out of every fit
    threads: int = 1                  # torch threads it ran with (CPU)
    borrowed_threads: int = 0         # of which on cores borrowed from idle replicas (not the replica's own)

    @property
    def fits_own_cores(self) -> bool:
        """A warm step on the replica's own cores: what its step model is fitted and corrected to."""
        return self.warm and self.borrowed_threads == 0


@dataclass
class RoleObservation:
    running: int                                   # replicas serving
    starting: int = 0                              # asked for, not serving yet
    waiting_requests: float = 0.0                  # queued on this role's replicas
    steps: list[StepSample] = field(default_factory=list)


@dataclass
class Observation:
    now: float                                     # seconds, any monotonic origin
    window_s: float                                # what the counts below cover
    arrivals: int
    mean_prompt_tokens: float | None = None        # of the window's arrivals
    mean_output_tokens: float | None = None        # of the window's finished requests ...
    mean_squared_output_tokens: float | None = None    # ... and the mean of their squares
    finished: int = 0                              # requests that finished in the window (stop or length) ...
    finished_by_length: int = 0                    # ... of which ran to their max_tokens
    mean_max_tokens: float | None = None           # of the window's arrivals: the most tokens each may generate
    mean_inflight_output_tokens: float | None = None   # generated so far by the running ones
    ttft_p90_s: float | None = None                # of the window's finished requests ...
    tpot_p90_s: float | None = None
    # ... their (first-token time, TTFT), where known: evidence about a pool counts only from
    # first tokens after the replica it last asked for served
    ttft_samples: list[tuple[float, float]] | None = None
    # ... and their (first-token time, TPOT), the same way: a request decodes from its first token on
    tpot_samples: list[tuple[float, float]] | None = None
    roles: dict[str, RoleObservation] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)   # of the arrivals, refused on each role's account


def refusal_role(mode: str, reason: str) -> str:
    """The role a refusal of admission control (router/admission.py's reasons)
    counts against: the decode pool for the TPOT bound, the prefill pool for
    the others; a colocated pool for all."""
    if mode == "colocated":
        return "colocated"
    return "decode" if reason == "tpot_slo" else "prefill"


@dataclass(frozen=True)
class Decision:
    targets: dict[str, int]
    reasons: dict[str, str]                        # per role: why it moved, or why it held
    predicted_rate: float
    capacity: dict[str, float]                     # requests/s one replica sustains, per role
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None

    def changed(self, current: dict[str, int]) -> bool:
        return any(self.targets[r] != current.get(r) for r in self.targets)

    def describe(self) -> str:
        return "; ".join(f"{role} -> {n} ({self.reasons[role]})" for role, n in self.targets.items())


class GoodputPolicy:
    def __init__(self, settings: AutoscaleSettings, models: dict[str, StepTimeModel],
                 limits: dict[str, ReplicaLimits] | None = None, *, shared_cores: float | None = None):
        """`models`: a step-time model per role (a colocated deployment: "colocated").
        `shared_cores`: the machine's cores where every replica runs on one machine
        and `settings.lend_idle_cores`; None: ranks with cores or devices of their own."""
        missing = [r for r in settings.roles if r not in models]
        if missing:
            raise ValueError(f"no step-time model for {', '.join(missing)}")
        self.settings = settings
        self.models = {r: OnlineCorrection(models[r]) for r in settings.roles}
        self.limits = {r: (limits or {}).get(r, ReplicaLimits()) for r in settings.roles}
        self.predictor = LoadPredictor(settings.predictor)
        self.prompt_tokens: float | None = None
        self.output_tokens: float | None = None
        self.length_bias: float | None = None     # E[L^2] / E[L]^2 of finished output lengths L (smoothed)
        self.length_share: float | None = None    # of finished requests, the share that ran to max_tokens (smoothed)
        self.last_up: dict[str, float] = {}
        self.last_change: dict[str, float] = {}
        self.last_starting: dict[str, float] = {}   # role -> the latest interval a replica of it was starting
        self.first_seen: float | None = None     # the pools as deployed
        self.recent_holding: deque[tuple[float, dict[str, int]]] = deque()   # (time, replicas to hold per role)
        lends = settings.lend_idle_cores and settings.mode == "disaggregated" and settings.tp("decode") == 1
        self.shared_cores = shared_cores if lends and shared_cores else None
        self.lent_speedup = LentCoreSpeedup()
        self.recent_refusals: deque[tuple[float, int, dict[str, int]]] = deque()   # (time, arrivals, refused)
        self.own_threads = {r: 1 for r in settings.roles}     # per rank, as the replicas' steps report

    # ---- one interval ---------------------------------------------------------------------
    def decide(self, obs: Observation) -> Decision:
        s = self.settings
        self._learn(obs)
        current = {r: obs.roles[r].running + obs.roles[r].starting if r in obs.roles else s.min_for(r)
                   for r in s.roles}
        horizon = s.startup_s / s.interval_s
        rate = self.predictor.predict(horizon)
        capacity = self._capacities()
        if self.prompt_tokens is None:        # nothing has arrived yet: hold (within the bounds)
            held = {r: max(s.min_for(r), min(s.max_for(r), current[r])) for r in s.roles}
            return Decision(held, {r: "no traffic seen yet" for r in s.roles}, rate, capacity)
        if self.first_seen is None:
            # the pools as deployed count as a change from when traffic first came (however long the
            # deployment sat idle before) ...
            self.first_seen = obs.now
            if s.downscale_window_s > 0:
                # ... and as what the downscale window held so far: the first intervals' rates are a
                # few arrivals each, too few to give back a replica on (a re-split still may)
                self.recent_holding.append((obs.now, dict(current)))
        drain_s = max(s.startup_s, s.interval_s)
        demand = {r: rate + (obs.roles[r].waiting_requests / drain_s if r in obs.roles else 0.0) for r in s.roles}
        # one replica's capacity in the pools as they are (a decode replica's with the cores lent it)
        each = {r: self._pool_capacity(r, current, capacity, demand) / current[r] if current[r] else capacity[r]
                for r in s.roles}
        needed = {r: self._replicas_needed(r, current, capacity, demand) for r in s.roles}
        reasons = {r: f"needs {needed[r]} for {demand[r]:.2f} req/s at {each[r]:.2f} req/s each" +
                   (f" (at most {s.max_for(r)})" if needed[r] > s.max_for(r) else "") for r in s.roles}
        # a role never gets more than its max_replicas: what it cannot take binds no budget
        needed = {r: min(needed[r], s.max_for(r)) for r in s.roles}
        budget_bound = self._ranks(needed) > s.budget
        if budget_bound:
            needed = self._split_within_budget(obs, current, capacity, demand, reasons)
            self._hold_budget_split(obs, current, needed, reasons)
        else:
            self._hold_near_split(obs, current, capacity, demand, needed, reasons)
        self._latency_feedback(obs, current, needed, reasons)
        # what holds this interval's load: the model's count with headroom, or more where observed
        # latency asked for more (a replica added for a missed SLO is not given back next interval)
        holding = {r: max(needed[r], self._replicas_needed(r, current, capacity, demand, s.downscale_headroom))
                   for r in s.roles}
        window_holding = self._window_holding(obs.now, holding)
        targets = self._guarded(obs, current, needed, holding, window_holding, reasons, budget_bound)
        for r in s.roles:
            if targets[r] > current[r]:
                self.last_up[r] = obs.now
            if targets[r] != current[r]:
                self.last_change[r] = obs.now
        ttft, tpot = self._predicted_latency(rate, targets)
        return Decision(targets, reasons, rate, each, ttft, tpot)

    # ---- inputs -----------------------------------------------------------------------
    def _learn(self, obs: Observation) -> None:
        for role, ro in obs.roles.items():
            if ro.starting:
                self.last_starting[role] = obs.now
        if obs.arrivals or self.prompt_tokens is not None:   # an idle start is no rate of 0 to predict from
            self.predictor.observe(obs.arrivals / obs.window_s if obs.window_s > 0 else 0.0)
        self.recent_refusals.append((obs.now, obs.arrivals, dict(obs.refused)))
        while self.recent_refusals[0][0] <= obs.now - self.settings.pressure_window_s:
            self.recent_refusals.popleft()
        if obs.mean_prompt_tokens is not None:
            self.prompt_tokens = _smooth(self.prompt_tokens, obs.mean_prompt_tokens)
        if obs.mean_output_tokens is not None:
            self.output_tokens = _smooth(self.output_tokens, obs.mean_output_tokens)
            if obs.mean_squared_output_tokens is not None and obs.mean_output_tokens > 0:
                self.length_bias = _smooth(self.length_bias,
                                           obs.mean_squared_output_tokens / obs.mean_output_tokens ** 2)
        if obs.finished:
            self.length_share = _smooth(self.length_share, obs.finished_by_length / obs.finished)
        if self.length_share is not None and self.length_share >= self.settings.length_finish_share and \
                obs.mean_max_tokens is not None and obs.mean_max_tokens > (self.output_tokens or 0):
            # the requests run to their max_tokens (a benchmark, a fixed budget per answer): the arrivals'
            # limits are their output lengths, known as they arrive, where finished requests show longer
            # outputs only once the new requests end (a 1k-token answer takes tens of seconds). Upwards
            # only: lowered at once, it moved ranks away from decode while the longer requests already
            # running still held the pool (bench/autoscale.py, README)
            self.output_tokens = obs.mean_max_tokens
        elif obs.mean_inflight_output_tokens is not None and \
                obs.mean_inflight_output_tokens / (self.length_bias or 1.0) > (self.output_tokens or 0):
            # outputs got longer: the running requests show it before any of them finishes. A
            # request runs as long as its output, so long ones are over-represented among the
            # running by E[L^2] / E[L]^2 of the lengths (1 for one length; ~4 for 90% of 20
            # tokens and 10% of 2,000): their output so far, divided by that, is a lower bound
            # of the mean where one length runs (half of it, part-way through)
            self.output_tokens = obs.mean_inflight_output_tokens / (self.length_bias or 1.0)
        for role, ro in obs.roles.items():
            model = self.models.get(role)
            for sample in ro.steps:
                if model is None or not sample.warm:
                    continue
                own = max(1, sample.threads - sample.borrowed_threads)
                self.own_threads[role] = own
                if sample.fits_own_cores:
                    if self.settings.correct_models:
                        model.observe(sample.shape, sample.seconds)
                elif role == "decode" and self.shared_cores is not None:
                    # faster than the replica's own cores: how much, not the model itself
                    predicted = model.step_time(sample.shape)
                    if predicted > 0:
                        self.lent_speedup.observe(own, sample.threads, sample.seconds / predicted)

    def _capacities(self) -> dict[str, float]:
        """Requests/s one replica of each role sustains on its own cores."""
        s = self.settings
        prompt = self.prompt_tokens or 1.0
        output = self.output_tokens or 1.0
        ttft, tpot = s.ttft_slo_s, s.tpot_slo_s * s.slo_headroom
        if s.mode == "colocated":
            return {"colocated": colocated_capacity(self.models["colocated"], prompt, output, ttft, tpot,
                                                    self.limits["colocated"], s.ttft_percentile)}
        return {"prefill": prefill_capacity(self.models["prefill"], prompt, ttft, s.ttft_percentile),
                "decode": self._decode_capacity(self.models["decode"])}

    def _decode_capacity(self, model: StepTimeModel) -> float:
        """Requests/s one decode replica whose steps take `model`'s times sustains."""
        s = self.settings
        return decode_capacity(model, self.prompt_tokens or 1.0, self.output_tokens or 1.0,
                               s.tpot_slo_s * s.slo_headroom, self.limits["decode"])

    def _lent_factor(self, replicas: dict[str, int], prefill_rate: float) -> float:
        """A decode step's time in split `replicas` over its time on the replica's
        own cores (1.0 where no cores are lent)."""
        if self.shared_cores is None or replicas.get("decode", 0) < 1:
            return 1.0
        p = replicas.get("prefill", 0)
        busy = prefill_rate * prefill_seconds(self.models["prefill"], self.prompt_tokens or 1.0) / max(1, p)
        threads = decode_threads(self.shared_cores, p, replicas["decode"], busy,
                                 self.own_threads["prefill"], self.own_threads["decode"])
        return self.lent_speedup.factor(self.own_threads["decode"], threads)

    def _pool_capacity(self, role: str, replicas: dict[str, int], capacity: dict[str, float],
                       demand: dict[str, float]) -> float:
        """Requests/s the `role` pool of split `replicas` sustains: its replicas times
        `capacity` (one replica on its own cores), a decode pool on lent cores more."""
        n = replicas.get(role, 0)
        factor = self._lent_factor(replicas, demand.get("prefill", 0.0)) if role == "decode" else 1.0
        if n == 0 or factor >= 1.0:
            return n * capacity[role]
        return n * self._decode_capacity(ScaledStepModel(self.models["decode"], factor))

    def _replicas_needed(self, role: str, current: dict[str, int], capacity: dict[str, float],
                         demand: dict[str, float], share: float = 1.0) -> int:
        """Replicas of `role` that serve its demand at `share` of their capacity,
        the other roles as they are now."""
        if demand[role] <= 0 or self.shared_cores is None or role != "decode":
            return _replicas_for(demand[role], capacity[role] * share)
        split = dict(current)
        for n in range(1, self.settings.max_for(role) + 1):
            split[role] = n
            if self._pool_capacity(role, split, capacity, demand) * share >= demand[role] - 1e-9:
                return n
        return max(self.settings.max_for(role) + 1, _replicas_for(demand[role], capacity[role] * share))

    def _window_holding(self, now: float, holding: dict[str, int]) -> dict[str, int]:
        """Per role, the most replicas any interval of the last `downscale_window_s`
        (this one included) needed to hold its demand with `downscale_headroom` to spare."""
        self.recent_holding.append((now, holding))
        while self.recent_holding and self.recent_holding[0][0] < now - self.settings.downscale_window_s:
            self.recent_holding.popleft()
        return {r: max(h.get(r, 0) for _, h in self.recent_holding) for r in holding}

    # ---- sizing -----------------------------------------------------------------------
    def _ranks(self, replicas: dict[str, int]) -> int:
        return sum(n * self.settings.tp(r) for r, n in replicas.items())

    def _best_split(self, capacity: dict[str, float], demand: dict[str, float]) -> dict[str, int]:
        """Within the budget: the prefill/decode split whose narrower pool is
        widest (ties: fewer ranks). Colocated: as many replicas as fit."""
        s = self.settings
        if s.mode == "colocated":
            return {"colocated": min(s.max_for("colocated"), s.budget // s.tp("colocated"))}
        best, best_key = None, None
        for p in range(s.min_for("prefill"), s.max_for("prefill") + 1):
            left = s.budget - p * s.tp("prefill")
            d = min(s.max_for("decode"), left // s.tp("decode"))
            if d < s.min_for("decode"):
                break
            split = {"prefill": p, "decode": d}
            key = (self._served(split, capacity, demand), -(p * s.tp("prefill") + d * s.tp("decode")))
            if best_key is None or key > best_key:
                best, best_key = split, key
        return best

    def _split_within_budget(self, obs: Observation, current: dict[str, int], capacity: dict[str, float],
                             demand: dict[str, float], reasons: dict[str, str]) -> dict[str, int]:
        """Past the budget: the best split, if it serves `split_margin` more than
        the current one (or the current one is over the budget), or serves more at
        all and gives a replica more to a role seen short (_seen_short: what the
        model rates as a near tie is not one where that role misses its SLO or
        has its requests refused); else the current."""
        s = self.settings
        best = self._best_split(capacity, demand)
        served, now_served = self._served(best, capacity, demand), self._served(current, capacity, demand)
        short = [r for r in s.roles if best[r] > current[r] and self._seen_short(obs, r)]
        # a split that only adds replicas, in ranks the budget still has, is no re-split to weigh
        grows_only = all(best[r] >= current[r] for r in s.roles)
        if served > now_served * (1 + s.split_margin) or self._ranks(current) > s.budget or \
                ((short or grows_only) and served > now_served):
            for r in s.roles:
                reasons[r] = f"budget of {s.budget} ranks: best split gives {best[r]}" + \
                    (f" ({self._seen(obs, r)})" if r in short else "")
            return best
        for r in s.roles:
            reasons[r] = (f"holds {current[r]}: within the budget of {s.budget} ranks no split serves "
                          f"{s.split_margin:.0%} more than this one")
        return dict(current)

    def _hold_near_split(self, obs: Observation, current: dict[str, int], capacity: dict[str, float],
                         demand: dict[str, float], needed: dict[str, int], reasons: dict[str, str]) -> None:
        """On a machine whose replicas lend cores: at the budget a role gets a replica
        more only by another role giving up a rank (a re-split, and a start-up
        without either replica), which adds little compute where the cores are
        shared anyway; not for a predicted demand within `split_margin` of what
        the role's pool serves now, nor while the role is not seen short
        (_seen_short: latency or refusals): the model's rating of a replica on
        shared, lent cores is the least certain of its figures (live, it rated
        one lent decode replica at ~2.2-2.6 req/s of 256-token outputs that
        served 2.9 within the SLOs), so only what the role is seen to lack moves
        a rank there (the observed-latency rule still adds one where the SLO is
        missed). With a device per rank the move is taken at once (applied
        there, the hold cost the simulated 70B runs 1% of goodput on two of five
        seeds)."""
        s = self.settings
        if self.shared_cores is None:
            return
        for r in s.roles:
            if needed[r] <= current[r] or self._ranks(current) + s.tp(r) <= s.budget:
                continue
            served = self._pool_capacity(r, current, capacity, demand)
            if demand[r] <= served * (1 + s.split_margin):
                needed[r] = current[r]
                reasons[r] = (f"holds {current[r]}: {demand[r]:.2f} req/s is within {s.split_margin:.0%} of the "
                              f"{served:.2f} req/s they serve, not worth a re-split")
            elif not self._seen_short(obs, r):
                needed[r] = current[r]
                reasons[r] = (f"holds {current[r]}: {self._seen(obs, r)}; on shared cores a re-split for the "
                              f"model's {demand[r]:.2f} > {served:.2f} req/s moves no compute")

    def _hold_budget_split(self, obs: Observation, current: dict[str, int], needed: dict[str, int],
                           reasons: dict[str, str]) -> None:
        """On a machine whose replicas lend cores, past the budget: the best split
        by the model is taken only when a role it gives a rank more is seen short
        (_seen_short), as within the budget (_hold_near_split). Measured live on
        2 shared cores: a budget-bound re-split to 1 prefill + 2 decode at the
        end of a long-output phase that one decode replica served within its
        SLOs cost the next phases a quarter of a burst (x0.91 of static 2P+1D)."""
        s = self.settings
        if self.shared_cores is None:
            return
        gaining = [r for r in s.roles if needed[r] > current[r]]
        if not gaining or any(self._seen_short(obs, r) for r in gaining):
            return
        for r in s.roles:
            if r in gaining:
                reasons[r] = (f"holds {current[r]}: {self._seen(obs, r)}; on shared cores the model's best "
                              f"split past the budget is taken only for a role seen short")
            elif needed[r] != current[r]:
                reasons[r] = (f"holds {current[r]}: the best split past the budget gives {', '.join(gaining)} "
                              f"a rank, not seen short")
            needed[r] = current[r]

    def _seen_short(self, obs: Observation, role: str) -> bool:
        """Whether `role`'s observed latency p90 is past `slo_headroom` of its SLO, or
        admission control refused more than `refusal_pressure` of the arrivals of
        the last `pressure_window_s` on its account."""
        observed = self._observed_for(obs, role)
        if observed is not None and observed[0] > self.settings.slo_headroom * observed[1]:
            return True
        return self._refused_share(role) > self.settings.refusal_pressure

    def _seen(self, obs: Observation, role: str) -> str:
        observed = self._observed_for(obs, role)
        latency = "no latency observed yet" if observed is None else \
            f"observed p90 {observed[0] * 1000:.0f} ms is within {self.settings.slo_headroom:.0%} of the SLO"
        return f"{latency}, {self._refused_share(role):.0%} refused on its account"

    def _coming(self, obs: Observation, role: str) -> bool:
        """Whether a replica asked for `role` is starting, or has served less than an
        interval (so no finished request shows it yet)."""
        ro = obs.roles.get(role)
        if ro is not None and ro.starting:
            return True
        return obs.now < self._serving_since(role) + self.settings.interval_s

    def _serving_since(self, role: str) -> float:
        """When the replica `role` last asked for served, at the earliest: a start-up
        after it was asked for, or the latest interval it was still seen starting
        (a replica slower to start than `startup_s`)."""
        return max(self.last_up.get(role, -math.inf) + self.settings.startup_s,
                   self.last_starting.get(role, -math.inf))

    def _refused_share(self, role: str) -> float:
        """Of the last `pressure_window_s`'s arrivals, the share refused on `role`'s
        account, counted from when the replica it last asked for served (refusals
        before that are what it was asked for)."""
        since = self._serving_since(role)
        recent = [(a, r) for t, a, r in self.recent_refusals if t > since]
        arrivals = sum(a for a, _ in recent)
        refused = sum(r.get(role, 0) for _, r in recent)
        return refused / arrivals if arrivals else 0.0

    def _served(self, replicas: dict[str, int], capacity: dict[str, float], demand: dict[str, float]) -> float:
        """Requests/s a split serves: its narrower pool's capacity."""
        return min(self._pool_capacity(r, replicas, capacity, demand) for r in self.settings.roles)

    def _latency_feedback(self, obs: Observation, current: dict[str, int], needed: dict[str, int],
                          reasons: dict[str, str]) -> None:
        """A replica more for a role whose observed latency misses its SLO or whose
        requests admission control refuses, unless the replica it last asked for
        has not served an interval yet: the evidence predates it (and adding one
        per interval meanwhile would overshoot)."""
        s = self.settings
        prefill_role = "prefill" if s.mode == "disaggregated" else "colocated"
        decode_role = "decode" if s.mode == "disaggregated" else "colocated"
        checks = (("ttft", self._ttft_p90(obs, prefill_role), s.ttft_slo_s, prefill_role),
                  ("tpot", self._tpot_p90(obs, decode_role), s.tpot_slo_s, decode_role))
        for name, observed, slo, role in checks:
            if observed is None or observed <= slo or needed[role] > current[role] or self._coming(obs, role):
                continue
            needed[role] = current[role] + 1
            reasons[role] = f"observed {name.upper()} p90 {observed * 1000:.0f} ms > SLO {slo * 1000:.0f} ms"
        # a refused request missed its SLO as surely as a late one, and never shows in the latency
        for role in s.roles:
            refused = self._refused_share(role)
            if refused <= s.refusal_pressure or needed[role] > current[role] or self._coming(obs, role):
                continue
            needed[role] = current[role] + 1
            reasons[role] = (f"admission control refused {refused:.0%} of the last {s.pressure_window_s:.0f} s's "
                             f"arrivals on its account")

    def _guarded(self, obs: Observation, current: dict[str, int], needed: dict[str, int],
                 holding: dict[str, int], window_holding: dict[str, int], reasons: dict[str, str],
                 budget_bound: bool) -> dict[str, int]:
        """`holding`: per role, the replicas that hold this interval's demand with
        downscale_headroom to spare; `window_holding`: the most of those over the
        downscale window, which a scale-down must keep unless another role needs
        the rank (then this interval's is enough: a re-split does not wait)."""
        s = self.settings
        targets = dict(current)
        # downs first, so that their ranks count for the ups of the same interval
        for r in s.roles:
            want = max(s.min_for(r), min(s.max_for(r), needed[r]))
            if want >= current[r]:
                continue
            resplit = self._rank_wanted_elsewhere(r, obs.now, current, needed)
            give = self._replicas_to_give(r, obs.now, targets, current, needed) if resplit else 1
            # a re-split's giver need only serve the load at its capacity (which the SLOs already bound),
            # not with the headroom of a plain scale-down: the rank serves the role that is short
            keep = needed[r] if resplit else window_holding[r]
            # the pools as deployed count as a change (no scale-down right away: the first rates and step
            # fits rest on a few arrivals and steps), but not against a re-split for a role whose finished
            # requests already miss its SLO
            confirmed = resplit and any(self._missing_slo(obs, o) for o in s.roles
                                        if o != r and self._can_grow(o, obs.now, current, needed))
            changed = self.last_change.get(r, -math.inf if confirmed else self.first_seen)
            ro = obs.roles.get(r)
            latency = self._observed_for(obs, r)
            if ro is not None and ro.starting:
                reasons[r] = f"holds {current[r]}: a replica is still starting"
            elif obs.now - changed < s.downscale_cooldown_s:
                reasons[r] = f"holds {current[r]}: scale-down cool-down"
            elif not budget_bound and latency is None and not _idle(obs):
                reasons[r] = f"holds {current[r]}: no request finished this interval to confirm the SLOs hold"
            elif not budget_bound and latency is not None and latency[0] > latency[1] * s.downscale_headroom:
                reasons[r] = (f"holds {current[r]}: observed p90 {latency[0] * 1000:.0f} ms is within "
                              f"{1 - s.downscale_headroom:.0%} of the SLO")
            elif not budget_bound and keep > current[r] - 1:
                when = "now" if resplit or keep == holding[r] else f"within the last {s.downscale_window_s:.0f} s"
                reasons[r] = (f"holds {current[r]}: {current[r] - 1} would not hold the load {when} "
                              f"with {1 - s.downscale_headroom:.0%} to spare")
            elif give > current[r] - want:
                # the rank alone would not make room for a replica of the role that needs it (a larger TP)
                reasons[r] = (f"holds {current[r]}: a replica another role needs takes {give} of its replicas' "
                              f"ranks, and it may give up {current[r] - want}")
            else:
                targets[r] = current[r] - give
                reasons[r] = f"scale down by {'one' if give == 1 else give}: " + reasons[r]
        for r in s.roles:
            want = max(s.min_for(r), min(s.max_for(r), needed[r]))
            if want <= current[r]:
                continue
            if obs.now - self.last_up.get(r, -math.inf) < s.upscale_cooldown_s:
                reasons[r] = f"holds {current[r]}: scale-up cool-down"
                continue
            room = (s.budget - self._ranks(targets)) // s.tp(r)
            if room <= 0:
                reasons[r] = f"holds {current[r]}: the budget of {s.budget} ranks is in use"
                continue
            targets[r] = current[r] + min(room, want - current[r])
            reasons[r] = "scale up: " + reasons[r]
        return targets

    def _replicas_to_give(self, role: str, now: float, targets: dict[str, int], current: dict[str, int],
                          needed: dict[str, int]) -> int:
        """How many of `role`'s replicas free the ranks for one more replica of a role
        that needs one and can take it (the one that takes the fewest), beside `targets`
        as they stand."""
        s = self.settings
        short = min(self._ranks(targets) + s.tp(o) - s.budget for o in s.roles
                    if o != role and self._can_grow(o, now, current, needed))
        return max(1, math.ceil(short / s.tp(role)))

    def _rank_wanted_elsewhere(self, role: str, now: float, current: dict[str, int],
                               needed: dict[str, int]) -> bool:
        """Whether another role needs a replica, and can take it this interval, that the
        budget has no room for unless `role` gives one up."""
        s = self.settings
        return any(self._can_grow(o, now, current, needed) and self._ranks(current) + s.tp(o) > s.budget
                   for o in s.roles if o != role)

    def _can_grow(self, role: str, now: float, current: dict[str, int], needed: dict[str, int]) -> bool:
        """Whether `role` needs a replica more and may take one now: under its
        max_replicas and past its scale-up cool-down (a rank given up for a role that
        cannot take it would serve nobody)."""
        s = self.settings
        return min(needed[role], s.max_for(role)) > current[role] and \
            now - self.last_up.get(role, -math.inf) >= s.upscale_cooldown_s

    def _missing_slo(self, obs: Observation, role: str) -> bool:
        """Whether the latency `role` answers for is observed past its SLO (p90)."""
        observed = self._observed_for(obs, role)
        return observed is not None and observed[0] > observed[1]

    def _observed_for(self, obs: Observation, role: str) -> tuple[float, float] | None:
        """(observed p90, SLO) of the latency `role` answers for: TTFT for prefill,
        TPOT for decode, the worse ratio of the two for colocated."""
        s = self.settings
        ttft, tpot = self._ttft_p90(obs, role), self._tpot_p90(obs, role)
        pairs = {"prefill": [(ttft, s.ttft_slo_s)], "decode": [(tpot, s.tpot_slo_s)],
                 "colocated": [(ttft, s.ttft_slo_s), (tpot, s.tpot_slo_s)]}[role]
        pairs = [(v, slo) for v, slo in pairs if v is not None]
        return max(pairs, key=lambda p: p[0] / p[1]) if pairs else None

    def _ttft_p90(self, obs: Observation, role: str) -> float | None:
        """The p90 TTFT of the window's finished requests whose first token came after
        the replica `role` last asked for served: a request ends long after its
        first token (a 1k-token answer, tens of seconds), and one that waited
        before that replica served says nothing about the pool with it (counted,
        it asked for one more replica again)."""
        return self._p90_since_served(obs.ttft_samples, obs.ttft_p90_s, role)

    def _tpot_p90(self, obs: Observation, role: str) -> float | None:
        """The p90 TPOT of the window's finished requests that began decoding (their
        first token) after the replica `role` last asked for served: a 1k-token
        answer that decoded mostly on the pool before it says nothing about the
        pool with it (counted, it asked for a decode replica more again)."""
        return self._p90_since_served(obs.tpot_samples, obs.tpot_p90_s, role)

    def _p90_since_served(self, samples: list[tuple[float, float]] | None, p90_all: float | None,
                          role: str) -> float | None:
        """p90 of the (first-token time, latency) samples whose first token came after the
        replica `role` last asked for served; `p90_all` where no samples are given."""
        if samples is None:
            return p90_all
        since = self._serving_since(role)
        return p90([latency for first_token, latency in samples if first_token > since])

    def _predicted_latency(self, rate: float, targets: dict[str, int]) -> tuple[float | None, float | None]:
        """Mean TTFT (M/D/1 on the prefill pool) and TPOT (the decode step at the
        pool's share of the concurrency) the targets are predicted to give."""
        s = self.settings
        prompt, output = self.prompt_tokens, self.output_tokens or 1.0
        if prompt is None or rate <= 0:
            return None, None
        prefill_role = "prefill" if s.mode == "disaggregated" else "colocated"
        decode_role = "decode" if s.mode == "disaggregated" else "colocated"
        service = self.models[prefill_role].step_time(StepShape.build([(0, max(1, round(prompt)))]))
        rho = rate * service / max(1, targets[prefill_role])
        ttft = math.inf if rho >= 1 else service + rho * service / (2 * (1 - rho))
        context = prompt + output / 2
        most = self.limits[decode_role].max_num_seqs
        decode_model = ScaledStepModel(self.models[decode_role], self._lent_factor(targets, rate))
        batch, tpot = 1, 0.0
        for _ in range(50):       # fixed point: concurrency = rate * output * tpot (Little's law)
            tpot = decode_model.step_time(decode_shape(batch, context))
            new = min(most, max(1, math.ceil(rate * output * tpot / max(1, targets[decode_role]))))
            if new == batch:
                break
            batch = new
        return ttft, tpot


def _idle(obs: Observation) -> bool:
    """Nothing arrived this interval, nothing runs and nothing waits: no latency to
    confirm a scale-down with, and none needed (the downscale window and the
    cool-down still pace it)."""
    return obs.arrivals == 0 and obs.mean_inflight_output_tokens is None and \
        not any(ro.waiting_requests for ro in obs.roles.values())


def p90(values: list[float]) -> float | None:
    """The 90th percentile (nearest rank: the smallest value at least 90% of them are
    at or under) of `values`, None for none."""
    if not values:
        return None
    values = sorted(values)
    return values[max(0, math.ceil(0.9 * len(values) - 1e-9) - 1)]


def _replicas_for(demand: float, capacity: float) -> int:
    if demand <= 0:
        return 0
    if capacity <= 0:
        return 1 << 20          # the SLO cannot be met: as many as allowed
    return math.ceil(demand / capacity - 1e-9)


def _smooth(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else old + weight * (new - old)
