"""Prometheus metrics of one gateway app (each app has its own CollectorRegistry, so tests can
build several apps in one process). Every name is documented in the README ("Metrics").

Latency histograms carry the labels engine and prompt_bucket (the prompt's token count in
PROMPT_BUCKETS), because TTFT depends mostly on prompt length and on which engine served.
Engine gauges are read from each engine backend's latest stats snapshot at scrape time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from tokenyard.engines.core.outputs import BATCH_BUCKETS
from tokenyard.gateway.observability.device_metrics import device_families

if TYPE_CHECKING:   # engines/ pulls in torch: keep it out of processes that only need metrics
    from tokenyard.engines.core.backend import EngineBackend


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
        # LoRA adapters (model ENGINE:ADAPTER): the same counts per adapter, base requests not included.
        self.lora_requests = Counter("tokenyard_lora_requests", "Requests served with a LoRA adapter",
                                     ("engine", "adapter"), registry=r)
        self.lora_completion_tokens = Counter("tokenyard_lora_completion_tokens",
                                              "Output tokens generated with a LoRA adapter", ("engine", "adapter"),
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
        self.budget_alerts = Counter("tokenyard_budget_alerts",
                                     "Budget alerts fired (once per budget, period and threshold), by threshold_pct",
                                     ("threshold_pct",), registry=r)
        self.alert_webhooks = Counter("tokenyard_alert_webhooks",
                                      "Alert webhook POSTs by outcome: sent (2xx), failed (retried later), gave_up",
                                      ("outcome",), registry=r)
        self.router_score = Histogram("tokenyard_router_score",
                                      "Learned router score P(small is enough) of each chat request",
                                      buckets=tuple(i / 10 for i in range(1, 11)), registry=r)
        # Learning from traffic (docs/router.md): routing samples kept for feedback, feedback labels,
        # shadow scoring of a candidate artifact, artifacts a policy named but that could not be used.
        self.router_samples = Counter("tokenyard_router_samples",
                                      "Routed requests considered for a feedback sample, by outcome: stored, "
                                      "skipped (not sampled, opted out, too long), dropped (writer queue full), "
                                      "failed (Redis write failed)", ("outcome",), registry=r)
        self.router_feedback = Counter("tokenyard_router_feedback",
                                       "POST /v1/feedback results, by outcome: labelled (a training label), "
                                       "no_signal (kept, but a score on a large-engine answer teaches nothing), "
                                       "not_found, invalid", ("outcome",), registry=r)
        self.router_shadow = Counter("tokenyard_router_shadow_decisions",
                                     "Requests scored by the shadow candidate, by agreement with the router in "
                                     "force: agree, to_large (candidate large, router small), to_small",
                                     ("outcome",), registry=r)
        self.router_artifact_refusals = Counter("tokenyard_router_artifact_refusals",
                                                "Policy versions not installed because a router artifact they name "
                                                "is missing from Redis or fails its checksum", registry=r)
        self.policy_updates = Counter("tokenyard_policy_updates",
                                      "Policy versions installed in this gateway, by source (redis, file)",
                                      ("source",), registry=r)
        self.slo = Counter("tokenyard_slo_requests",
                           "Finished requests that produced tokens, by whether they met the deployment's SLO "
                           "(metrics.slo_ttft_s, metrics.slo_itl_s): met, ttft_missed, itl_missed, both_missed",
                           ("engine", "outcome"), registry=r)
        self.slo_ttft_s = 2.0
        self.slo_itl_s = 0.25
        self.slo_counts: dict[str, list[int]] = {}   # engine -> [met, all]: the dashboard's live attainment
        # By engine only: /metrics never names tenants (a scraper is not a tenant's reader); spend per
        # tenant, key, user or tag is the spend report's (GET /v1/spend/report).
        self.spend = Counter("tokenyard_spend_micros", "Cost of finished requests in micro-units, by engine",
                             ("engine",), registry=r)
        # OpenAI-compatible upstream engines (type: openai), per engine and deployment (host:port, never
        # a path or key): every attempt, how it ended, and how long the upstream took to answer.
        dep = ("engine", "deployment")
        self.upstream_attempts = Counter("tokenyard_upstream_attempts",
                                         "Calls to upstream deployments by outcome: ok, connect_error, timeout, "
                                         "server_error, rate_limited, client_error, broken_stream",
                                         (*dep, "outcome"), registry=r)
        self.upstream_cooldowns = Counter("tokenyard_upstream_cooldowns",
                                          "Times an upstream deployment was cooled down after a failure", dep,
                                          registry=r)
        self.upstream_latency = Histogram("tokenyard_upstream_first_byte_seconds",
                                          "Upstream time to its response head (non-streamed: the whole body)",
                                          dep, buckets=LATENCY_S, registry=r)
        self.upstream_up = Gauge("tokenyard_upstream_deployment_up",
                                 "1 while an upstream deployment takes requests, 0 while it cools down", dep,
                                 registry=r)
        self.upstream_fallbacks = Counter("tokenyard_upstream_fallbacks",
                                          "Requests moved to a fallback engine, by the engine left and why",
                                          ("engine", "reason"), registry=r)
        self.admission: Callable[[], dict[str, tuple[list[int], float]]] = dict
        self.desired_replicas: Callable[[], dict[str, int]] = dict    # admission's, set by the gateway
        r.register(_EngineCollector(engines))
        r.register(_AdmissionCollector(lambda: self.admission(), lambda: self.desired_replicas()))

    def count_request(self, engine: str, status: int | str, route_reason: str) -> None:
        self.requests.labels(engine or "none", str(status), route_reason or "none").inc()

    def count_spend(self, record: Any) -> None:
        """A usage sink: the request's cost into the spend counter (what the ledger has, as a rate)."""
        self.spend.labels(record.engine).inc(record.cost_micros)

    def count_slo(self, engine: str, ttft_s: float, max_itl_s: float) -> None:
        ttft_ok, itl_ok = ttft_s <= self.slo_ttft_s, max_itl_s <= self.slo_itl_s
        outcome = "met" if ttft_ok and itl_ok else "ttft_missed" if itl_ok else "itl_missed" if ttft_ok \
            else "both_missed"
        self.slo.labels(engine, outcome).inc()
        counts = self.slo_counts.setdefault(engine, [0, 0])
        counts[0] += outcome == "met"
        counts[1] += 1

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
        busy = CounterMetricFamily("tokenyard_engine_busy_seconds",
                                   "Seconds the engine spent in steps (its rate is the busy fraction)", labels=["engine"])
        prefill = CounterMetricFamily("tokenyard_engine_prefill_tokens", "Prompt tokens the engine computed",
                                      labels=["engine"])
        output = CounterMetricFamily("tokenyard_engine_output_tokens", "Output tokens the engine emitted",
                                     labels=["engine"])
        batch = HistogramMetricFamily("tokenyard_engine_batch_size", "Sequences per engine step", labels=["engine"])
        accept = GaugeMetricFamily("tokenyard_engine_spec_acceptance_ratio",
                                   "Accepted / proposed draft tokens (engines with speculation)", labels=["engine"])
        kv_block = GaugeMetricFamily("tokenyard_engine_kv_bytes_per_block",
                                     "Bytes of one KV-cache block (all layers, K and V, scales) in the stored dtype",
                                     labels=["engine", "dtype"])
        startup = GaugeMetricFamily("tokenyard_engine_startup_seconds",
                                    "Seconds building each in-process engine took, per phase (weights_read, "
                                    "quantise_pack, kv_allocation, compile, other)", labels=["engine", "phase"])
        closed = CounterMetricFamily("tokenyard_engine_grammar_closed",
                                     "Constrained replies the engine's grammar_close_reserve ended (the JSON closed "
                                     "before max_tokens)", labels=["engine"])
        families = [running, waiting, kv, hit, pre, fail, restarts, busy, prefill, output, batch, accept, kv_block,
                    startup, closed]
        for name, eng in self._engines().items():
            for phase, seconds in (getattr(eng, "startup_phases", None) or {}).items():
                startup.add_metric([name, phase], seconds)
            s = eng.stats()
            running.add_metric([name], s.num_running)
            waiting.add_metric([name], s.num_waiting)
            kv.add_metric([name], s.kv_usage)
            hit.add_metric([name], s.prefix_cache_hit_rate)
            pre.add_metric([name], s.num_preemptions)
            closed.add_metric([name], s.num_grammar_closed)
            fail.add_metric([name], eng.num_failed_steps)
            restarts.add_metric([name], getattr(eng, "num_restarts", 0))
            busy.add_metric([name], s.busy_seconds)
            prefill.add_metric([name], s.prefill_tokens)
            output.add_metric([name], s.output_tokens)
            if s.batch_size_counts:
                cumulative, buckets = 0, []
                for bound, n in zip([*map(str, BATCH_BUCKETS), "+Inf"], s.batch_size_counts):
                    cumulative += n
                    buckets.append((bound, cumulative))
                # The sum is not kept; a step's size is at most its bucket's bound (an upper bound).
                batch.add_metric([name], buckets, sum_value=sum(
                    b * n for b, n in zip([*BATCH_BUCKETS, BATCH_BUCKETS[-1]], s.batch_size_counts)))
            if s.spec_proposer is not None:
                accept.add_metric([name], s.spec_acceptance_rate)
            if s.kv_bytes_per_block:   # 0: the engine does not report it (mock, older replica)
                kv_block.add_metric([name, s.kv_cache_dtype], s.kv_bytes_per_block)
        return families + list(device_families())


class _AdmissionCollector(Collector):
    """Queue depth per engine and class, the predicted wait of a new request and the desired replicas,
    at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, tuple[list[int], float]]],
                 desired: Callable[[], dict[str, int]]) -> None:
        self._snapshot = snapshot
        self._desired = desired

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
        desired = GaugeMetricFamily("tokenyard_engine_desired_replicas",
                                    "Replicas the engine should run, from queue, KV occupancy and predicted wait "
                                    "with lead time and scale-down hysteresis (what the autoscaler scales on)",
                                    labels=["engine"])
        for name, n in self._desired().items():
            desired.add_metric([name], n)
        return [depth, wait, desired]
