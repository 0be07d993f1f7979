"""Typed reads of YAML config sections with errors that name the key path, shared by the
deployment file (config/deployment.py) and its spend/dashboard sections (config/spend_settings.py).

Every function raises `error` (the caller's exception type) with the full key path.
"""
from __future__ import annotations

from collections.abc import Set
from typing import Any


def mapping(value: Any, where: str, error: type[Exception]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise error(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def only(section: dict[str, Any], prefix: str, known: Set[str], error: type[Exception]) -> None:
    unknown = sorted(str(k) for k in section if k not in known)
    if unknown:
        raise error(f"unknown key(s) {', '.join(prefix + k for k in unknown)}; known: "
                    f"{', '.join(sorted(prefix + k for k in known))}")


def typed(section: dict[str, Any], prefix: str, key: str, kind: type, default: Any, error: type[Exception],
          nullable: bool = False) -> Any:
    if key not in section:
        return default
    value = section[key]
    if value is None and nullable:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise error(f"{prefix}{key} must be {'an' if kind is int else 'a'} {kind.__name__}"
                    f"{' or null' if nullable else ''}, got {value!r}")
    return value


def choice(section: dict[str, Any], prefix: str, key: str, allowed: tuple[str, ...], default: str,
           error: type[Exception]) -> str:
    value = section.get(key, default)
    if value not in allowed:
        raise error(f"{prefix}{key} must be one of {', '.join(allowed)}, got {value!r}")
    return value
