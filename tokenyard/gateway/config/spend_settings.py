"""Deployment sections of the spend ledger, the dashboard and /metrics access.

    spend:      {enabled, baseline_engine, rollup_retention_days, stream_max_len, stream_retention_days,
                 spool_dir, spool_fsync, replay_interval_s, max_values_per_dimension, max_tag_names,
                 alerts: {enabled, interval_s, webhook_url, secret_env, timeout_s, lease_s, backoff_s,
                          max_backoff_s, max_attempts, stream_max_len}}
    dashboard:  {enabled, session_ttl_s, cookie_secure}
    metrics:    {access, slo_ttft_s, slo_itl_s}

Kept apart from deployment.py so that file stays about the engines and the request path; every
key is documented in the README ("Deployment file").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenyard.gateway.config.yaml_fields import choice as _choice
from tokenyard.gateway.config.yaml_fields import mapping as _mapping
from tokenyard.gateway.config.yaml_fields import only as _only
from tokenyard.gateway.config.yaml_fields import typed as _typed

FSYNC = ("always", "never")
COOKIE_SECURE = ("auto", "always", "never")
METRICS_ACCESS = ("loopback", "open", "admin")


@dataclass(slots=True)
class AlertsConfig:
    """Budget alerts (tokenyard/gateway/spend/alerts.py, alert_webhook.py): where they go and how hard to try."""

    enabled: bool = True                    # check new usage records against the policy's budgets, fire alerts
    interval_s: float = 5.0                 # how often new usage records are checked
    webhook_url: str | None = None          # POST every alert here (http or https); None: the alerts stream only
    secret_env: str = "TOKENYARD_ALERT_SECRET"   # environment variable holding the HMAC-SHA256 signing secret
    timeout_s: float = 10.0                 # one webhook POST, connect to last byte
    lease_s: float = 30.0                   # a claimed outbox item is nobody else's for this long (> timeout_s)
    backoff_s: float = 1.0                  # first retry after this, doubling (with jitter) ...
    max_backoff_s: float = 300.0            # ... up to this
    max_attempts: int = 20                  # then the alert moves to the dead-letter list
    stream_max_len: int = 10_000            # alerts kept on the alerts stream (XADD MAXLEN ~)


@dataclass(slots=True)
class SpendConfig:
    enabled: bool = True                    # write usage records to Redis (needs redis_url or the embedded Redis)
    baseline_engine: str | None = None      # savings are measured against this engine; None: routing.large, else
                                            # the engine with the highest output price
    rollup_retention_days: int = 400        # TTL of the hourly rollups (refreshed by every write to the hour)
    stream_max_len: int = 100_000           # per-tenant request stream, trimmed approximately (XADD MAXLEN ~)
    stream_retention_days: int = 30         # stream entries older than this are trimmed (XTRIM MINID ~);
                                            # also how long a request id is remembered for idempotency
    spool_dir: Path = Path(".tokenyard/spool")   # records wait here (JSONL) while Redis is unreachable
    spool_fsync: str = "always"             # "always": fsync after every append; "never": leave it to the OS
    replay_interval_s: float = 2.0          # how often a non-empty spool is retried against Redis
    max_values_per_dimension: int = 1000    # distinct keys / users / route reasons / values of one tag kept per
                                            # tenant and hour in the rollups; beyond, counted under "(other)"
    max_tag_names: int = 64                 # distinct metadata keys (tag:NAME dimensions) kept per tenant and hour;
                                            # a record's other tags count once, together, under tag:(other)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)


@dataclass(slots=True)
class DashboardConfig:
    enabled: bool = True
    session_ttl_s: int = 8 * 3600           # a signed-in session lasts this long (no sliding renewal)
    cookie_secure: str = "auto"             # "auto": Secure when the request came over https


@dataclass(slots=True)
class MetricsConfig:
    access: str = "loopback"                # who may GET /metrics: loopback clients (or admin keys), anyone, admins
    slo_ttft_s: float = 2.0                 # a request meets its SLO with TTFT at most this ...
    slo_itl_s: float = 0.25                 # ... and no gap between output tokens longer than this


@dataclass(slots=True)
class WebSettings:
    spend: SpendConfig = field(default_factory=SpendConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


def _alerts(section: dict[str, Any], error: type[Exception]) -> AlertsConfig:
    out, where = AlertsConfig(), "spend.alerts."
    _only(section, where, set(AlertsConfig.__slots__), error)
    out.enabled = _typed(section, where, "enabled", bool, out.enabled, error)
    out.webhook_url = _typed(section, where, "webhook_url", str, None, error, nullable=True)
    if out.webhook_url is not None and not out.webhook_url.startswith(("http://", "https://")):
        raise error(f"spend.alerts.webhook_url must be an http:// or https:// URL, got {out.webhook_url!r}")
    out.secret_env = _typed(section, where, "secret_env", str, out.secret_env, error)
    if not out.secret_env:
        raise error("spend.alerts.secret_env must name an environment variable")
    for key in ("interval_s", "timeout_s", "lease_s", "backoff_s", "max_backoff_s"):
        value = section.get(key, getattr(out, key))
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise error(f"spend.alerts.{key} must be a number > 0, got {value!r}")
        setattr(out, key, float(value))
    if out.lease_s <= out.timeout_s:
        raise error(f"spend.alerts.lease_s ({out.lease_s:g}) must be longer than spend.alerts.timeout_s "
                    f"({out.timeout_s:g}): a POST still running when its lease ends may be sent twice")
    for key in ("max_attempts", "stream_max_len"):
        value = _typed(section, where, key, int, getattr(out, key), error)
        if value <= 0:
            raise error(f"spend.alerts.{key} must be a positive integer, got {value}")
        setattr(out, key, value)
    return out


def parse_web_settings(top: dict[str, Any], base: Path, engines: list[str], error: type[Exception]) -> WebSettings:
    """The three sections from the parsed YAML document; `error` is DeploymentError (no import cycle)."""
    out = WebSettings()
    spend = _mapping(top.get("spend", {}), "spend", error)
    _only(spend, "spend.", set(SpendConfig.__slots__), error)
    sp = out.spend
    sp.enabled = _typed(spend, "spend.", "enabled", bool, sp.enabled, error)
    sp.baseline_engine = _typed(spend, "spend.", "baseline_engine", str, None, error, nullable=True)
    if sp.baseline_engine is not None and sp.baseline_engine not in engines:
        raise error(f"spend.baseline_engine names engine {sp.baseline_engine!r}, which is not under engines")
    for key in ("rollup_retention_days", "stream_max_len", "stream_retention_days", "max_values_per_dimension",
                "max_tag_names"):
        value = _typed(spend, "spend.", key, int, getattr(sp, key), error)
        if value <= 0:
            raise error(f"spend.{key} must be a positive integer, got {value}")
        setattr(sp, key, value)
    spool = _typed(spend, "spend.", "spool_dir", str, str(sp.spool_dir), error)
    p = Path(spool).expanduser()
    sp.spool_dir = (p if p.is_absolute() else base / p).resolve()
    sp.spool_fsync = _choice(spend, "spend.", "spool_fsync", FSYNC, sp.spool_fsync, error)
    interval = spend.get("replay_interval_s", sp.replay_interval_s)
    if not isinstance(interval, (int, float)) or isinstance(interval, bool) or interval <= 0:
        raise error(f"spend.replay_interval_s must be a number > 0, got {interval!r}")
    sp.replay_interval_s = float(interval)
    sp.alerts = _alerts(_mapping(spend.get("alerts", {}), "spend.alerts", error), error)

    dash = _mapping(top.get("dashboard", {}), "dashboard", error)
    _only(dash, "dashboard.", set(DashboardConfig.__slots__), error)
    out.dashboard.enabled = _typed(dash, "dashboard.", "enabled", bool, out.dashboard.enabled, error)
    ttl = _typed(dash, "dashboard.", "session_ttl_s", int, out.dashboard.session_ttl_s, error)
    if ttl <= 0:
        raise error(f"dashboard.session_ttl_s must be a positive integer, got {ttl}")
    out.dashboard.session_ttl_s = ttl
    out.dashboard.cookie_secure = _choice(dash, "dashboard.", "cookie_secure", COOKIE_SECURE,
                                          out.dashboard.cookie_secure, error)

    metrics = _mapping(top.get("metrics", {}), "metrics", error)
    _only(metrics, "metrics.", set(MetricsConfig.__slots__), error)
    out.metrics.access = _choice(metrics, "metrics.", "access", METRICS_ACCESS, out.metrics.access, error)
    for key in ("slo_ttft_s", "slo_itl_s"):
        value = metrics.get(key, getattr(out.metrics, key))
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise error(f"metrics.{key} must be a number of seconds > 0, got {value!r}")
        setattr(out.metrics, key, float(value))
    return out
