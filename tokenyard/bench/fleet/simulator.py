"""A discrete-event simulation of a fleet of replicas behind one gateway, replaying a trace under a
scaling policy.

The model, and what it leaves out:
- Each ready replica batches continuously as the engine does: every step decodes one token for
  each sequence past its prompt, then spends what is left of `max_num_batched_tokens` on prompt
  chunks (first come first served); a sequence's first token comes at the end of the step that
  computes its prompt's last chunk. A step takes the service curve's time for its shape
  (service_curve.py). Runs of pure decode steps are simulated as one event (the context grows by
  the batch size each step, so their times are an arithmetic series) and cut short at the next
  step boundary when a new request joins.
- The gateway holds one queue for the fleet (first come first served) and hands a request to the
  ready replica running the fewest sequences once one has a free slot (`max_num_seqs`). With
  shedding on, it refuses a request at once when its queue is full or the gateway's predicted
  wait (tokenyard/gateway/admission/shedding.py `predicted_wait`, with the gateway's own EWMA of
  slot hold times) exceeds the request's deadline, and drops a queued request whose deadline
  passes; without shedding every request waits for its turn however long it takes.
- The KV cache is taken to hold every running sequence (no preemption): the fleet's replicas run
  few sequences each. KV occupancy is reported to the desired-replicas rule as context tokens over
  `kv_tokens` per replica.
- Every `tick_s` the policy names a replica count; extra replicas wake from the warm pool
  (`wake_s`) or cold start (`cold_start_s`); surplus ones stop starting, or drain and then sleep
  (while the warm pool is short) or go.
- No network: TTFT is the request's queue wait plus the engine time up to its first token, plus
  `overhead_s` (the gateway and the network, 0 by default).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tokenyard.bench.fleet.fleet_state import Outcome, Plan, Replica, Seq
from tokenyard.bench.fleet.policies import FleetView, Policy
from tokenyard.bench.fleet.service_curve import ServiceCurve
from tokenyard.bench.fleet.trace import Request
from tokenyard.gateway.admission.shedding import ServiceRate, predicted_wait

# The measured cold start of a SmolLM2 replica on this machine (bench/results/startup_phases.json,
# smollm2-135m ready_wall_s, median of 3): the default until a run passes its own.
DEFAULT_COLD_START_S = 11.5


@dataclass(slots=True)
class FleetTimes:
    """How long a replica takes to serve after it is asked for."""

    cold_start_s: float = DEFAULT_COLD_START_S
    wake_s: float | None = None          # a sleeping replica to ready; None: the cold start (not measured yet)
    kv_tokens: int = 8736                # KV capacity of one replica in tokens (SmolLM2's 384 MiB of fp32 KV)

    def __post_init__(self) -> None:
        if self.cold_start_s < 0 or (self.wake_s is not None and self.wake_s < 0) or self.kv_tokens < 1:
            raise ValueError("fleet times: cold_start_s and wake_s must be >= 0 and kv_tokens >= 1")

    @property
    def wake(self) -> float:
        return self.cold_start_s if self.wake_s is None else self.wake_s


@dataclass(slots=True)
class SLO:
    ttft_s: float = 2.0                  # time to first token
    itl_s: float = 0.25                  # mean inter-token gap of the request after its first token


@dataclass(slots=True)
class Shedding:
    enabled: bool = True
    deadline_s: float | None = None      # a request's deadline from its arrival; None: the TTFT SLO
    max_queue: int = 256                 # the gateway's admission.max_queue


@dataclass(slots=True)
class SimConfig:
    curve: ServiceCurve
    times: FleetTimes = field(default_factory=FleetTimes)
    slo: SLO = field(default_factory=SLO)
    shedding: Shedding = field(default_factory=Shedding)
    tick_s: float = 15.0                 # how often the autoscaler looks (the HPA's sync period)
    sleep_cost_share: float = 1.0        # a sleeping replica's cost as a share of an active one
    overhead_s: float = 0.0              # added to every TTFT: gateway and network
    end_s: float | None = None           # cost accounting and ticks stop here (None: the last arrival)
    rate_window_s: float = 30.0          # the arrival rate the autoscaling rule reads is averaged this long

    def __post_init__(self) -> None:
        if not (self.tick_s > 0 and math.isfinite(self.tick_s)):
            raise ValueError(f"tick_s must be a positive number, got {self.tick_s}")
        if self.sleep_cost_share < 0 or self.overhead_s < 0:
            raise ValueError("sleep_cost_share and overhead_s must be >= 0")


@dataclass(slots=True)
class SimResult:
    policy: str
    outcomes: list[Outcome]
    replica_seconds: dict[str, float]    # per state, over [0, end_s]
    timeline: list[dict[str, float]]     # one row per tick: t, ready, active, asleep, queue, rate
    end_s: float


_ARRIVE, _STEP, _READY, _TICK, _START = 0, 1, 2, 3, 4


class FleetSim:
    def __init__(self, cfg: SimConfig, policy: Policy, requests: list[Request]) -> None:
        self.cfg, self.policy = cfg, policy
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.id))
        self.end_s = cfg.end_s if cfg.end_s is not None else (self.requests[-1].arrival_s if self.requests else 0.0)
        self.deadline_s = cfg.shedding.deadline_s if cfg.shedding.deadline_s is not None else cfg.slo.ttft_s
        self.now = 0.0
        self.events: list[tuple[float, int, int, Any, int]] = []
        self._order = 0
        self.replicas: list[Replica] = []
        self.queue: deque[Outcome] = deque()
        self.outcomes = {r.id: Outcome(r) for r in self.requests}
        self.rate = ServiceRate()            # the gateway's EWMA of slot hold times
        self.arrivals: deque[float] = deque()
        self.seconds: dict[str, float] = {}
        self.timeline: list[dict[str, float]] = []
        self._busy_at_tick: dict[int, float] = {}

    # --- the event loop ---------------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj: Any = None, epoch: int = 0) -> None:
        self._order += 1
        heapq.heappush(self.events, (t, self._order, kind, obj, epoch))

    def run(self) -> SimResult:
        for _ in range(self.policy.initial()):
            self._new_replica("ready")
        for _ in range(self.policy.warm_pool):
            self._new_replica("asleep")
        for r in self.requests:
            self._push(r.arrival_s, _ARRIVE, r)
        self._push(0.0, _TICK)
        while self.events:
            t, _, kind, obj, epoch = heapq.heappop(self.events)
            self.now = t
            if kind == _ARRIVE:
                self._arrive(obj)
            elif kind == _STEP:
                if obj.epoch == epoch and obj.plan is not None:
                    self._step_end(obj)
            elif kind == _START:
                obj.kicked = False
                if obj.plan is None:
                    self._plan(obj)
            elif kind == _READY:
                # A replica given up while starting or waking, or woken again since, ignores it.
                if obj.state in ("starting", "waking") and obj.ready_at_s == t:
                    self._ready(obj)
            else:
                self._tick()
        self.now = max(self.now, self.end_s)      # fixed fleets are paid to the end of the trace
        for o in self.outcomes.values():
            if o.status == "pending":
                o.status = "unfinished"
        for replica in self.replicas:
            if replica.state != "gone":
                self._move(replica, "gone")
        return SimResult(self.policy.name, list(self.outcomes.values()), dict(self.seconds), self.timeline,
                         self.end_s)

    # --- the gateway ------------------------------------------------------------------------------

    def _arrive(self, req: Request) -> None:
        o = self.outcomes[req.id]
        self._expire()
        if self.cfg.shedding.enabled:
            if len(self.queue) >= self.cfg.shedding.max_queue:
                o.status = "shed_queue_full"
                return
            if self.queue or not self._room():
                wait = predicted_wait(len(self.queue), self.rate.per_second(self._running()))
                if wait > self.deadline_s:
                    o.status = "shed_predicted_wait"
                    return
        self.arrivals.append(self.now)
        self.queue.append(o)
        self._pump()

    def _expire(self) -> None:
        """Drop queued requests whose deadline passed (FIFO with one deadline: the oldest first)."""
        if not self.cfg.shedding.enabled:
            return
        while self.queue and self.queue[0].req.arrival_s + self.deadline_s <= self.now:
            self.queue.popleft().status = "expired"

    def _running(self) -> int:
        return sum(len(r.seqs) for r in self.replicas if r.state in ("ready", "draining"))

    def _room(self) -> Replica | None:
        best = None
        for r in self.replicas:
            if r.state == "ready" and len(r.seqs) < self.cfg.curve.max_num_seqs:
                if best is None or len(r.seqs) < len(best.seqs):
                    best = r
        return best

    def _pump(self) -> None:
        self._expire()
        while self.queue:
            r = self._room()
            if r is None:
                return
            o = self.queue.popleft()
            r.seqs.append(Seq(o.req, self.now))
            self._join(r)

    # --- a replica's steps ------------------------------------------------------------------------

    def _join(self, r: Replica) -> None:
        """A new sequence on r: start stepping if idle, else end a decode run at the next step."""
        if r.plan is None:
            # Start at this instant, after the other events of this instant (requests arriving
            # together are prefilled together, as the engine takes all it has at a step's start).
            if not r.kicked:
                r.kicked = True
                self._push(self.now, _START, r)
        elif r.plan.first_step_s > 0 and r.plan.steps > 1:
            p = r.plan
            done = min(p.steps, int((self.now - p.start_s) / p.first_step_s))
            while done > 0 and p.elapsed_for(done) > self.now - p.start_s:
                done -= 1
            keep = min(p.steps, done + 1)        # the step in progress finishes
            if keep < p.steps:
                p.steps, p.end_s = keep, p.start_s + p.elapsed_for(keep)
                r.epoch += 1
                self._push(p.end_s, _STEP, r, r.epoch)

    def _plan(self, r: Replica) -> None:
        curve = self.cfg.curve
        decode = [s for s in r.seqs if s.decoding]
        waiting = [s for s in r.seqs if not s.decoding]
        ctx = sum(s.context for s in decode)
        if waiting:
            budget = max(0, curve.max_num_batched_tokens - len(decode))
            chunks = []
            for s in waiting:
                n = min(s.req.prompt_tokens - s.prefilled, budget)
                if n <= 0:
                    break
                chunks.append((s, n))
                budget -= n
            dur = curve.step_s(len(decode), ctx, sum(n for _, n in chunks))
            r.plan = Plan(self.now, self.now + dur, 1, chunks, decode)
        elif decode:
            steps = min(s.req.output_tokens - s.generated for s in decode)
            first = curve.step_s(len(decode), ctx, 0)
            growth = curve.per_ctx_token_s * len(decode)
            r.plan = Plan(self.now, 0.0, steps, [], decode, first, growth)
            r.plan.end_s = self.now + r.plan.elapsed_for(steps)
        else:
            r.plan = None
            if r.state == "draining":
                self._drained(r)
            return
        r.epoch += 1
        self._push(r.plan.end_s, _STEP, r, r.epoch)

    def _step_end(self, r: Replica) -> None:
        p = r.plan
        assert p is not None
        r.busy_s += p.end_s - p.start_s
        for s in p.decode:
            s.generated += p.steps
        for s, n in p.chunks:
            s.prefilled += n
            if s.decoding:                    # its last chunk: the step samples its first token
                s.generated, s.first_token_s = 1, self.now
        for s in p.decode:
            if s.first_token_s is None:       # cannot happen (decoding implies a first token) but be safe
                s.first_token_s = self.now
        done = [s for s in r.seqs if s.generated >= s.req.output_tokens]
        if done:
            r.seqs = [s for s in r.seqs if s.generated < s.req.output_tokens]
            for s in done:
                self._finish(s)
        r.plan = None
        self._plan(r)
        if done:
            self._pump()

    def _finish(self, s: Seq) -> None:
        o = self.outcomes[s.req.id]
        assert s.first_token_s is not None
        o.status = "served"
        o.ttft_s = s.first_token_s - s.req.arrival_s + self.cfg.overhead_s
        o.e2e_s = self.now - s.req.arrival_s + self.cfg.overhead_s
        if s.req.output_tokens > 1:
            o.itl_s = (self.now - s.first_token_s) / (s.req.output_tokens - 1)
        self.rate.observe(self.now - s.dispatch_s)

    # --- the fleet --------------------------------------------------------------------------------

    def _new_replica(self, state: str, to_pool: bool = False) -> Replica:
        r = Replica(len(self.replicas), state, self.now, to_pool=to_pool)
        self.replicas.append(r)
        if state == "starting":
            r.ready_at_s = self.now + self.cfg.times.cold_start_s
            self._push(r.ready_at_s, _READY, r)
        return r

    def _move(self, r: Replica, state: str) -> None:
        r.move(state, self.now, self.seconds, self.end_s)

    def _ready(self, r: Replica) -> None:
        if r.state == "starting" and r.to_pool:
            self._move(r, "asleep")
            r.to_pool = False
            return
        self._move(r, "ready")
        self._pump()

    def _drained(self, r: Replica) -> None:
        pool = sum(1 for x in self.replicas if x.state == "asleep")
        self._move(r, "asleep" if pool < self.policy.warm_pool else "gone")

    def _tick(self) -> None:
        self._expire()
        view = self.view()
        target = max(0, self.policy.target(view))
        active = [r for r in self.replicas if r.active]
        if target > len(active):
            for _ in range(target - len(active)):
                asleep = [r for r in self.replicas if r.state == "asleep"]
                for_pool = [r for r in self.replicas if r.state == "starting" and r.to_pool]
                if asleep:
                    r = asleep[0]
                    self._move(r, "waking")
                    r.ready_at_s = self.now + self.cfg.times.wake
                    self._push(r.ready_at_s, _READY, r)
                elif for_pool:
                    for_pool[0].to_pool = False       # serve as soon as it is up
                else:
                    self._new_replica("starting")
        elif target < len(active):
            # Cheapest to give up first: a replica still starting, then waking, then the idlest ready one.
            rank = {"starting": 0, "waking": 1, "ready": 2}
            for r in sorted(active, key=lambda x: (rank[x.state], len(x.seqs), -x.id))[:len(active) - target]:
                if r.state == "starting":
                    self._move(r, "gone")
                elif r.state == "waking":
                    self._move(r, "asleep")
                else:
                    self._move(r, "draining")
                    if not r.seqs:
                        self._drained(r)
        # Keep the warm pool at its size: replicas starting for it count; beyond it, sleepers go.
        pool = sum(1 for r in self.replicas if r.state == "asleep" or (r.state == "starting" and r.to_pool))
        for _ in range(self.policy.warm_pool - pool):
            self._new_replica("starting", to_pool=True)
        extra = [r for r in self.replicas if r.state == "asleep"][self.policy.warm_pool:]
        for r in extra:
            self._move(r, "gone")
        self.timeline.append({"t": self.now, "ready": view.ready, "active": view.active, "target": target,
                              "asleep": sum(1 for r in self.replicas if r.state == "asleep"),
                              "queue": view.queue_depth, "running": view.running,
                              "utilisation": round(view.utilisation, 4)})
        if self.now + self.cfg.tick_s <= self.end_s:
            self._push(self.now + self.cfg.tick_s, _TICK)

    def view(self) -> FleetView:
        ready = [r for r in self.replicas if r.state == "ready"]
        while self.arrivals and self.arrivals[0] < self.now - self.cfg.rate_window_s:
            self.arrivals.popleft()
        running = self._running()
        slots = len(ready) * self.cfg.curve.max_num_seqs
        if not self.queue and running < slots:
            wait = 0.0
        else:
            wait = predicted_wait(len(self.queue), self.rate.per_second(running))
        kv = sum(s.context for r in ready for s in r.seqs) / (len(ready) * self.cfg.times.kv_tokens) if ready else 0.0
        util = 0.0
        if ready:
            for r in ready:
                # Busy seconds in steps finished since the last tick (a step in progress counts when it ends).
                since = self._busy_at_tick.get(r.id, r.busy_s)
                util += min(1.0, (r.busy_s - since) / self.cfg.tick_s)
            util /= len(ready)
        self._busy_at_tick = {r.id: r.busy_s for r in self.replicas}
        return FleetView(now_s=self.now, active=sum(1 for r in self.replicas if r.active), ready=len(ready),
                         slots=slots, running=running, queue_depth=len(self.queue), kv_usage=min(1.0, kv),
                         predicted_wait_s=wait, arrival_rate=len(self.arrivals) / self.cfg.rate_window_s,
                         service_rate=self.rate.per_second(running), utilisation=util)


def simulate(cfg: SimConfig, policy: Policy, requests: list[Request]) -> SimResult:
    """Replay `requests` against a fleet scaled by `policy`."""
    return FleetSim(cfg, policy, requests).run()
