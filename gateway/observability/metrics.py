"""Prometheus metrics of one gateway app (each app has its own CollectorRegistry, so tests can
build several apps in one process). Every name is documented in the README ("Metrics").

Latency histograms carry the labels engine and prompt_bucket (the prompt's token count in
PROMPT_BUCKETS), because TTFT depends mostly on prompt length and on which engine served.
Engine gauges are read from each engine backend's latest stats snapshot at scrape time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:   # engines/ pulls in torch: keep it out of processes that only need metrics
    from engines.core.backend import EngineBackend


PROMPT_BUCKETS = ((128, "0-128"), (512, "129-512"), (2048, "513-2048"), (8192, "2049-8192"))
LATENCY_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PER_TOKEN_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REDIS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
E2E_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def prompt_bucket(num_tokens: int) -> str:
    for limit, label in PROMPT_BUCKETS:
        if num_tokens <= limit:
            return label
    return "8193+"


class GatewayMetrics:
    def __init__(self, engines: Callable[[], dict[str, EngineBackend]]) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        lab = ("engine", "prompt_bucket")
        self.ttft = Histogram("tokenyard_time_to_first_token_seconds",
                              "Arrival at the gateway to the first output token", lab, buckets=LATENCY_S, registry=r)
        self.tpot = Histogram("tokenyard_time_per_output_token_seconds",
                              "(E2E - TTFT) / (output tokens - 1), one sample per request", lab,
                              buckets=PER_TOKEN_S, registry=r)
        self.itl = Histogram("tokenyard_inter_token_latency_seconds",
                             "Time between consecutive engine outputs of one request", lab,
                             buckets=PER_TOKEN_S, registry=r)
        self.e2e = Histogram("tokenyard_e2e_request_latency_seconds",
                             "Arrival at the gateway to the last output token", lab, buckets=E2E_S, registry=r)
        self.queue = Histogram("tokenyard_queue_time_seconds",
                               "Arrival at the gateway to hand-off to the engine (gateway-side queueing)", lab,
                               buckets=LATENCY_S, registry=r)
        self.requests = Counter("tokenyard_requests", "Chat requests by engine, HTTP status and route reason",
                                ("engine", "status", "route_reason"), registry=r)
        self.prompt_tokens = Counter("tokenyard_prompt_tokens", "Prompt tokens sent to engines", ("engine",),
                                     registry=r)
        self.cached_tokens = Counter("tokenyard_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     ("engine",), registry=r)
        self.completion_tokens = Counter("tokenyard_completion_tokens", "Output tokens generated", ("engine",),
                                         registry=r)
        self.in_flight = Gauge("tokenyard_in_flight_requests", "Chat requests being served now", registry=r)
        # Admission, limits, keys, Redis.
        self.shed = Counter("tokenyard_admission_shed", "Requests turned away before reaching the engine, by reason",
                            ("engine", "reason"), registry=r)
        self.expired = Counter("tokenyard_admission_expired", "Queued requests whose deadline passed in the queue",
                               ("engine", "priority"), registry=r)
        self.rate_limited = Counter("tokenyard_rate_limited", "Requests refused by the tenant's rate limits",
                                    ("engine", "reason"), registry=r)
        self.rate_limit_fallbacks = Counter("tokenyard_rate_limit_redis_fallbacks",
                                            "Requests whose limits could not be checked (Redis unreachable), "
                                            "by the mode applied", ("engine", "mode"), registry=r)
        self.auth_failures = Counter("tokenyard_auth_failures", "Refused API keys by reason", ("reason",),
                                     registry=r)
        self.redis_errors = Counter("tokenyard_redis_errors", "Failed Redis calls on the request path", ("op",),
                                    registry=r)
        self.redis_latency = Histogram("tokenyard_redis_latency_seconds", "Latency of Redis calls on the request path",
                                       ("op",), buckets=REDIS_S, registry=r)
        # Spend ledger and dashboard.
        self.spend_records = Counter("tokenyard_spend_records",
                                     "Usage records by outcome: stored, duplicate, spooled, replayed, lost",
                                     ("outcome",), registry=r)
        self.spend_write_errors = Counter("tokenyard_spend_write_errors",
                                          "Failed writes of usage records to Redis (the batch went to the spool)",
                                          registry=r)
        self.dashboard_logins = Counter("tokenyard_dashboard_logins", "Dashboard sign-in attempts by outcome",
                                        ("outcome",), registry=r)
        # Routing policies and the learned router.
        self.policy_version = Gauge("tokenyard_policy_version",
                                    "Policy version in force in this gateway (0: the built-in default)", registry=r)
        self.policy_decisions = Counter("tokenyard_policy_decisions",
                                        "Requests decided under a policy, by action (pin, router, requested, deny, "
                                        "budget_deny, downgrade, degrade, shed)", ("action",), registry=r)
        self.budget_checks = Counter("tokenyard_budget_checks",
                                     "Tenant budget checks by outcome: within, reached, unavailable (fail-open)",
                                     ("outcome",), registry=r)
        self.router_score = Histogram("tokenyard_router_score",
                                      "Learned router score P(small is enough) of each chat request",
                                      buckets=tuple(i / 10 for i in range(1, 11)), registry=r)
        self.policy_updates = Counter("tokenyard_policy_updates",
                                      "Policy versions installed in this gateway, by source (redis, file)",
                                      ("source",), registry=r)
        self.admission: Callable[[], dict[str, tuple[list[int], float]]] = dict
        r.register(_EngineCollector(engines))
        r.register(_AdmissionCollector(lambda: self.admission()))

    def count_request(self, engine: str, status: int | str, route_reason: str) -> None:
        self.requests.labels(engine or "none", str(status), route_reason or "none").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Engine state gauges, read from the stats snapshot each engine took after its last step."""

    def __init__(self, engines: Callable[[], dict[str, EngineBackend]]) -> None:
        self._engines = engines

    def describe(self) -> Iterable:
        return []  # dynamic: collected at scrape time only

    def collect(self) -> Iterable:
        running = GaugeMetricFamily("tokenyard_engine_running_requests", "Sequences running in the engine",
                                    labels=["engine"])
        waiting = GaugeMetricFamily("tokenyard_engine_waiting_requests", "Requests waiting inside the engine",
                                    labels=["engine"])
        kv = GaugeMetricFamily("tokenyard_engine_kv_usage_ratio", "Fraction of KV-cache blocks in use",
                               labels=["engine"])
        hit = GaugeMetricFamily("tokenyard_engine_prefix_cache_hit_rate",
                                "Prompt tokens served from the prefix cache / prompt tokens admitted",
                                labels=["engine"])
        pre = CounterMetricFamily("tokenyard_engine_preemptions", "Sequences preempted by the scheduler",
                                  labels=["engine"])
        fail = CounterMetricFamily("tokenyard_engine_failed_steps", "Engine steps that raised", labels=["engine"])
        restarts = CounterMetricFamily("tokenyard_engine_restarts", "Engines rebuilt after a failure",
                                       labels=["engine"])
        for name, eng in self._engines().items():
            s = eng.stats()
            running.add_metric([name], s.num_running)
            waiting.add_metric([name], s.num_waiting)
            kv.add_metric([name], s.kv_usage)
            hit.add_metric([name], s.prefix_cache_hit_rate)
            pre.add_metric([name], s.num_preemptions)
            fail.add_metric([name], eng.num_failed_steps)
            restarts.add_metric([name], getattr(eng, "num_restarts", 0))
        return [running, waiting, kv, hit, pre, fail, restarts]


class _AdmissionCollector(Collector):
    """Queue depth per engine and class, and the predicted wait of a new request, at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, tuple[list[int], float]]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        depth = GaugeMetricFamily("tokenyard_admission_queue_depth", "Requests queued in the gateway per engine",
                                  labels=["engine", "priority"])
        wait = GaugeMetricFamily("tokenyard_admission_predicted_wait_seconds",
                                 "Predicted queue wait of a new batch request per engine", labels=["engine"])
        for name, (by_class, predicted) in self._snapshot().items():
            for cls, n in zip(("interactive", "batch"), by_class):
                depth.add_metric([name, cls], n)
            wait.add_metric([name], min(predicted, 3600.0))   # inf: batch is being shed outright
        return [depth, wait]
