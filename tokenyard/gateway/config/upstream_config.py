"""Deployment keys of an engine that is another OpenAI-compatible server (`type: openai`): a vLLM or
SGLang fleet, llama.cpp's llama-server, a second Tokenyard, or a hosted API.

    engines:
      big:
        type: openai
        base_urls: [http://10.0.0.5:8000/v1, http://10.0.0.6:8000/v1]   # one or more deployments
        upstream_model: meta-llama/Llama-3.1-70B-Instruct             # the name the upstream knows
        api_key_env: BIG_API_KEY                                      # or api_key_file; never the key itself
        prices: {input: 600000, cached_input: 300000, output: 900000}
        tokenizer: ../models/llama-3.1                                 # optional: exact prompt counts
        timeouts: {connect_s: 5, first_token_s: 60, between_tokens_s: 30}
        max_concurrency: 64                                           # per deployment

The key is read once at start-up and kept in a `Secret`, whose repr is a mask: it can reach no log
line, error, metric label or admin page by being printed. Every key is in docs/deployment.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

BALANCE = ("least_in_flight", "latency_ewma", "prefix_affinity")
FALLBACK_ON = ("error", "rate_limit", "context_length")
_HEADER_NAME = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_RESERVED_HEADERS = {"authorization", "content-type", "content-length", "host", "accept", "connection",
                     "transfer-encoding"}


class Secret:
    """A credential. str() and repr() never show it; `.value` is read only where it is sent."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


@dataclass(slots=True)
class UpstreamTimeouts:
    connect_s: float = 5.0            # TCP + TLS connect to one deployment
    first_token_s: float = 60.0       # request sent -> response head / first streamed event
    between_tokens_s: float = 30.0    # the longest silence inside a stream (and for a non-streamed body)
    total_s: float = 600.0            # one attempt, end to end


@dataclass(slots=True)
class UpstreamSpec:
    base_urls: list[str]                          # each ends in /v1 (or the server's OpenAI prefix)
    upstream_model: str
    api_key: Secret | None = None                 # from api_key_env / api_key_file; None: no Authorization
    headers: dict[str, str] = field(default_factory=dict)   # extra request headers (an org id, a route tag)
    timeouts: UpstreamTimeouts = field(default_factory=UpstreamTimeouts)
    max_concurrency: int = 64                     # requests in flight per deployment (the rest queue in admission)
    balance: str = "least_in_flight"              # least_in_flight | latency_ewma | prefix_affinity
    max_attempts: int = 3                         # deployments tried for one request, before its first token
    backoff_s: float = 0.05                       # pause before a retry, doubled each time, with jitter
    cooldown_s: float = 5.0                       # a failed deployment rests this long, then takes one trial request
    max_cooldown_s: float = 60.0                  # the rest doubles on each failed trial, up to this
    health_interval_s: float = 10.0               # GET <base_url>/models of every deployment this often
    max_model_len: int = 0                        # the context the gateway checks prompts against (0: the upstream's)
    embeddings: bool = False                      # /v1/embeddings for this engine goes to the upstream
    tokenizer: Path | None = None                 # counts prompts exactly; None: an estimate, reconciled after

    @property
    def labels(self) -> list[str]:
        """Each deployment's name in metrics, logs and records: host:port, never a path, query or key."""
        out = []
        for url in self.base_urls:
            p = urlparse(url)
            out.append(f"{p.hostname}:{p.port or (443 if p.scheme == 'https' else 80)}")
        return out


def parse_upstream(spec: dict[str, Any], where: str, base: Path, error: type[Exception],
                   model_path: Any, env: dict[str, str] | None = None) -> UpstreamSpec:
    """Pop an openai engine's keys from `spec` (what is left is an unknown key). model_path(value,
    where) resolves `tokenizer` like an engine's `model`."""
    env = os.environ if env is None else env
    urls = spec.pop("base_urls", None)
    one = spec.pop("base_url", None)
    if one is not None:
        if urls is not None:
            raise error(f"{where}: give base_url or base_urls, not both")
        urls = [one]
    if not isinstance(urls, list) or not urls:
        raise error(f"{where}.base_urls must be a non-empty list of http(s) URLs (e.g. http://10.0.0.5:8000/v1)")
    clean: list[str] = []
    for i, url in enumerate(urls):
        p = urlparse(url) if isinstance(url, str) else None
        if p is None or p.scheme not in ("http", "https") or not p.hostname or p.query or p.fragment \
                or p.username or p.password:
            raise error(f"{where}.base_urls[{i}] must be http(s)://host[:port]/path without credentials, "
                        f"query or fragment")
        url = url.rstrip("/")
        if url in clean:
            raise error(f"{where}.base_urls[{i}] is listed twice")
        clean.append(url)
    model = spec.pop("upstream_model", None)
    if not isinstance(model, str) or not model.strip():
        raise error(f"{where}.upstream_model must name the model as the upstream knows it")
    out = UpstreamSpec(base_urls=clean, upstream_model=model)
    out.api_key = _api_key(spec, where, base, error, env)
    headers = spec.pop("headers", {}) or {}
    if not isinstance(headers, dict):
        raise error(f"{where}.headers must be a mapping of header name to string value")
    for k, v in headers.items():
        if not isinstance(k, str) or not k or set(k) - _HEADER_NAME or not isinstance(v, str) \
                or any(c in v for c in "\r\n\0"):
            raise error(f"{where}.headers: {k!r} must be a header name with a one-line string value")
        if k.lower() in _RESERVED_HEADERS:
            raise error(f"{where}.headers.{k} is set by the gateway (the key goes in api_key_env or api_key_file)")
    out.headers = {str(k): str(v) for k, v in headers.items()}
    timeouts = spec.pop("timeouts", {}) or {}
    if not isinstance(timeouts, dict):
        raise error(f"{where}.timeouts must be a mapping")
    for k, v in timeouts.items():
        if k not in UpstreamTimeouts.__slots__:
            raise error(f"unknown key {where}.timeouts.{k}; known: {', '.join(UpstreamTimeouts.__slots__)}")
        setattr(out.timeouts, k, _positive(v, f"{where}.timeouts.{k}", error))
    for key in ("max_concurrency", "max_attempts"):
        if key in spec:
            setattr(out, key, _int(spec.pop(key), f"{where}.{key}", error, floor=1))
    if "max_model_len" in spec:
        out.max_model_len = _int(spec.pop("max_model_len"), f"{where}.max_model_len", error, floor=0)
    for key in ("backoff_s", "cooldown_s", "max_cooldown_s", "health_interval_s"):
        if key in spec:
            setattr(out, key, _positive(spec.pop(key), f"{where}.{key}", error))
    if out.max_cooldown_s < out.cooldown_s:
        raise error(f"{where}.max_cooldown_s must be >= cooldown_s")
    balance = spec.pop("balance", out.balance)
    if balance not in BALANCE:
        raise error(f"{where}.balance must be one of {', '.join(BALANCE)}, got {balance!r}")
    out.balance = balance
    emb = spec.pop("embeddings", False)
    if not isinstance(emb, bool):
        raise error(f"{where}.embeddings must be true or false")
    out.embeddings = emb
    tok = spec.pop("tokenizer", None)
    if tok is not None:
        if not isinstance(tok, str) or not tok:
            raise error(f"{where}.tokenizer must be a checkpoint folder, a .gguf file or package:<dist>/<file>")
        out.tokenizer = model_path(tok, f"{where}.tokenizer")
    return out


def _api_key(spec: dict[str, Any], where: str, base: Path, error: type[Exception],
             env: dict[str, str]) -> Secret | None:
    if "api_key" in spec:
        raise error(f"{where}.api_key: never write the key in the deployment file; name the environment "
                    f"variable that holds it (api_key_env) or a file (api_key_file)")
    var = spec.pop("api_key_env", None)
    path = spec.pop("api_key_file", None)
    if var is not None and path is not None:
        raise error(f"{where}: give api_key_env or api_key_file, not both")
    if var is not None:
        if not isinstance(var, str) or not var:
            raise error(f"{where}.api_key_env must name an environment variable")
        value = env.get(var, "").strip()
        if not value:
            raise error(f"{where}.api_key_env: the environment variable {var} is not set (or empty)")
        return Secret(value)
    if path is not None:
        if not isinstance(path, str) or not path:
            raise error(f"{where}.api_key_file must be a path")
        p = Path(path).expanduser()
        p = p if p.is_absolute() else base / p
        try:
            value = p.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise error(f"{where}.api_key_file: cannot read {p} ({type(e).__name__})") from None
        if not value or "\n" in value:
            raise error(f"{where}.api_key_file: {p} must hold the key alone, on one line")
        return Secret(value)
    return None


def _positive(value: Any, where: str, error: type[Exception]) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise error(f"{where} must be a number > 0, got {value!r}")
    return float(value)


def _int(value: Any, where: str, error: type[Exception], floor: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < floor:
        raise error(f"{where} must be an integer >= {floor}, got {value!r}")
    return value
