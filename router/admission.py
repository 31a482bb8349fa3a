"""Admission control: the router refuses work it cannot serve in time, at
once, instead of queueing it without bound.

A request is waiting from its admission until its first token (or its end).
The router bounds what waits: `max_waiting_requests` requests and
`max_waiting_prompt_tokens` prompt tokens. With a TTFT SLO it also predicts
each request's time to first token,

    TTFT = (prompt tokens waiting / prefill replicas + this prompt) x prefill s/token

with the per-token cost the workers measure on their own steps (prompts that
decode replicas prefill, under conditional disaggregation, are priced on their
wait there and count neither here nor in the overload rule's arrivals), and refuses
it when that exceeds `slo_factor` x the SLO while a prompt waits ahead of it in the
prefill pool (alone there, it is admitted: its own prefill is the best this server can do).
When prompts arrive faster than the prefill replicas serve them (over the
last `overload_window_s` or the last few arrivals, refused ones included),
queueing more cannot raise throughput, only every admitted request's TTFT: then a request is admitted
only while what still waits ahead of it (the queued prompts' prefill, less
what the prompts at its head have had since they started) takes at most
`overload_wait_factor` x its own prefill. The next prompt then reaches a
replica about when the one before it is done: the replicas stay busy and
admitted TTFT stays near its unloaded value instead of climbing to the SLO.
With a TPOT SLO it admits a request only while the decode replicas'
predicted step time, with it, stays within `tpot_headroom` of the SLO:

    step = fixed + (running x s/sequence + prefill tokens per step x s/token) / decode replicas

with the costs each decode replica fits on its own steps (engine/step_cost.py),
the slowest replica's step: a replica's figures are kept together, never one
replica's fixed cost beside another's per-sequence cost. A replica that has
only run one batch size has no fit, only its step over one more sequence than
it ran (17 ms a sequence for a lone 70B decode whose fixed cost is 34 ms: two
sequences are priced at the step it has seen, so it gets to run two and fit
its costs); it is priced so only while no replica of the pool has a fit, or it
would price a pool of fitted replicas as if every sequence cost a whole step.
Where the decode replicas prefill too (colocated), every running request
brings its prompt onto their steps once over the steps it decodes: it counts
prompt / expected output tokens per step, so that a request is priced with
the prefill it will cause, not the prefill steps carried a while ago. Past
that bound every admitted request would miss TPOT. A refusal is a 429 with
`Retry-After`: the predicted time for what waits now to drain (1 s to a
minute: a retry is asked again, not promised). The checks
that need no prompt length run before the prompt is tokenized.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from engine.step_cost import StepCost
from router.errors import OpenAIError


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    max_waiting_requests: int | None = 1024
    max_waiting_prompt_tokens: int | None = 1 << 18
    ttft_slo_s: float | None = None
    slo_factor: float = 1.0
    tpot_slo_s: float | None = None
    tpot_headroom: float = 0.8          # decode steps are held to this share of the TPOT SLO
    overload_wait_factor: float | None = 0.25  # with a TTFT SLO, in overload: wait <= this x own prefill
    overload_window_s: float = 5.0      # arrivals over this long decide whether prompts outpace prefill


# (latest arrivals, factor): their rate past `factor` x what the prefill replicas serve is
# overload too. Each factor is the one that Poisson arrivals at exactly the capacity pass
# 5% of the time (the 5% quantile of the gamma distribution of n - 1 gaps): fewer arrivals
# see a burst sooner and need a higher factor to tell it from chance. A load under the
# capacity passes them less often still (at 0.75x, 0.4-3% of arrivals each), and a request
# is refused then only if a prompt it would wait behind is far from done.
BURST_RULES = ((3, 5.6), (4, 3.7), (8, 2.1), (16, 1.6))


@dataclass(frozen=True, slots=True)
class Admitted:
    """What admission control counts for one admitted request until it ends."""

    prompt_tokens: int
    prefill_tokens_per_step: float   # its prompt over the decode steps it is expected to run (colocated)
    local: bool = False              # a decode replica prefills it: no wait in the prefill pool's queue


# a client told to wait longer on an estimate from a few steps' costs would wait for nothing
# when load falls; one that retries sooner is told again, for the price of a refusal
MAX_RETRY_AFTER_S = 60
# a refusal's retry is taken for one this long after it (the longest Retry-After, and the client's backoff)
RETRY_MATCH_S = MAX_RETRY_AFTER_S + 15


class Overloaded(OpenAIError):
    """429 with the seconds after which a retry is predicted to be admitted (1 to MAX_RETRY_AFTER_S)."""

    def __init__(self, message: str, reason: str, retry_after_s: float):
        super().__init__(429, message, type="rate_limit_error", code="server_overloaded")
        self.reason = reason
        self.retry_after_s = min(MAX_RETRY_AFTER_S, max(1, math.ceil(retry_after_s)))

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class AdmissionControl:
    def __init__(self, settings: AdmissionSettings, *, prefill_roles: tuple[str, ...] = ("prefill", "colocated"),
                 prefill_on_decode_steps: bool = False, clock: Callable[[], float] = time.monotonic,
                 local_prefill: Callable[[int], tuple[float, float] | None] | None = None):
        """prefill_on_decode_steps: the decode replicas prefill every prompt in their
        own steps (a colocated deployment). local_prefill (conditional disaggregation,
        DisaggregationPolicy.local_prefill_s): for a prompt of n tokens that a decode
        replica would prefill, the predicted wait there and its own prefill, which its
        TTFT is judged on instead of the prefill pool's queue; None for one that goes
        to the prefill pool."""
        self.settings = settings
        self.local_prefill = local_prefill
        self.prefill_roles = prefill_roles
        self.prefill_on_decode_steps = prefill_on_decode_steps
        self.clock = clock
        self._arrivals: deque[float] = deque()       # arrival times within overload_window_s, refused ones too
        self._first_arrival: float | None = None
        self._unretried_refusals: deque[float] = deque()   # refusals within RETRY_MATCH_S no retry followed yet
        self.mean_prompt_tokens: float | None = None  # of the requests checked with their prompt, running mean
        self.waiting_requests = 0
        self.waiting_tokens = 0
        self.waiting_prompts = 0     # of the waiting requests, those that bring a prompt (not n's later choices)
        self.waiting_local_tokens = 0    # of waiting_tokens, those a decode replica prefills (Admitted.local)
        self.waiting_local_prompts = 0
        self._head_since: float | None = None        # when the prompts at the queue's head started (about)
        self.replicas = 1
        self.s_per_token: float | None = None      # the prefill replicas' measured cost, mean
        self.running = 0                           # admitted and not ended
        self.prefill_tokens_per_step = 0.0         # the running requests' Admitted.prefill_tokens_per_step, sum
        self.mean_output_tokens: float | None = None   # of the requests that ended, running mean
        self.decode_replicas = 1
        self.decode_costs: list[StepCost] = []   # the decode replicas' that priced steps (module doc)

    # ---- the checks ---------------------------------------------------------------------------
    def check_before_tokenizing(self, counted: bool = True) -> float | None:
        """Counts the request's arrival and returns its time (for `withdraw`; None where
        not `counted`: a client's retry of a refusal (takes_retry), counted when first
        offered, would count a refused request twice or three times as demand); raises
        Overloaded when the queue alone is past a bound or the SLO."""
        s = self.settings
        now = self.clock()
        if self._first_arrival is None:
            self._first_arrival = now
        if counted:
            self._arrivals.append(now)
        while self._arrivals and self._arrivals[0] < now - s.overload_window_s:
            self._arrivals.popleft()
        if s.max_waiting_requests is not None and self.waiting_requests >= s.max_waiting_requests:
            raise self._refuse("queue_requests", f"{self.waiting_requests} requests are waiting for their first "
                               f"token, the most this server queues ({s.max_waiting_requests})")
        if s.max_waiting_prompt_tokens is not None and self.waiting_tokens >= s.max_waiting_prompt_tokens:
            raise self._refuse("queue_tokens", f"{self.waiting_tokens} prompt tokens are waiting, the most this "
                               f"server queues ({s.max_waiting_prompt_tokens})")
        self._check_slo(0, self._prefilled_locally(0))
        self._check_tpot(self._prefill_tokens_per_step(self.mean_prompt_tokens or 0.0, max_tokens=None))
        return now if counted else None

    def takes_retry(self) -> bool:
        """For a request that says it is a client's retry (a header any client can
        send): whether a refusal of the last RETRY_MATCH_S, not yet retried, accounts
        for it; that refusal is then taken. Where none does, the request is new demand,
        and counts as an arrival whatever it says."""
        self._forget_old_refusals(self.clock())
        if not self._unretried_refusals:
            return False
        self._unretried_refusals.popleft()
        return True

    def _forget_old_refusals(self, now: float) -> None:
        while self._unretried_refusals and self._unretried_refusals[0] < now - RETRY_MATCH_S:
            self._unretried_refusals.popleft()

    def withdraw(self, arrival: float) -> None:
        """The request that arrived at `arrival` (check_before_tokenizing's) turned out
        invalid: a client's 400s are no demand on the prefill replicas."""
        try:
            self._arrivals.remove(arrival)
        except ValueError:
            pass        # past the window already

    def predicted_step_s(self, extra_prefill_tokens_per_step: float = 0.0, extra_seqs: int = 0) -> float | None:
        """A decode replica's step time with what runs now and `extra_seqs` more
        requests bringing `extra_prefill_tokens_per_step` (None: no cost measured yet)."""
        if not self.decode_costs:
            return None
        seqs = (self.running + extra_seqs) / self.decode_replicas
        tokens = (self.prefill_tokens_per_step + extra_prefill_tokens_per_step) / self.decode_replicas
        return max(c.step_s(seqs, tokens, carried=not self.prefill_on_decode_steps) for c in self.decode_costs)

    def admit(self, num_prompt_tokens: int, max_tokens: int | None = None, arrival: float | None = None) -> Admitted:
        """Checks the request with its prompt length and output bound, then counts it
        as waiting and running. Raises Overloaded (and counts nothing) when it must
        be refused. arrival: check_before_tokenizing's, withdrawn from the prefill
        pool's arrivals if a decode replica prefills the prompt."""
        s = self.settings
        if s.max_waiting_prompt_tokens is not None and \
                self.waiting_tokens + num_prompt_tokens > s.max_waiting_prompt_tokens and self.waiting_requests:
            raise self._refuse("queue_tokens", f"{self.waiting_tokens} prompt tokens are waiting and this prompt "
                               f"has {num_prompt_tokens}; this server queues at most {s.max_waiting_prompt_tokens}")
        local = self._observe_prompt(num_prompt_tokens)
        self._check_slo(num_prompt_tokens, local)
        ticket = Admitted(num_prompt_tokens, self._prefill_tokens_per_step(num_prompt_tokens, max_tokens),
                          local=local is not None)
        self._check_tpot(ticket.prefill_tokens_per_step)
        self._count(ticket)
        if ticket.local and arrival is not None:
            self.withdraw(arrival)
        return ticket

    def admit_choices(self, num_prompt_tokens: int, max_tokens: int | None, choices: int) -> list[Admitted]:
        """admit() for a request of `choices` choices of one prompt, all or none: the
        prompt is checked and counted once (the choices after the first read it from the
        prefix cache), each choice is a sequence that waits for its first token and runs.
        Raises Overloaded (and counts nothing) when any must be refused. The TPOT bound's
        exemption (a decode replica without a request) is judged on what ran before this
        request: an idle server admits all its choices, however many (checked one by one,
        the later ones were refused behind the first, on every retry)."""
        self._check_request_bound(choices)
        running_before = self.running
        tickets = [self.admit(num_prompt_tokens, max_tokens)]
        try:
            for _ in range(choices - 1):
                sibling = Admitted(0, 0.0)
                self._check_tpot(sibling.prefill_tokens_per_step, running_before)
                self._count(sibling)
                tickets.append(sibling)
        except Overloaded:
            for ticket in tickets:
                self._uncount(ticket)
            raise
        return tickets

    def admit_prompts(self, prompts: list[tuple[int, int | None]], choices: int,
                      arrival: float | None = None) -> list[list[Admitted]]:
        """admit_choices for a batch of prompts (each its prompt tokens and max_tokens),
        all or none, judged as one request: its first prompt as admit_choices checks it,
        the others behind it against the bounds judged on what was there before the
        batch (the queue's prompt tokens, unless nothing waited; the TPOT budget, unless
        a decode replica ran nothing), not on the TTFT SLO, which their place behind the
        batch's own first prompt would fail on an idle server too (every retry alike).
        Raises Overloaded (and counts nothing) when any must be refused. arrival: as
        admit's, withdrawn if decode replicas prefill every prompt."""
        s = self.settings
        self._check_request_bound(len(prompts) * choices)
        waiting_before, running_before = self.waiting_requests, self.running
        admitted = [self.admit_choices(*prompts[0], choices)]
        try:
            for num_prompt_tokens, max_tokens in prompts[1:]:
                if s.max_waiting_prompt_tokens is not None and waiting_before and \
                        self.waiting_tokens + num_prompt_tokens > s.max_waiting_prompt_tokens:
                    raise self._refuse("queue_tokens", f"{self.waiting_tokens} prompt tokens are waiting with "
                                       f"this batch's first {len(admitted)} prompts; this server queues at most "
                                       f"{s.max_waiting_prompt_tokens}")
                local = self._observe_prompt(num_prompt_tokens) is not None
                tickets: list[Admitted] = []
                admitted.append(tickets)
                for ticket in [Admitted(num_prompt_tokens, self._prefill_tokens_per_step(num_prompt_tokens, max_tokens),
                                        local=local),
                               *(Admitted(0, 0.0) for _ in range(choices - 1))]:
                    self._check_tpot(ticket.prefill_tokens_per_step, running_before)
                    self._count(ticket)
                    tickets.append(ticket)
        except Overloaded:
            for ticket in (t for tickets in admitted for t in tickets):
                self._uncount(ticket)
            raise
        if arrival is not None and all(tickets[0].local for tickets in admitted):
            self.withdraw(arrival)
        return admitted

    def _check_request_bound(self, sequences: int) -> None:
        """A request of several sequences (n's choices, a batch's prompts) is held to
        max_waiting_requests whole, unless nothing waits (as the token bound)."""
        bound = self.settings.max_waiting_requests
        if bound is not None and self.waiting_requests and self.waiting_requests + sequences > bound:
            raise self._refuse("queue_requests", f"{self.waiting_requests} requests are waiting for their first "
                               f"token and this one brings {sequences}; this server queues at most {bound}")

    @property
    def waiting_pool_prompts(self) -> int:
        """Of the waiting requests, the prompts the prefill pool's queue holds (not
        n's later choices, not prompts a decode replica prefills)."""
        return self.waiting_prompts - self.waiting_local_prompts

    @staticmethod
    def _in_pool(ticket: Admitted) -> bool:
        """Whether the ticket's prompt waits in the prefill pool's queue."""
        return ticket.prompt_tokens > 0 and not ticket.local

    def _count(self, ticket: Admitted) -> None:
        if self._in_pool(ticket) and not self.waiting_pool_prompts:
            self._head_since = self.clock()
        self.waiting_requests += 1
        self._count_waiting(ticket, +1)
        self.running += 1
        self.prefill_tokens_per_step += ticket.prefill_tokens_per_step

    def _count_waiting(self, ticket: Admitted, sign: int) -> None:
        """Adds (sign +1) or removes (-1) the ticket's prompt in the waiting counts."""
        prompts = int(ticket.prompt_tokens > 0)
        self.waiting_tokens = max(0, self.waiting_tokens + sign * ticket.prompt_tokens)
        self.waiting_prompts = max(0, self.waiting_prompts + sign * prompts)
        if ticket.local:
            self.waiting_local_tokens = max(0, self.waiting_local_tokens + sign * ticket.prompt_tokens)
            self.waiting_local_prompts = max(0, self.waiting_local_prompts + sign * prompts)

    def _uncount(self, ticket: Admitted) -> None:
        """Undoes _count for a request refused after all (the head of the queue keeps its progress)."""
        self.waiting_requests = max(0, self.waiting_requests - 1)
        self._count_waiting(ticket, -1)
        self.running = max(0, self.running - 1)
        self.prefill_tokens_per_step = max(0.0, self.prefill_tokens_per_step - ticket.prefill_tokens_per_step) \
            if self.running else 0.0
        if not self.waiting_pool_prompts:
            self._head_since = None

    def first_token(self, ticket: Admitted) -> None:
        """An admitted request got its first token, or ended without one (once per request).
        Only a prompt of the prefill pool's queue moves its head: a locally prefilled
        prompt's or a later choice's first token says nothing of the pool's progress."""
        self.waiting_requests = max(0, self.waiting_requests - 1)
        self._count_waiting(ticket, -1)
        if self._in_pool(ticket) or not self.waiting_pool_prompts:
            self._head_since = self.clock() if self.waiting_pool_prompts else None

    def finished(self, ticket: Admitted, output_tokens: int | None = None) -> None:
        """An admitted request ended (however; output_tokens when it ran to its end)."""
        self.running = max(0, self.running - 1)
        self.prefill_tokens_per_step = max(0.0, self.prefill_tokens_per_step - ticket.prefill_tokens_per_step) \
            if self.running else 0.0
        if output_tokens:
            self.mean_output_tokens = _running_mean(self.mean_output_tokens, output_tokens)

    def _observe_prompt(self, num_prompt_tokens: int) -> tuple[float, float] | None:
        """Where an arriving prompt goes (_prefilled_locally's answer); one for the
        prefill pool joins its mean prompt (its capacity, its queue's heads)."""
        local = self._prefilled_locally(num_prompt_tokens)
        if local is None:
            self.mean_prompt_tokens = _running_mean(self.mean_prompt_tokens, num_prompt_tokens)
        return local

    def _prefilled_locally(self, num_prompt_tokens: int) -> tuple[float, float] | None:
        """The local_prefill hook's answer: (wait, own prefill) where a decode replica
        would prefill a prompt of this length, else None."""
        return self.local_prefill(num_prompt_tokens) if self.local_prefill is not None else None

    def _prefill_tokens_per_step(self, prompt_tokens: float, max_tokens: int | None) -> float:
        """A request's prompt spread over the decode steps it is expected to run
        (min(max_tokens, the mean output), whichever is known), where the decode
        replicas prefill it; 0 elsewhere, and while neither is known."""
        known = [n for n in (max_tokens, self.mean_output_tokens) if n]
        if not self.prefill_on_decode_steps or not known:
            return 0.0
        return prompt_tokens / min(known)

    # ---- predictions --------------------------------------------------------------------------
    def predicted_wait_s(self) -> float:
        """Until what waits in the prefill replicas' queue now has had its first token
        (0 before any cost is measured): its prompts' prefill, less what the prompts
        at the head of the queue have had since they started (since the latest first
        token, or their admission into an empty queue; at most a mean prompt's
        prefill each; n's later choices bring no prompt and are no head). Prompts
        that decode replicas prefill (Admitted.local) wait there, not here."""
        if not self.s_per_token or not self.waiting_requests:
            return 0.0
        work = (self.waiting_tokens - self.waiting_local_tokens) * self.s_per_token
        heads = min(self.replicas, self.waiting_pool_prompts)
        per_head = (self.mean_prompt_tokens or 0.0) * self.s_per_token
        done = heads * min(self.clock() - self._head_since, per_head) if self._head_since is not None else 0.0
        return max(0.0, work - done) / self.replicas

    def predicted_ttft_s(self, num_prompt_tokens: int) -> float:
        return self.predicted_wait_s() + num_prompt_tokens * (self.s_per_token or 0.0)

    def overloaded(self) -> bool:
        """Whether prompt tokens arrive faster than the prefill replicas serve them (at
        their measured cost): at the arrival rate over the last overload_window_s, or
        over the latest few arrivals (BURST_RULES). The second sees a burst that
        starts after a quiet spell within 3 arrivals when it is several times the
        capacity, within 16 when it is 1.6x, where the window's rate would be
        diluted by the quiet part for seconds."""
        if not self.s_per_token or not self.mean_prompt_tokens or not self._arrivals:
            return False
        now = self.clock()
        capacity = self.replicas / (self.mean_prompt_tokens * self.s_per_token)    # requests/s
        window, seen = self.settings.overload_window_s, now - self._first_arrival
        if seen >= window / 2 and len(self._arrivals) / min(window, seen) > capacity:
            return True             # (less history cannot tell a rate from the first few arrivals)
        for count, factor in BURST_RULES:
            if len(self._arrivals) >= count:
                span = now - self._arrivals[-count]
                if span <= 0 or (count - 1) / span > factor * capacity:
                    return True     # (no time between them, as a simulated burst: an unbounded rate)
        return False

    def observe_workers(self, role: str, stats: Iterable[Mapping[str, float]], replicas: int | None = None) -> None:
        """The latest stats of the replicas of `role` that answered (of `replicas` running;
        default: as many as answered): prefill costs from the prefill roles, decode
        costs from the decode ones (decode, colocated)."""
        stats = list(stats)
        replicas = max(1, len(stats) if replicas is None else replicas)
        if role in ("decode", "colocated"):
            self.decode_replicas = replicas
            fitted = [s for s in stats if "decode_s_per_seq" in s and "decode_step_fixed_s" in s]
            costs = fitted or [s for s in stats if "decode_s_per_seq" in s]
            if costs:
                self.decode_costs = [StepCost.from_stats(s) for s in costs]
        if role not in self.prefill_roles:
            return
        self.replicas = replicas
        costs = [s["prefill_s_per_token"] for s in stats if "prefill_s_per_token" in s]
        if costs:
            self.s_per_token = sum(costs) / len(costs)

    def _check_slo(self, num_prompt_tokens: int, local: tuple[float, float] | None) -> None:
        """(0 prompt tokens: before tokenizing, where a short prompt goes; the prompt's
        own check follows. local: the local_prefill hook's answer for the prompt)"""
        s = self.settings
        if s.ttft_slo_s is None:
            return
        limit = s.ttft_slo_s * s.slo_factor
        if local is not None:
            # a decode replica prefills it: the prefill pool's queue and arrivals are not its wait
            wait, own = local
            misses = wait + own > limit and wait > 0
            if misses and num_prompt_tokens:
                raise self._refuse("ttft_slo", f"its predicted time to first token is {(wait + own) * 1000:.0f} "
                                   f"ms, past the {limit * 1000:.0f} ms this server admits", wait)
            if not misses:
                return
            # before tokenizing, where the decode replicas are behind: a longer prompt would go to the
            # prefill pool, so the request is refused only where that would miss too (below)
        if self.s_per_token is None:
            return
        predicted = self.predicted_ttft_s(num_prompt_tokens)
        # With no prompt waiting ahead in the prefill pool the prediction is this prompt's own
        # prefill: no later retry does better, and refusing would also keep the cost estimate
        # from ever being measured again (one inflated figure would refuse every request for
        # good). Prompts a decode replica prefills, and n's later choices, wait elsewhere.
        if predicted > limit and self.waiting_pool_prompts:
            raise self._refuse("ttft_slo", f"its predicted time to first token is {predicted * 1000:.0f} ms, past "
                               f"the {limit * 1000:.0f} ms this server admits")
        if s.overload_wait_factor is None or not self.overloaded():
            return
        own = (num_prompt_tokens or self.mean_prompt_tokens or 0.0) * self.s_per_token
        wait = self.predicted_wait_s()
        if wait > s.overload_wait_factor * own:
            raise self._refuse("overload", f"prompts are arriving faster than this server prefills them, and "
                               f"{wait * 1000:.0f} ms of prompts wait ahead of this one; it admits a request "
                               f"only while at most {s.overload_wait_factor:g}x its own prefill "
                               f"({own * 1000:.0f} ms) waits ahead")

    def _check_tpot(self, prefill_tokens_per_step: float, running: int | None = None) -> None:
        """Refuses a request that would push the decode steps past the TPOT budget, while
        every decode replica has at least one request (`running`, default: all that run
        now; so that a load past the budget still drains, one request per replica at a time)."""
        s = self.settings
        if s.tpot_slo_s is None or (self.running if running is None else running) < self.decode_replicas:
            return
        step = self.predicted_step_s(prefill_tokens_per_step, extra_seqs=1)
        budget = s.tpot_slo_s * s.tpot_headroom
        if step is not None and step > budget:
            raise self._refuse("tpot_slo", f"{self.running} requests are running and with this one a decode step "
                               f"is predicted to take {step * 1000:.0f} ms, past {s.tpot_headroom:.0%} of the "
                               f"{s.tpot_slo_s * 1000:.0f} ms TPOT SLO", self._decode_slot_s(step))

    def _decode_slot_s(self, step_s: float) -> float:
        """About when a running request ends on every decode replica (a slot for one
        more each): a request runs the mean output's steps, and the running ones end
        spread over that time. The prefill queue's wait where no output was seen."""
        if not self.mean_output_tokens or not self.running:
            return self.predicted_wait_s()
        per_replica = self.running / self.decode_replicas
        return self.mean_output_tokens * step_s / per_replica

    def _refuse(self, reason: str, why: str, retry_after_s: float | None = None) -> Overloaded:
        """The 429 to raise; the refusal is remembered for the client's retry (takes_retry)."""
        now = self.clock()
        self._forget_old_refusals(now)
        self._unretried_refusals.append(now)
        return Overloaded(f"The server is overloaded: {why}. Retry after the Retry-After header's seconds.",
                          reason, self.predicted_wait_s() if retry_after_s is None else retry_after_s)


def admission_for(settings: AdmissionSettings | None, mode: str, policy=None,
                  clock: Callable[[], float] = time.monotonic) -> AdmissionControl | None:
    """The router's admission control for a deployment of `mode` ("colocated" or
    "disaggregated"; None where `settings` is None: off). `policy`: the router's
    DisaggregationPolicy, whose locally prefilled prompts are priced on the decode side."""
    if settings is None:
        return None
    return AdmissionControl(settings, prefill_on_decode_steps=mode == "colocated", clock=clock,
                            local_prefill=policy.local_prefill_s if policy is not None else None)


def _running_mean(old: float | None, new: float, weight: float = 0.05) -> float:
    """An exponentially weighted mean: `new` alone at first, then `weight` of each new value."""
    return new if old is None else (1 - weight) * old + weight * new
