"""`autoscaling:` in the deployment file: the desired-replicas rule's settings
(tokenyard/gateway/admission/desired_replicas.py; docs/scaling.md, "Autoscaling signals").

    autoscaling: {lead_time_s: 300, scale_down_hold_s: 600, max_replicas: 8}

The TTFT SLO is the deployment's `metrics.slo_ttft_s`, not repeated here.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tokenyard.gateway.config import yaml_fields

MAX_RATE_WINDOW_S = 600     # the arrival counters keep this many one-second buckets


@dataclass(slots=True)
class DesiredReplicasConfig:
    target_kv_usage: float = 0.8         # KV occupancy per replica to aim for; above it a replica preempts soon
    target_queue_per_replica: float = 4  # requests queued in the gateway per replica beyond its running slots
    slo_ttft_s: float = 2.0              # the deployment's TTFT SLO (metrics.slo_ttft_s, not a key here)
    wait_share: float = 0.5              # part of the SLO the queue wait may use (the rest: prefill, network)
    lead_time_s: float = 120.0           # how long a new replica takes to serve: the queue is projected this far
    # The arrival rate the projection uses is averaged over this long: over one second its noise, times a
    # lead time of minutes, reads as hundreds of queued requests (bench/RESULTS.md, "Fleet simulation").
    rate_window_s: float = 30.0
    scale_down_hold_s: float = 300.0     # a lower count must hold this long before it is reported
    min_replicas: int = 1
    max_replicas: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.target_kv_usage <= 1:
            raise ValueError(f"target_kv_usage must be in (0, 1], got {self.target_kv_usage}")
        if not 1 <= self.rate_window_s <= MAX_RATE_WINDOW_S:
            raise ValueError(f"rate_window_s must be in [1, {MAX_RATE_WINDOW_S}] seconds, got {self.rate_window_s}")
        if self.target_queue_per_replica < 0 or self.lead_time_s < 0 or self.scale_down_hold_s < 0:
            raise ValueError("target_queue_per_replica, lead_time_s and scale_down_hold_s must be >= 0")
        if self.slo_ttft_s <= 0 or not 0 < self.wait_share <= 1:
            raise ValueError("slo_ttft_s must be > 0 and wait_share in (0, 1]")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, max >= 1; got {self.min_replicas}, "
                             f"{self.max_replicas}")


AUTOSCALING_KEYS = frozenset(f.name for f in fields(DesiredReplicasConfig)) - {"slo_ttft_s"}


def parse_autoscaling(section: dict[str, Any], error: type[Exception]) -> DesiredReplicasConfig:
    """The `autoscaling:` mapping as a checked config; a bad value raises `error` naming its key."""
    yaml_fields.only(section, "autoscaling.", AUTOSCALING_KEYS, error=error)
    values: dict[str, Any] = {}
    for key, value in section.items():
        want = int if key in ("min_replicas", "max_replicas") else float
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (want is int and not isinstance(value, int)):
            raise error(f"autoscaling.{key} must be {'an integer' if want is int else 'a number'}, got {value!r}")
        values[key] = want(value)
    try:
        return DesiredReplicasConfig(**values)
    except ValueError as e:
        raise error(f"autoscaling: {e}") from None
