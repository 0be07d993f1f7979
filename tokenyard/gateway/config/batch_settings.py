"""Deployment sections of the Batch API: where its files live, its limits, how hard it may run, and
the bulk pool.

    batch:  {enabled, data_dir, max_file_bytes, max_lines, max_in_flight, idle_share, start_gap_ms,
             max_loop_lag_ms, lease_s, poll_s}
    pools:  {bulk: {ENGINE: BULK_ENGINE, ...}}

Kept apart from deployment.py (which reads them through `parse_batch_settings`); every key is
documented in the README ("Deployment file").
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tokenyard.gateway.config.yaml_fields import mapping as _mapping
from tokenyard.gateway.config.yaml_fields import only as _only
from tokenyard.gateway.config.yaml_fields import typed as _typed


@dataclass(slots=True)
class BatchSettings:
    enabled: bool = True                    # serve /v1/files and /v1/batches (they need Redis)
    data_dir: Path = Path(".tokenyard/batch")   # uploaded, output and error files (one folder per tenant)
    max_file_bytes: int = 100 << 20         # an upload larger than this gets 413
    max_lines: int = 50_000                 # requests in one batch input file
    max_in_flight: int = 16                 # batch lines running at once in one gateway (all batches together)
    idle_share: float = 0.5                 # a line starts on a shared engine only while nothing waits in its
                                            # admission queue and fewer than this share of its slots and KV
                                            # blocks are in use (a bulk pool engine: all of them)
    start_gap_ms: float = 5.0               # at most one line start per engine this often (0: no spacing)
    max_loop_lag_ms: float = 2.0            # fewer lines at once while the event loop is later than this (0: off)
    lease_s: float = 30.0                   # a gateway's claim on a running batch; a restarted or other
                                            # gateway takes the batch over once the claim is this old
    poll_s: float = 1.0                     # how often a gateway looks for batches to run (new or orphaned)
    bulk: dict[str, str] = field(default_factory=dict)   # pools.bulk: engine -> the engine its batch lines run on

    @property
    def bulk_engines(self) -> set[str]:
        """Engines reserved for batch lines: interactive requests never run on them."""
        return set(self.bulk.values())


# `batch:`'s keys: every setting but the bulk pool, which is `pools.bulk`.
BATCH_KEYS = frozenset(f.name for f in fields(BatchSettings) if f.name != "bulk")
POOLS_KEYS = frozenset({"bulk"})


def parse_batch_settings(top: dict[str, Any], base: Path, engines: dict[str, Any],
                         error: type[Exception]) -> BatchSettings:
    """`batch:` and `pools:` of the deployment document. engines: the parsed EngineSpecs by name."""
    out = BatchSettings()
    section = _mapping(top.get("batch", {}), "batch", error)
    _only(section, "batch.", BATCH_KEYS, error)
    out.enabled = _typed(section, "batch.", "enabled", bool, out.enabled, error)
    data_dir = Path(_typed(section, "batch.", "data_dir", str, str(out.data_dir), error)).expanduser()
    out.data_dir = (data_dir if data_dir.is_absolute() else base / data_dir).resolve()
    for key in ("max_file_bytes", "max_lines", "max_in_flight"):
        value = _typed(section, "batch.", key, int, getattr(out, key), error)
        if value <= 0:
            raise error(f"batch.{key} must be a positive integer, got {value}")
        setattr(out, key, value)
    for key in ("idle_share", "lease_s", "poll_s"):
        value = section.get(key, getattr(out, key))
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise error(f"batch.{key} must be a number > 0, got {value!r}")
        setattr(out, key, float(value))
    for key in ("start_gap_ms", "max_loop_lag_ms"):
        value = section.get(key, getattr(out, key))
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise error(f"batch.{key} must be a number >= 0, got {value!r}")
        setattr(out, key, float(value))
    if out.idle_share > 1:
        raise error(f"batch.idle_share must be in (0, 1], got {out.idle_share}")
    out.bulk = _bulk_pool(top, engines, error)
    return out


def _bulk_pool(top: dict[str, Any], engines: dict[str, Any], error: type[Exception]) -> dict[str, str]:
    pools = _mapping(top.get("pools", {}), "pools", error)
    _only(pools, "pools.", POOLS_KEYS, error)
    bulk = _mapping(pools.get("bulk", {}), "pools.bulk", error)
    out: dict[str, str] = {}
    for source, target in bulk.items():
        where = f"pools.bulk.{source}"
        if source not in engines:
            raise error(f"{where}: {source!r} is not under engines")
        if not isinstance(target, str) or target not in engines:
            raise error(f"{where} must name an engine under engines, got {target!r}")
        if target == source or target in bulk:
            raise error(f"{where}: {target!r} cannot be both a routed engine and a bulk engine")
        # The line's prompt is tokenised with the routed engine's tokenizer: the bulk engine must be the same model.
        if engines[source].model != engines[target].model:
            raise error(f"{where}: {target!r} serves {engines[target].model}, not {source!r}'s model "
                        f"{engines[source].model}; a bulk engine runs the same model with its own settings")
        out[str(source)] = target
    return out
