"""Scaling policies the fleet simulator compares. Each one sees what an autoscaler would see every
`tick_s` (a `FleetView`) and answers how many replicas should be active (starting, waking or
ready); the simulator starts, wakes, drains or puts them to sleep to match.

    static_peak       a fixed fleet sized for the trace's busiest minute
    static_average    a fixed fleet sized for the trace's mean rate
    reactive_util     the HPA rule on utilisation: ceil(active * busy / target), scale-down
                      stabilised over a window (Kubernetes' default 300 s); new replicas cold start
    desired_replicas  the gateway's own rule (tokenyard/gateway/admission/desired_replicas.py,
                      imported, not copied): queue, KV occupancy and predicted wait against the
                      SLO, projected over the lead time, with its scale-down hold; optionally with
                      a warm pool of sleeping replicas that wake in `wake_s` instead of a cold start
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from tokenyard.gateway.admission.desired_replicas import DesiredReplicas, DesiredReplicasConfig, ScalingSignals


@dataclass(slots=True)
class FleetView:
    """The fleet as the gateway and the autoscaler see it at one tick."""

    now_s: float
    active: int                          # starting + waking + ready
    ready: int                           # taking requests
    slots: int                           # sequences the ready replicas run at once
    running: int                         # sequences on replicas (ready and draining)
    queue_depth: int                     # requests queued in the gateway
    kv_usage: float                      # context tokens held / KV capacity of the ready replicas
    predicted_wait_s: float              # the gateway's predicted wait for a new request
    arrival_rate: float                  # requests admitted per second over SimConfig.rate_window_s (as the gateway)
    service_rate: float | None           # requests finished per second with every slot busy (None: no estimate)
    utilisation: float                   # mean busy fraction of the ready replicas over the last tick


class Policy(Protocol):
    name: str
    warm_pool: int                       # sleeping replicas to keep (0: none)

    def initial(self) -> int: ...

    def target(self, view: FleetView) -> int: ...


@dataclass(slots=True)
class StaticPolicy:
    """A fixed fleet of `replicas`."""

    name: str
    replicas: int
    warm_pool: int = 0

    def initial(self) -> int:
        return self.replicas

    def target(self, view: FleetView) -> int:
        return self.replicas


@dataclass(slots=True)
class ReactiveUtilisation:
    """Kubernetes' HPA on a utilisation metric: desired = ceil(active * utilisation / target),
    left alone within `tolerance` of the target, the scale-down taking the highest desired count
    of the last `stabilisation_s` (the HPA's downscale stabilisation window)."""

    name: str = "reactive_util"
    target_util: float = 0.7
    tolerance: float = 0.1
    stabilisation_s: float = 300.0
    min_replicas: int = 1
    max_replicas: int = 64
    start: int = 1
    warm_pool: int = 0
    _history: deque[tuple[float, int]] = field(default_factory=deque)

    def initial(self) -> int:
        return self.start

    def target(self, view: FleetView) -> int:
        active = max(view.active, 1)
        ratio = view.utilisation / self.target_util
        want = active if abs(ratio - 1) <= self.tolerance else math.ceil(round(active * ratio, 9))
        want = min(self.max_replicas, max(self.min_replicas, want))
        self._history.append((view.now_s, want))
        while self._history and self._history[0][0] < view.now_s - self.stabilisation_s:
            self._history.popleft()
        if want >= view.active:
            return want
        return max(w for _, w in self._history)


@dataclass(slots=True)
class DesiredReplicasPolicy:
    """The gateway's desired-replicas rule, fed the signals the gateway would export."""

    config: DesiredReplicasConfig
    name: str = "desired_replicas"
    warm_pool: int = 0
    start: int = 1
    tracker: DesiredReplicas = field(init=False)

    def __post_init__(self) -> None:
        self.tracker = DesiredReplicas(self.config)

    def initial(self) -> int:
        return max(self.start, self.config.min_replicas)

    def target(self, view: FleetView) -> int:
        signals = ScalingSignals(replicas=view.ready, slots=view.slots, running=view.running,
                                 queue_depth=view.queue_depth, kv_usage=view.kv_usage,
                                 predicted_wait_s=view.predicted_wait_s, arrival_rate=view.arrival_rate,
                                 service_rate=view.service_rate)
        # The rule sizes from the ready replicas; the count it answers is the whole fleet's, so the
        # replicas already starting count towards it (as Kubernetes counts pods not yet ready).
        return self.tracker.update(signals, view.now_s)
