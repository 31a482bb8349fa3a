"""The goodput autoscaling policy driving a simulated cluster: every interval
it sees what the live policy would (arrivals, lengths, latency percentiles,
queues, replicas running and starting, measured steps), and its targets
change the pools: a replica scaled down drains (cluster_sim.py) and holds its
devices until it has finished what it runs; a replica asked for is placed
once the budget's devices have room for it (as Serve places a replica only
where its resources are free: on a cluster of exactly the budget, a re-split
starts the new replica when the one it replaces has drained), holds its
devices from then on, and serves `startup_s` later.
"""

from __future__ import annotations

from collections import Counter

from cluster.autoscaler.policy import (
    GoodputPolicy,
    Observation,
    RoleObservation,
    StepSample,
    p90,
    refusal_role,
)


class SimAutoscaler:
    def __init__(self, policy: GoodputPolicy):
        self.policy = policy
        self.settings = policy.settings
        self.timeline: list[dict] = []
        self._sim = None
        self._arrived = 0                      # cursors into the simulation's logs
        self._finished = 0
        self._refused = 0
        self._last_latencies: list = []        # (TTFT, TPOT) of the requests that finished in the last window
        self._starting: dict[str, int] = {r: 0 for r in self.settings.roles}     # placed, starting up
        self._asked: list[str] = []             # roles of replicas asked for, not placed yet (oldest first)
        self._deciding = False                  # in _tick: a replica retiring meanwhile places nothing yet
        self._steps: dict[str, list[StepSample]] = {r: [] for r in self.settings.roles}

    def attach(self, sim) -> None:
        self._sim = sim
        sim.at(self.settings.interval_s, self._tick)

    def on_retire(self) -> None:
        """A drained replica left its pool: its devices are free (placed after the
        decision under way, if any, which may cancel what was asked before)."""
        if not self._deciding:
            self._place()

    def on_step(self, replica, shape, seconds: float) -> None:
        role = self._sim.role_of(replica)
        self._steps[role].append(StepSample(shape, seconds, warm=replica.num_steps > self.settings.warmup_steps,
                                            threads=replica.threads + replica.borrowed,
                                            borrowed_threads=replica.borrowed))

    # ---- one interval -----------------------------------------------------------------------
    def _tick(self) -> None:
        sim, s = self._sim, self.settings
        obs = self._observe()
        running = {r: obs.roles[r].running for r in s.roles}       # before this decision
        decision = self.policy.decide(obs)
        self._deciding = True
        for role, target in decision.targets.items():
            live = [r for r in sim.pool(role) if not r.draining]
            change = target - len(live) - self._starting[role] - self._asked.count(role)
            self._asked += [role] * max(0, change)
            for _ in range(max(0, -change)):
                if role in self._asked:           # not placed yet: nothing to drain
                    del self._asked[len(self._asked) - 1 - self._asked[::-1].index(role)]
                elif live:                        # (replicas still starting are not stopped)
                    victim = min(live, key=lambda r: (len(r.running) + len(r.waiting), -r.started_at))
                    live.remove(victim)
                    sim.drain_replica(victim)
        self._deciding = False
        self._place()
        self.timeline.append({
            "time_s": sim.now, "rate": obs.arrivals / obs.window_s, "predicted_rate": decision.predicted_rate,
            "targets": dict(decision.targets),
            "running": running,
            "refused": dict(obs.refused),
            "attainment": _attainment(self._last_latencies, s.ttft_slo_s, s.tpot_slo_s),
            "reason": decision.describe()})
        if sim.unfinished:
            sim.at(sim.now + s.interval_s, self._tick)

    def _place(self) -> None:
        """Starts the replicas asked for, oldest first, each one the budget's devices
        (those of every replica running, draining or starting) have room for: one
        that does not fit yet holds back none that does (Serve places each
        deployment's replicas on their own)."""
        sim, s = self._sim, self.settings
        used = sum((len(sim.pool(r)) + self._starting[r]) * s.tp(r) for r in s.roles)
        waiting = []
        for role in self._asked:
            if used + s.tp(role) > s.budget:
                waiting.append(role)
                continue
            used += s.tp(role)
            self._starting[role] += 1
            sim.at(sim.now + s.startup_s, lambda role=role, placed=sim.now: self._ready(role, placed))
        self._asked = waiting

    def _ready(self, role: str, placed: float) -> None:
        self._starting[role] -= 1
        self._sim.add_replica(role).started_at = placed

    def _observe(self) -> Observation:
        sim, s = self._sim, self.settings
        arrived = sim.arrived[self._arrived:]
        finished = sim.finished[self._finished:]
        refused = Counter(refusal_role(s.mode, log.refused.reason) for log in sim.refused[self._refused:])
        self._arrived, self._finished, self._refused = len(sim.arrived), len(sim.finished), len(sim.refused)
        # (TTFT, TPOT or None below two tokens) of each request that finished in the window
        self._last_latencies = [(r.token_times[0] - r.send_time,
                                 (r.end_time - r.token_times[0]) / (len(r.token_times) - 1)
                                 if len(r.token_times) > 1 else None) for r in finished]
        ttfts = [(r.token_times[0], r.token_times[0] - r.send_time) for r in finished]   # (first token, TTFT)
        tpot_samples = [(r.token_times[0], tpot) for r, (_, tpot) in zip(finished, self._last_latencies)
                        if tpot is not None]                                             # (first token, TPOT)
        tpots = [tpot for _, tpot in tpot_samples]
        roles = {}
        for role in s.roles:
            live = [r for r in sim.pool(role) if not r.draining]
            waiting = sum(len(r.waiting) for r in live)
            if role == "decode":
                waiting += len(sim.awaiting_decode)
            roles[role] = RoleObservation(running=len(live), starting=self._starting[role] + self._asked.count(role),
                                          waiting_requests=float(waiting), steps=self._steps[role])
            self._steps[role] = []
        return Observation(
            now=sim.now, window_s=s.interval_s, arrivals=len(arrived),
            mean_prompt_tokens=sum(r.prompt_len for r in arrived) / len(arrived) if arrived else None,
            mean_output_tokens=_mean([len(r.token_times) for r in finished]),
            mean_squared_output_tokens=_mean([len(r.token_times) ** 2 for r in finished]),
            # a simulated request generates its output_len, its max_tokens (run past any EOS, as load tests do)
            finished=len(finished), finished_by_length=len(finished),
            mean_max_tokens=sum(r.output_len for r in arrived) / len(arrived) if arrived else None,
            mean_inflight_output_tokens=_mean([len(r.token_times) for r in sim.logs
                                               if r.send_time is not None and r.end_time is None]),
            ttft_p90_s=p90([ttft for _, ttft in ttfts]), tpot_p90_s=p90(tpots), ttft_samples=ttfts,
            tpot_samples=tpot_samples, roles=roles, refused=dict(refused))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _attainment(latencies: list[tuple[float, float | None]], ttft_slo_s: float, tpot_slo_s: float) -> float | None:
    """The share of the interval's finished requests (their (TTFT, TPOT)) that met both SLOs."""
    if not latencies:
        return None
    ok = sum(ttft <= ttft_slo_s and (tpot or 0.0) <= tpot_slo_s for ttft, tpot in latencies)
    return ok / len(latencies)
