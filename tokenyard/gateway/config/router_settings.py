"""The deployment's `router:` section: its keys and their parsing (issue 52, item 1: apart from the
learned router itself, so that reading a deployment file imports neither numpy nor the router's model
code: `tokenyard engine serve` reads one before it starts its engine core, and every 0.1 s there is
time to ready)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from tokenyard.gateway.routing.decision import RouterSettings
from tokenyard.policies.adapter_access import ADAPTER_NAME

# The keys of the deployment's `router:` section (deployment.KNOWN_KEYS lists them for the docs test).
ROUTER_KEYS = frozenset({"artifact", "target_large_share", "threshold", "small", "large", "quality_target", "cost_cap",
                         "engines"})


def parse_router_settings(data: Any, base_dir: Path, engines: Mapping[str, Any]) -> RouterSettings:
    """The `router:` section of the deployment file; errors name the key path."""
    if data is None:
        return RouterSettings()
    if not isinstance(data, dict):
        raise ValueError("router must be a mapping")
    extra = set(data) - ROUTER_KEYS
    if extra:
        raise ValueError(f"router: unknown keys {', '.join(sorted(map(str, extra)))}")
    out = RouterSettings(deployment_engines=list(engines))
    if data.get("artifact") is not None:
        if not isinstance(data["artifact"], str):
            raise ValueError("router.artifact must be a path")
        path = Path(data["artifact"])
        out.artifact = path if path.is_absolute() else (base_dir / path).resolve()
    for key in ("target_large_share", "threshold", "quality_target", "cost_cap"):
        value = data.get(key)
        if value is None:
            continue
        top = None if key == "cost_cap" else 1
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
                or (top is not None and value > top)):
            raise ValueError(f"router.{key} must be a number in [0, 1], got {value!r}" if top is not None
                             else f"router.{key} must be a number >= 0, got {value!r}")
        setattr(out, key, float(value))
    if out.target_large_share is not None and out.threshold is not None:
        raise ValueError("router: set target_large_share or threshold, not both")
    if out.quality_target is not None and out.cost_cap is not None:
        raise ValueError("router: set quality_target or cost_cap, not both")
    if data.get("engines") is not None:
        names = data["engines"]
        if not isinstance(names, list) or len(names) < 2 or not all(isinstance(n, str) for n in names):
            raise ValueError("router.engines must be a list of at least two engine names")
        # ENGINE:ADAPTER routes to one of an engine's LoRA adapters (loaded at start-up or at run time)
        unknown = [n for n in names if n.partition(":")[0] not in engines
                   or (":" in n and not ADAPTER_NAME.match(n.partition(":")[2]))]
        if unknown:
            raise ValueError(f"router.engines names {', '.join(map(repr, unknown))}, not under engines "
                             f"(an engine name, or ENGINE:ADAPTER of one)")
        if len(set(names)) != len(names):
            raise ValueError("router.engines lists an engine twice")
        out.engines = list(names)
    for key in ("small", "large"):
        value = data.get(key)
        if value is not None and value not in engines:
            raise ValueError(f"router.{key} names engine {value!r}, which is not under engines")
        setattr(out, key, value)
    return out
