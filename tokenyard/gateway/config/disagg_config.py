"""Deployment keys of disaggregated serving: `engines.NAME.disaggregation` (docs/kv_transfer.md).

    engines:
      smollm2:
        type: torch
        model: ...
        replicas:
          - {url: http://127.0.0.1:9001, role: prefill}    # tokenyard engine serve --role prefill
          - {url: http://127.0.0.1:9002, role: decode}     # tokenyard engine serve --role decode
        disaggregation: {kv_transport: auto, min_prompt_tokens: 64}

A pool with a prefill and a decode replica is served by gateway/backends/disaggregated.py (engine_pool.py
builds it instead of a ReplicaPool); replicas of role both (the default) stay the colocated fallback.
Every key has a row in docs/deployment.md.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

KV_TRANSPORTS = ("auto", "shm", "tcp")


@dataclass(slots=True)
class DisaggConfig:
    kv_transport: str = "auto"          # auto: shm when both replicas' URLs name the same host, else tcp
    min_prompt_tokens: int = 64         # shorter prompts go straight to a decode replica (no hand-over)
    prefill_timeout_s: float = 300.0    # the prefill replica's whole answer (prefill, export, hand-over)
    first_token_timeout_s: float = 120.0  # the decode replica's first output after the hand-over
    max_prefill_attempts: int = 2       # prefill replicas tried before the decode replica computes it all


def parse_disagg(raw: Any, where: str, error: type[Exception]) -> DisaggConfig:
    cfg = DisaggConfig()
    if raw is None:
        return cfg
    if not isinstance(raw, dict):
        raise error(f"{where} must be a mapping")
    known = {f.name for f in fields(DisaggConfig)}
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise error(f"unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}; known: "
                    f"{', '.join(sorted(f'{where}.{k}' for k in known))}")
    for key, value in raw.items():
        if key == "kv_transport":
            if value not in KV_TRANSPORTS:
                raise error(f"{where}.kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {value!r}")
        elif isinstance(getattr(cfg, key), int) and not isinstance(getattr(cfg, key), bool) \
                and not isinstance(getattr(cfg, key), float):
            floor = 0 if key == "min_prompt_tokens" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < floor:
                raise error(f"{where}.{key} must be an integer >= {floor}, got {value!r}")
        else:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise error(f"{where}.{key} must be a number of seconds > 0, got {value!r}")
            value = float(value)
        setattr(cfg, key, value)
    return cfg
