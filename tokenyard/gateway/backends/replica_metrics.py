"""Prometheus series of replica pools and the per-engine load ratio, read at scrape time.

Every name is documented in the README ("Metrics"). Registered on the gateway's registry by
app.py; engines without replicas only appear in tokenyard_engine_load_ratio and
tokenyard_engine_replicas (as one local replica).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

STATES = ("up", "asleep", "waking", "down")


class ReplicaCollector(Collector):
    def __init__(self, handles: Callable[[], dict[str, Any]]) -> None:
        self._handles = handles

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        from tokenyard.gateway.backends.replica_pool import ReplicaPool
        lab = ["engine", "replica"]
        up = GaugeMetricFamily("tokenyard_replica_up", "1 while the replica takes new requests (healthy and ready)",
                               labels=lab)
        chosen = CounterMetricFamily("tokenyard_replica_chosen", "Requests routed to each replica", labels=lab)
        hits = CounterMetricFamily("tokenyard_replica_prefix_affinity_hits",
                                   "Requests routed to a replica that was sent the same prompt prefix before",
                                   labels=lab)
        eject = CounterMetricFamily("tokenyard_replica_ejections", "Times each replica was ejected", labels=lab)
        in_flight = GaugeMetricFamily("tokenyard_replica_in_flight_requests",
                                      "Requests this gateway has running on each replica", labels=lab)
        kv = GaugeMetricFamily("tokenyard_replica_kv_usage_ratio", "Each replica's KV usage (its latest stats)",
                               labels=lab)
        retries = CounterMetricFamily("tokenyard_replica_retries",
                                      "Requests run on another replica after failing before their first token",
                                      labels=["engine"])
        sleep = GaugeMetricFamily("tokenyard_replica_sleep_level",
                                  "0 awake, 1 KV cache released, 2 weights dropped too", labels=lab)
        wake = GaugeMetricFamily("tokenyard_replica_last_wake_seconds",
                                 "Seconds the replica's latest wake took (absent before its first)", labels=lab)
        count = GaugeMetricFamily("tokenyard_engine_replicas",
                                  "Replicas per engine by state (up: awake and routable, asleep, waking, down)",
                                  labels=["engine", "state"])
        load = GaugeMetricFamily("tokenyard_engine_load_ratio",
                                 "(running + waiting inside the engine) / max_num_seqs, over the routable replicas",
                                 labels=["engine"])
        for name, h in self._handles().items():
            eng = h.engine
            s = eng.stats()
            load.add_metric([name], (s.num_running + s.num_waiting) / max(1, s.max_num_seqs))
            if not isinstance(eng, ReplicaPool):
                state = _engine_state(eng)
                for st in STATES:
                    count.add_metric([name, st], 1 if st == state else 0)
                continue
            states = dict.fromkeys(STATES, 0)
            for r in eng.replicas:
                states[r.state] += 1
                labels = [name, r.label]
                up.add_metric(labels, 1 if r.routable else 0)
                sleep.add_metric(labels, r.sleep_level)
                last = _last_wake_s(r.engine)
                if last is not None:
                    wake.add_metric(labels, last)
                chosen.add_metric(labels, r.chosen)
                hits.add_metric(labels, r.affinity_hits)
                eject.add_metric(labels, r.ejections)
                in_flight.add_metric(labels, r.engine.num_in_flight)
                kv.add_metric(labels, r.engine.stats().kv_usage)
            retries.add_metric([name], eng.retries)
            for st, n in states.items():
                count.add_metric([name, st], n)
        return [up, chosen, hits, eject, in_flight, kv, retries, sleep, wake, count, load]


def _engine_state(eng: Any) -> str:
    """An engine without replicas as one replica: "down", "up" (awake), "asleep" or "waking"."""
    if eng.dead:
        return "down"
    sleep = getattr(eng, "sleep_state", "awake")
    return "up" if sleep == "awake" else sleep


def _last_wake_s(engine: Any) -> float | None:
    """An in-process engine's own figure, or what a remote replica's stats document said."""
    info = getattr(engine, "info", None)
    value = info.get("last_wake_s") if isinstance(info, dict) else getattr(engine, "last_wake_s", None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
