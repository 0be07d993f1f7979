"""How many replicas an engine should run: the one number an autoscaler (HPA, KEDA) scales on.

Capacity is bought in whole replicas and a new one takes minutes to load, so utilisation is the
wrong signal: this rule reads the gateway's own queue (projected `lead_time_s` ahead), the KV
cache occupancy and the predicted wait against the TTFT SLO, and asks for the largest replica
count any of them needs. It scales up at once and down only after the lower count has held for
`scale_down_hold_s` (a removed replica takes its warm prefix cache with it, and the next spike
would pay its load time again). Pure: the caller passes the signals and the time.

    tracker = DesiredReplicas(DesiredReplicasConfig(slo_ttft_s=2.0))
    n = tracker.update(ScalingSignals(replicas=2, slots=64, running=60, queue_depth=12, ...), now)

Exported by the gateway as `tokenyard_engine_desired_replicas{engine}` (docs/metrics.md, docs/scaling.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tokenyard.gateway.config.autoscaling_config import DesiredReplicasConfig

__all__ = ["DesiredReplicas", "DesiredReplicasConfig", "ScalingSignals", "needed_replicas"]


@dataclass(slots=True)
class ScalingSignals:
    """One engine's state as the gateway sees it now."""

    replicas: int               # replicas taking requests (1 for an in-process engine that is not dead)
    slots: int                  # requests the engine runs at once over those replicas (admission's slots)
    running: int                # requests handed to the engine and not ended
    queue_depth: int            # requests queued in this gateway for the engine
    kv_usage: float             # used / total KV blocks over the routable replicas
    predicted_wait_s: float     # predicted queue wait of a new request (inf: it would be shed)
    arrival_rate: float = 0.0   # requests admitted per second, averaged over the config's rate_window_s
    # Requests the replicas finish per second with every slot busy (slots / mean time a request holds
    # one; None: not measured yet). The backlog grows only when arrivals outrun this.
    service_rate: float | None = None


def needed_replicas(cfg: DesiredReplicasConfig, s: ScalingSignals) -> int:
    """The replica count the signals ask for now, before hysteresis, within [min, max]."""
    base = max(s.replicas, 1)        # with every replica down, size from one replica's worth
    # The backlog a new replica would meet: today's queue plus its growth during the lead time.
    growth = 0.0
    if s.service_rate is not None:
        growth = max(0.0, s.arrival_rate - s.service_rate) * cfg.lead_time_s
    demand = s.running + s.queue_depth + growth
    per_replica = s.slots / base + cfg.target_queue_per_replica
    need_load = math.ceil(demand / per_replica) if per_replica > 0 else base
    need_kv = math.ceil(round(base * s.kv_usage / cfg.target_kv_usage, 9))
    target_wait = cfg.slo_ttft_s * cfg.wait_share
    if math.isinf(s.predicted_wait_s):
        need_wait = base + 1         # new requests are shed outright: at least one more replica
    else:
        need_wait = math.ceil(round(base * s.predicted_wait_s / target_wait, 9)) \
            if s.predicted_wait_s > target_wait else 0
    need = max(need_load, need_kv, need_wait)
    return min(cfg.max_replicas, max(cfg.min_replicas, need))


class DesiredReplicas:
    """`needed_replicas` with scale-down hysteresis: up at once, down to the highest count asked
    for during the last `scale_down_hold_s`, once every count in that window was lower."""

    __slots__ = ("cfg", "value", "_lower_since", "_lower_peak")

    def __init__(self, cfg: DesiredReplicasConfig) -> None:
        self.cfg = cfg
        self.value: int | None = None     # the count reported (None before the first update)
        self._lower_since: float | None = None
        self._lower_peak = 0

    def update(self, signals: ScalingSignals, now: float) -> int:
        need = needed_replicas(self.cfg, signals)
        if self.value is None or need >= self.value:
            self.value, self._lower_since = need, None
        elif self._lower_since is None:
            self._lower_since, self._lower_peak = now, need
        else:
            self._lower_peak = max(self._lower_peak, need)
            if now - self._lower_since >= self.cfg.scale_down_hold_s:
                self.value, self._lower_since = self._lower_peak, None
        return self.value
