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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_FILE = Path(__file__).resolve().parent.parent / "deploy" / "default.yaml"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ENGINE_TYPES = ("torch", "mock")


class DeploymentError(ValueError):
    """The deployment file is missing, unreadable or has a bad key; the message names it."""


@dataclass(slots=True)
class Prices:
    """Integer micro-units of currency per million tokens (1_000_000 = one unit per 1M tokens)."""

    input: int = 0
    cached_input: int = 0
    output: int = 0

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """Cost of one request in micro-units, rounded half up once over the exact total."""
        total = ((prompt_tokens - cached_tokens) * self.input + cached_tokens * self.cached_input
                 + completion_tokens * self.output)
        return (total + 500_000) // 1_000_000


@dataclass(slots=True)
class EngineSpec:
    name: str
    type: str                     # "torch" or "mock"
    model: Path                   # checkpoint folder (mock: where its tokenizer comes from)
    options: dict[str, Any]       # EngineConfig / MockConfig keys
    prices: Prices


@dataclass(slots=True)
class Limits:
    max_body_bytes: int = 1 << 20          # 413 above this
    max_json_depth: int = 32               # 400 above this nesting of objects/arrays
    max_messages: int = 1024
    default_max_tokens: int = 1024         # when a request sets neither max_tokens nor max_completion_tokens
    stream_buffer_bytes: int = 256 << 10   # unsent SSE bytes per stream before it is cut as a slow reader
    stream_write_timeout_s: float = 30.0   # one write blocked longer than this cuts the stream


@dataclass(slots=True)
class Routing:
    """Interim rule for model "auto" (until the trained router): short prompts to `small`."""

    small: str | None = None
    large: str | None = None
    long_prompt_tokens: int = 256          # prompts with more tokens than this go to `large`


@dataclass(slots=True)
class Deployment:
    host: str = "127.0.0.1"
    port: int = 8000
    drain_grace_s: float = 30.0
    access_log: bool = True
    redis_url: str | None = None           # None: start an embedded redis-server
    redis_dir: Path = Path(".tokenyard/redis")
    dev_key: str | None = None             # None: TOKENYARD_DEV_KEY, else a random key printed at start
    limits: Limits = field(default_factory=Limits)
    routing: Routing = field(default_factory=Routing)
    engines: dict[str, EngineSpec] = field(default_factory=dict)


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
    _only(top, "", {"server", "redis_url", "redis_dir", "auth", "limits", "routing", "engines"})
    dep = Deployment()
    server = _mapping(top.get("server", {}), "server")
    _only(server, "server.", {"host", "port", "drain_grace_s", "access_log"})
    dep.host = _typed(server, "server.", "host", str, dep.host)
    dep.port = _typed(server, "server.", "port", int, dep.port)
    if not 0 <= dep.port <= 65535:
        raise DeploymentError(f"server.port must be in 0..65535, got {dep.port}")
    dep.drain_grace_s = _number(server, "server.", "drain_grace_s", dep.drain_grace_s)
    dep.access_log = _typed(server, "server.", "access_log", bool, dep.access_log)
    dep.redis_url = _typed(top, "", "redis_url", str, None, nullable=True)
    dep.redis_dir = _path(_typed(top, "", "redis_dir", str, str(dep.redis_dir)), base)
    auth = _mapping(top.get("auth", {}), "auth")
    _only(auth, "auth.", {"dev_key"})
    dep.dev_key = _typed(auth, "auth.", "dev_key", str, None, nullable=True)
    limits = _mapping(top.get("limits", {}), "limits")
    _only(limits, "limits.", set(Limits.__slots__))
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
    _only(routing, "routing.", {"small", "large", "long_prompt_tokens"})
    for key in ("small", "large"):
        value = _typed(routing, "routing.", key, str, None, nullable=True)
        if value is not None and value not in dep.engines:
            raise DeploymentError(f"routing.{key} names engine {value!r}, which is not under engines")
        setattr(dep.routing, key, value)
    dep.routing.long_prompt_tokens = _typed(routing, "routing.", "long_prompt_tokens", int,
                                            dep.routing.long_prompt_tokens)
    return dep


def apply_env(dep: Deployment, env: dict[str, str] | None = None) -> Deployment:
    """REDIS_URL and TOKENYARD_DEV_KEY from the environment win over the file."""
    env = os.environ if env is None else env
    if env.get("REDIS_URL"):
        dep.redis_url = env["REDIS_URL"]
    if env.get("TOKENYARD_DEV_KEY"):
        dep.dev_key = env["TOKENYARD_DEV_KEY"]
    return dep


def _engine(name: str, spec: Any, base: Path) -> EngineSpec:
    where = f"engines.{name}"
    if not _NAME.match(name) or name == "auto":
        raise DeploymentError(f"{where}: engine names are 1-64 of A-Z a-z 0-9 . _ - and not 'auto'")
    spec = dict(_mapping(spec, where))
    kind = spec.pop("type", "torch")
    if kind not in ENGINE_TYPES:
        raise DeploymentError(f"{where}.type must be one of {', '.join(ENGINE_TYPES)}, got {kind!r}")
    model = spec.pop("model", None)
    if not isinstance(model, str) or not model:
        raise DeploymentError(f"{where}.model must be a checkpoint folder path")
    model_dir = _path(model, base)
    if not model_dir.is_dir():
        raise DeploymentError(f"{where}.model: {model_dir} is not a folder")
    prices_raw = _mapping(spec.pop("prices", {}), f"{where}.prices")
    _only(prices_raw, f"{where}.prices.", {"input", "cached_input", "output"})
    prices = Prices()
    for key in ("input", "cached_input", "output"):
        value = _typed(prices_raw, f"{where}.prices.", key, int, 0)
        if value < 0:
            raise DeploymentError(f"{where}.prices.{key} must be an integer >= 0 (micro-units per million tokens)")
        setattr(prices, key, value)
    try:  # validate the engine keys now, before anything loads
        if kind == "torch":
            from engines.config import EngineConfig
            EngineConfig.from_options(dict(spec))
        else:
            from engines.mock_engine import MockConfig
            MockConfig.from_options(dict(spec))
    except (TypeError, ValueError) as e:
        raise DeploymentError(f"{where}: {e}") from e
    return EngineSpec(name, kind, model_dir, spec, prices)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DeploymentError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _only(section: dict[str, Any], prefix: str, known: set[str]) -> None:
    unknown = sorted(str(k) for k in section if k not in known)
    if unknown:
        raise DeploymentError(f"unknown key(s) {', '.join(prefix + k for k in unknown)}; known: "
                              f"{', '.join(sorted(prefix + k for k in known))}")


def _typed(section: dict[str, Any], prefix: str, key: str, kind: type, default: Any, nullable: bool = False) -> Any:
    if key not in section:
        return default
    value = section[key]
    if value is None and nullable:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DeploymentError(f"{prefix}{key} must be {'a' if kind is not int else 'an'} {kind.__name__}"
                              f"{' or null' if nullable else ''}, got {value!r}")
    return value


def _number(section: dict[str, Any], prefix: str, key: str, default: float) -> float:
    value = section.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise DeploymentError(f"{prefix}{key} must be a number > 0, got {value!r}")
    return float(value)


def _path(value: str, base: Path) -> Path:
    p = Path(value).expanduser()
    return (p if p.is_absolute() else base / p).resolve()
