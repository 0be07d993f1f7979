"""Deployment keys of an engine served by several replicas.

    engines:
      demo-large:
        type: torch
        model: ../models/demo-large          # the gateway still reads its tokenizer from here
        replicas:
          - url: http://engine-0.engines:9000      # `tokenyard engine serve --engine demo-large`
          - url: http://engine-1.engines:9000
          - local: true                            # one in-process replica as well (optional)
        replica_pool: {policy: cache_aware, health_interval_s: 2}

Without `replicas` the engine runs in-process exactly as before. Every key is in the README.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlparse

from tokenyard.gateway.config.disagg_config import DisaggConfig, parse_disagg

POLICIES = ("cache_aware", "least_loaded", "round_robin")


@dataclass(slots=True)
class ReplicaSpec:
    url: str | None = None        # a remote replica (http://host:port); None: in-process
    local: bool = False
    role: str = "both"            # prefill | decode | both: its part in disaggregated serving (docs/kv_transfer.md)


@dataclass(slots=True)
class PoolConfig:
    policy: str = "cache_aware"           # cache_aware | least_loaded | round_robin
    affinity_blocks: int = 32             # leading prompt blocks hashed for prefix affinity
    affinity_index_size: int = 16384      # prefix hashes remembered per replica (LRU)
    affinity_weight: float = 16.0         # a full prefix match is worth this many queued requests
    kv_weight: float = 4.0                # a full KV cache costs this many queued requests
    health_interval_s: float = 1.0        # GET /health of each remote replica this often
    health_timeout_s: float = 1.0         # a health check slower than this fails
    stats_interval_s: float = 0.25        # GET /v1/engine/stats of each remote replica this often
    eject_after_failures: int = 2         # consecutive failures (checks or requests) before ejection
    readmit_after_successes: int = 2      # consecutive good checks before an ejected replica returns
    max_attempts: int = 2                 # replicas tried for one request (only before its first token)
    connect_timeout_s: float = 2.0        # connecting to a replica for a request
    max_model_len: int = 0                # before any replica answered (0: 4096); replicas' own value wins


@dataclass(slots=True)
class ReplicaSet:
    replicas: list[ReplicaSpec] = field(default_factory=list)
    pool: PoolConfig = field(default_factory=PoolConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)

    @property
    def disaggregated(self) -> bool:
        """A replica of role prefill and one of role decode: served by gateway/backends/disaggregated.py."""
        roles = {r.role for r in self.replicas}
        return "prefill" in roles and "decode" in roles


def parse_replica_keys(spec: dict[str, Any], where: str, error: type[Exception]) -> ReplicaSet | None:
    """Pop `replicas` and `replica_pool` from an engine's mapping; None when it has no `replicas`."""
    raw = spec.pop("replicas", None)
    pool_raw = spec.pop("replica_pool", None)
    disagg_raw = spec.pop("disaggregation", None)
    if raw is None:
        if pool_raw is not None:
            raise error(f"{where}.replica_pool needs {where}.replicas")
        if disagg_raw is not None:
            raise error(f"{where}.disaggregation needs {where}.replicas")
        return None
    if not isinstance(raw, list) or not raw:
        raise error(f"{where}.replicas must be a non-empty list of {{url: ...}} or {{local: true}}")
    out = ReplicaSet()
    seen: set[str] = set()
    for i, item in enumerate(raw):
        at = f"{where}.replicas[{i}]"
        if isinstance(item, str):
            item = {"url": item}
        role = item.get("role", "both") if isinstance(item, dict) else "both"
        if isinstance(item, dict) and "role" in item:
            if role not in ("prefill", "decode", "both"):
                raise error(f"{at}.role must be one of prefill, decode, both, got {role!r}")
            if "url" not in item:
                raise error(f"{at}.role: only a remote replica ({{url: ...}}) takes a role")
            item = {k: v for k, v in item.items() if k != "role"}
        if not isinstance(item, dict) or set(item) - {"url", "local"} or len(item) != 1:
            raise error(f"{at} must be {{url: http://host:port}} (role: prefill|decode|both optional) or "
                        f"{{local: true}}, got {item!r}")
        if "local" in item:
            if item["local"] is not True:
                raise error(f"{at}.local must be true")
            if any(r.local for r in out.replicas):
                raise error(f"{at}: at most one local replica per engine")
            out.replicas.append(ReplicaSpec(local=True))
            continue
        url = item["url"]
        parsed = urlparse(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname or \
                parsed.path not in ("", "/"):
            raise error(f"{at}.url must be http(s)://host:port, got {url!r}")
        url = url.rstrip("/")
        if url in seen:
            raise error(f"{at}.url {url} is listed twice")
        seen.add(url)
        out.replicas.append(ReplicaSpec(url=url, role=role))
    if pool_raw is not None:
        if not isinstance(pool_raw, dict):
            raise error(f"{where}.replica_pool must be a mapping")
        _pool(pool_raw, f"{where}.replica_pool", out.pool, error)
    out.disagg = parse_disagg(disagg_raw, f"{where}.disaggregation", error)
    roles = [r.role for r in out.replicas]
    if ("prefill" in roles) != ("decode" in roles):
        raise error(f"{where}.replicas: disaggregated serving needs a replica of role prefill and one of role "
                    f"decode (got roles {', '.join(sorted(set(roles)))})")
    return out


def _pool(raw: dict[str, Any], where: str, cfg: PoolConfig, error: type[Exception]) -> None:
    known = {f.name: f for f in fields(PoolConfig)}
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise error(f"unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}; known: "
                    f"{', '.join(sorted(f'{where}.{k}' for k in known))}")
    for key, value in raw.items():
        default = getattr(cfg, key)
        if key == "policy":
            if value not in POLICIES:
                raise error(f"{where}.policy must be one of {', '.join(POLICIES)}, got {value!r}")
        elif isinstance(default, int) and not isinstance(default, bool):
            floor = 0 if key == "max_model_len" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < floor:
                raise error(f"{where}.{key} must be an integer >= {floor}, got {value!r}")
        else:
            ok_min = 0 if key.endswith("_weight") else 1e-9
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < ok_min:
                raise error(f"{where}.{key} must be a number {'>= 0' if ok_min == 0 else '> 0'}, got {value!r}")
            value = float(value)
        setattr(cfg, key, value)
