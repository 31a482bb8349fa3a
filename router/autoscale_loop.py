"""The autoscaler's live side, in the router: every interval it gathers what the
policy needs (the requests the router saw, the steps the workers measured,
the replicas answering), runs cluster/autoscaler/policy.py, logs the decision
with its reasons, exports it to /metrics, and holds the targets for Serve.

Serve applies them: the router reports `target_<role>` through
`record_autoscaling_stats`, and the application's autoscaling policy
(cluster/autoscaler/serve_policy.py) copies them to the worker deployments.
The heavy work stays here, out of Serve's 0.1 s control loop.

Step-time model per role: the profile given (`autoscaling.profile`),
corrected online by the measured steps; without one, a linear model fitted to
the workers' own recent steps (the policy holds until one is fitted). Engine
limits per role: the deployment's max_num_seqs and block size, and the KV
blocks of the role's smallest replica, as its workers report them.

Replicas starting: what Serve was asked for (at the first interval, the
replicas Serve keeps, which a router that restarted finds where the autoscaler
had moved them; then each decision) less those answering. Replicas counted as
starting for longer than `start_deadline_s` never will (a gang Serve cannot
place, a constructor that keeps failing): they are counted out, with a warning,
and the policy decides again on what runs. An interval's counts (arrivals, refusals,
ended requests) are taken at its start, before the workers are asked for
their steps, so a slow answer does not stretch one interval's rate into the
next one's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from cluster.autoscaler.capacity import ReplicaLimits
from cluster.autoscaler.policy import (
    AutoscaleSettings,
    GoodputPolicy,
    Observation,
    RoleObservation,
    StepSample,
    p90,
    refusal_role,
)
from cluster.perf_model.linear_model import LinearStepModel
from cluster.perf_model.online import OnlineCorrection
from cluster.perf_model.step_shape import StepShape, StepTimeModel
from engine.cpu_count import usable_cpus
from router.serve_pools import replica_answers
from router.timings import RequestTimings

log = logging.getLogger(__name__)   # through Serve's handlers (cluster/serving/replica_logging.py)

FIT_WINDOW = 400          # recent steps a learned model is fitted to, per role
STEP_SAMPLES_TIMEOUT_S = 5.0    # a replica's answer with its steps, before it counts as slow this interval
MIN_FIT_STEPS = 12
# a replica still starting after this long (or 10 x autoscaling.startup_s, if longer) never will
START_DEADLINE_S = 600.0
# Serve's controller's answer to what it keeps, at the first interval (a stuck one must not stop the loop; a
# controller restarting with the router can take a while)
SERVE_STATUS_TIMEOUT_S = 30.0


def serve_replica_counts(workers: dict) -> dict[str, int]:
    """role -> replicas Serve keeps for that role's deployment (every state but stopping):
    those running and those it is starting or placing. Blocks on Serve's controller."""
    import ray
    from ray import serve
    if not ray.is_initialized():    # (serve.status would start a cluster)
        raise RuntimeError("not connected to Ray")
    status = serve.status()
    counts = {}
    for role, handle in workers.items():
        states = status.applications[handle.app_name].deployments[handle.deployment_name].replica_states
        counts[role] = sum(n for state, n in states.items() if state not in ("STOPPING", "STOPPED"))
    return counts


class AutoscaleLoop:
    def __init__(self, settings: AutoscaleSettings, workers: dict, metrics, *,
                 profile: StepTimeModel | None = None, deployed: dict[str, int] | None = None,
                 limits: ReplicaLimits = ReplicaLimits(),
                 running_output_tokens: Callable[[], float | None] = lambda: None,
                 kept_replicas: Callable[[dict], dict[str, int]] | None = serve_replica_counts):
        """`workers`: role -> Serve handle of that role's deployment; `deployed`: role ->
        replicas the deployment started with (where `kept_replicas`, asked at the
        first interval, cannot say what Serve keeps now); `limits`: the engines'
        max_num_seqs and block size (the KV blocks come from the workers' stats);
        `running_output_tokens`: the mean output so far of the requests under way
        (ServingBackend's)."""
        self.settings = settings
        self.running_output_tokens = running_output_tokens
        self.workers = workers
        self.metrics = metrics
        self.profile = profile
        self.limits = limits
        self.policy: GoodputPolicy | None = None
        self.targets: dict[str, int] = {}
        self._asked: dict[str, int] = dict(deployed or {})   # role -> replicas Serve was last asked for
        self._kept_replicas = kept_replicas      # read once, at the first interval
        self.start_deadline_s = max(START_DEADLINE_S, 10 * settings.startup_s)
        # role -> since when some replica of it has been starting with none of them coming up
        self._starting_since: dict[str, float] = {}
        self._last_running: dict[str, int] = {}
        self._observed_running: dict[str, int] = {}   # role -> replicas running at the last observation
        self._broadcast_failed: set[str] = set()      # roles whose last step-samples call reached no replica
        self._kv_blocks: dict[str, float] = {}  # role -> KV blocks of its smallest replica (latest stats)
        self._waiting: dict[str, float] = {}    # role -> requests queued on its replicas (latest stats)
        self._arrivals = 0                      # offered this interval: served or refused
        self._sized_arrivals = 0                # of which with a known prompt length
        self._prompt_tokens = 0
        self._limited_arrivals = 0              # of the arrivals, with a known max_tokens ...
        self._max_tokens = 0                    # ... and those max_tokens together
        self._refused: dict[str, int] = {}      # this interval's refusals, by the role they were refused for
        self._ended: list[RequestTimings] = []
        self._fit_steps: dict[str, deque] = {r: deque(maxlen=FIT_WINDOW) for r in settings.roles}
        self._said_waiting = ""      # the fit steps last logged while there is no model to hold with
        self._last_tick = time.monotonic()
        metrics.add_listener(self)

    # ---- what the router sees -----------------------------------------------------------
    def observe_workers(self, role: str, stats) -> None:
        """The latest stats of every replica of `role` (the router's periodic refresh)."""
        self._waiting[role] = sum(s.get("num_waiting", 0.0) for s in stats)
        blocks = [s["num_kv_blocks"] for s in stats if "num_kv_blocks" in s]
        if blocks:
            self._kv_blocks[role] = min(blocks)

    def on_arrival(self, prompt_tokens: int | None, max_tokens: int | None = None) -> None:
        """Every request offered, the ones admission control refuses included (their
        prompt length is None when refused before tokenizing): the demand is what
        arrives, not what the current replicas let in. `max_tokens`: the most it may
        generate, where known."""
        self._arrivals += 1
        if prompt_tokens is not None:
            self._sized_arrivals += 1
            self._prompt_tokens += prompt_tokens
        if max_tokens is not None:
            self._limited_arrivals += 1
            self._max_tokens += max_tokens

    def on_refusal(self, reason: str) -> None:
        """A request admission control refused (router/admission.py's reasons): on the
        decode pool's account for the TPOT bound, else on the prefill pool's (a
        colocated pool's, either way)."""
        role = refusal_role(self.settings.mode, reason)
        self._refused[role] = self._refused.get(role, 0) + 1

    def on_request(self, timings: RequestTimings) -> None:
        if timings.finish_reason in ("stop", "length"):
            self._ended.append(timings)

    def serve_targets(self) -> dict[str, float]:
        """For Serve (record_autoscaling_stats): target_<role> -> replicas."""
        return {f"target_{role}": float(n) for role, n in self.targets.items()}

    # ---- the loop -----------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - a failed interval must not stop the autoscaler
                log.exception("autoscaler interval failed")

    async def tick(self) -> None:
        now = time.monotonic()
        window, self._last_tick = now - self._last_tick, now
        counts = self._take_counts()
        if self._kept_replicas is not None:
            await self._ask_serve_what_it_keeps()
        observed = await asyncio.gather(*(self._observe_role(role) for role in self.settings.roles))
        roles = self._starting_within_budget(self._past_start_deadline(now, dict(zip(self.settings.roles, observed))))
        obs = self._observation(now, window, roles, counts)
        # fitting step models takes tens of milliseconds: off the router's event loop, whose streams would stall
        if self.policy is None:
            self.policy = await asyncio.to_thread(self._make_policy)
            if self.policy is None:
                waiting = ", ".join(f"{r}: {len(s)} steps" for r, s in self._fit_steps.items())
                if waiting != self._said_waiting:     # said as the steps come, not every interval while idle
                    log.info("autoscaler: holding, no step-time model yet (%s)", waiting)
                    self._said_waiting = waiting
                return
        elif self.profile is None:
            await asyncio.to_thread(self._refit)
        self.policy.limits.update(self._role_limits())
        current = {r: ro.running + ro.starting for r, ro in roles.items()}
        decision = self.policy.decide(obs)
        if decision.changed(current) or not self.targets:
            log.info("autoscaler: %s (predicted %.2f req/s)", decision.describe(), decision.predicted_rate)
        self.targets = dict(decision.targets)
        self._asked = dict(decision.targets)
        self.metrics.set_autoscaler(self.targets, {r: ro.running for r, ro in roles.items()}, {
            ("ttft", "predicted"): decision.predicted_ttft_s, ("tpot", "predicted"): decision.predicted_tpot_s,
            ("ttft", "observed"): obs.ttft_p90_s, ("tpot", "observed"): obs.tpot_p90_s})

    async def _observe_role(self, role: str) -> RoleObservation:
        handle = self.workers[role]
        try:
            replies, slow, _ = await replica_answers(handle, "step_samples", STEP_SAMPLES_TIMEOUT_S)
            self._broadcast_failed.discard(role)
        except Exception as exc:  # noqa: BLE001 - count it as no replica answering this time
            log.debug("autoscaler: no %s replies: %s", role, exc)
            # the call failed before reaching any replica (Serve's controller slow, say): once, the
            # replicas seen last time still run, not all start again; twice in a row, none answers
            first = role not in self._broadcast_failed
            self._broadcast_failed.add(role)
            replies, slow = [], (self._observed_running.get(role, 0) if first else 0)
        # a replica that answered too late still runs (busy, its loop blocked): not one starting, which
        # would hold back every scale-down and the latency evidence; one whose call failed is gone
        running = len(replies) + slow
        self._observed_running[role] = running
        asked = self._asked.get(role, running)
        steps = []
        for reply in replies:
            for index, step in reply["steps"]:
                shape = StepShape(step.num_prefill_tokens, step.prefill_attention, step.num_decode_seqs,
                                  step.decode_context)
                sample = StepSample(shape, step.duration_s, warm=index > self.settings.warmup_steps,
                                    threads=step.threads, borrowed_threads=step.borrowed_threads)
                steps.append(sample)
                if sample.fits_own_cores:
                    # borrowed idle cores (faster) the policy counts apart (cluster/autoscaler/lending.py)
                    self._fit_steps[role].append(sample)
        return RoleObservation(running=running, starting=max(0, asked - running),
                               waiting_requests=self._waiting.get(role, 0.0), steps=steps)

    async def _ask_serve_what_it_keeps(self) -> None:
        """What Serve keeps of each role, in place of the pools as deployed: a router
        that restarted after the autoscaler scaled a role down would otherwise count
        the replicas given back as starting, and publish the deployed pools again."""
        kept, self._kept_replicas = self._kept_replicas, None
        try:
            counts = await asyncio.wait_for(asyncio.to_thread(kept, self.workers), SERVE_STATUS_TIMEOUT_S)
        except TimeoutError:     # (an answer after it would be stale: decisions have moved the targets since)
            log.warning("autoscaler: Serve did not say in %.0f s which replicas it keeps; counting from the "
                        "deployment", SERVE_STATUS_TIMEOUT_S)
            return
        except Exception as exc:  # noqa: BLE001 - Serve not reachable: the deployed pools stand
            log.warning("autoscaler: cannot read the replicas Serve keeps (%r); counting from the deployment", exc)
            return
        self._asked.update({role: n for role, n in counts.items() if role in self.settings.roles})

    def _past_start_deadline(self, now: float, roles: dict[str, RoleObservation]) -> dict[str, RoleObservation]:
        """`roles` with no replica counted as starting where some have been for longer than
        `start_deadline_s` with none of the role's coming up meanwhile: Serve cannot place or
        start them, and counted they would hold the budget (and every scale-down of their
        role) for ever."""
        out = dict(roles)
        for role, ro in roles.items():
            came_up = ro.running > self._last_running.get(role, ro.running)
            self._last_running[role] = ro.running
            if not ro.starting or came_up:      # (a long scale-up that makes progress is not stuck)
                self._starting_since.pop(role, None)
            if not ro.starting:
                continue
            since = self._starting_since.setdefault(role, now)
            if now - since > self.start_deadline_s:
                log.warning("autoscaler: %d %s replica(s) asked for have not started in %.0f s (Serve cannot place "
                            "or start them: see Serve's log; a model that takes longer to load needs a larger "
                            "autoscaling.startup_s); counting them out", ro.starting, role, now - since)
                self._asked[role] = ro.running
                self._starting_since.pop(role)
                out[role] = replace(ro, starting=0)
        return out

    def _starting_within_budget(self, roles: dict[str, RoleObservation]) -> dict[str, RoleObservation]:
        """`roles` with no more replicas counted as starting than the budget leaves
        beside those running. What Serve was asked for can be more: a router that
        restarted knows only the pools as deployed, and the autoscaler may have
        moved ranks from one role to another since (counted as starting, the
        replicas it gave back would be held for ever)."""
        s = self.settings
        over = sum((ro.running + ro.starting) * s.tp(r) for r, ro in roles.items()) - s.budget
        trimmed = dict(roles)
        for role, ro in roles.items():
            if over <= 0:
                break
            drop = min(ro.starting, -(-over // s.tp(role)))
            if drop:
                trimmed[role] = replace(ro, starting=ro.starting - drop)
                over -= drop * s.tp(role)
        return trimmed

    def _take_counts(self) -> tuple:
        """This interval's counts (arrivals, sized ones, their prompt tokens, limited
        ones, their max_tokens, refusals, ended requests), the counters reset for
        the next one."""
        counts = (self._arrivals, self._sized_arrivals, self._prompt_tokens, self._limited_arrivals,
                  self._max_tokens, self._refused, self._ended)
        self._arrivals = self._sized_arrivals = self._prompt_tokens = 0
        self._limited_arrivals = self._max_tokens = 0
        self._refused, self._ended = {}, []
        return counts

    def _role_limits(self) -> dict[str, ReplicaLimits]:
        return {r: ReplicaLimits(self.limits.max_num_seqs, int(self._kv_blocks[r]), self.limits.block_size)
                for r in self.settings.roles if r in self._kv_blocks}

    def _observation(self, now: float, window: float, roles: dict[str, RoleObservation], counts: tuple) -> Observation:
        arrivals, sized, prompt, limited, max_tokens, refused, ended = counts
        ttfts = [(t.first_token_time, t.time_to_first_token) for t in ended if t.time_to_first_token is not None]
        tpot_samples = [(t.first_token_time, t.time_per_output_token) for t in ended
                        if t.time_per_output_token is not None and t.first_token_time is not None]
        tpots = [tpot for _, tpot in tpot_samples]
        return Observation(
            now=now, window_s=window, arrivals=arrivals,
            mean_prompt_tokens=prompt / sized if sized else None,
            mean_output_tokens=sum(t.generation_tokens for t in ended) / len(ended) if ended else None,
            mean_squared_output_tokens=sum(t.generation_tokens ** 2 for t in ended) / len(ended) if ended else None,
            finished=len(ended), finished_by_length=sum(t.finish_reason == "length" for t in ended),
            mean_max_tokens=max_tokens / limited if limited else None,
            mean_inflight_output_tokens=self.running_output_tokens(),
            ttft_p90_s=p90([ttft for _, ttft in ttfts]), tpot_p90_s=p90(tpots), ttft_samples=ttfts,
            tpot_samples=tpot_samples, roles=roles, refused=refused)

    # ---- the step-time model ------------------------------------------------------------
    def _make_policy(self) -> GoodputPolicy | None:
        if self.profile is not None:
            models = {r: self.profile for r in self.settings.roles}
        else:
            models = {r: self._fit(r) for r in self.settings.roles}
            if any(m is None for m in models.values()):
                return None
        return GoodputPolicy(self.settings, models, self._role_limits(), shared_cores=self._shared_cores())

    def _shared_cores(self) -> int | None:
        """This machine's cores where the replicas lend idle cores to each other and
        all run here (a one-node cluster); else None."""
        if not self.settings.lend_idle_cores:
            return None
        import ray
        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
        except Exception:  # noqa: BLE001 - not connected (tests): count this machine alone
            nodes = [None]
        return usable_cpus() if len(nodes) == 1 else None

    def _refit(self) -> None:
        for role in self.settings.roles:
            model = self._fit(role)
            if model is not None:
                self.policy.models[role] = OnlineCorrection(model)

    def _fit(self, role: str) -> LinearStepModel | None:
        """Fitted to the role's recent steps; while it has too few (short prompts all
        prefilled on decode workers, say), to every role's: the same model on the
        same devices."""
        samples = list(self._fit_steps[role])
        if len(samples) < MIN_FIT_STEPS:
            samples = [s for steps in self._fit_steps.values() for s in steps]
        if len(samples) < MIN_FIT_STEPS:
            return None
        # an eager floor only where the profile it corrects has one (GPU engines): on CPU every step
        # runs eagerly, and a busy machine's noise alone could pass for a floor
        floored = getattr(self.profile, "eager_floor_s", 0.0) > 0
        try:
            return LinearStepModel.fit([s.shape for s in samples], [s.seconds for s in samples], eager_floor=floored)
        except ValueError:
            return None

