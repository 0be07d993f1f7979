"""Loading and unloading an engine's LoRA adapters at run time, whatever kind of backend serves it.

    info = await load_adapter(handle.engine, "sql", "/adapters/sql")   # every replica, or the one engine
    await unload_adapter(handle.engine, "sql")
    names = adapters_of(handle.engine)                                  # what requests may name now

An in-process engine (AsyncEngine) and one stepped in a child process (EngineProcess) load it between
two steps; a replica pool loads it on every replica (a remote one through POST /v1/engine/adapters/load
of tokenyard/engines/serving/replica_server.py) and is all or nothing: when one replica refuses, those
that had loaded it unload it again and the first refusal is the answer. An unload goes to every replica
that holds the adapter; one with requests still using it refuses (409) and keeps it, the others drop it.

Failures come back as AdapterControlError with the HTTP status and error code the admin API answers
(the engine's kinds: tokenyard/engines/lora/adapter_errors.py).
"""
from __future__ import annotations

import asyncio
from typing import Any

from tokenyard.engines.core.errors import EngineDeadError
from tokenyard.engines.lora.adapter_errors import STATUS, error_kind
from tokenyard.gateway.backends.remote_engine import RemoteEngine
from tokenyard.gateway.backends.replica_pool import ReplicaPool

CONTROL_TIMEOUT_S = 60.0     # a remote replica reads the adapter from its disk and answers
CODES = {"invalid": "invalid_adapter", "unsupported": "adapters_not_supported", "not_found": "adapter_not_found",
         "conflict": "adapter_conflict"}


class AdapterControlError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def _error(kind: str, message: str, where: str = "") -> AdapterControlError:
    param = {"invalid": "path", "conflict": "name", "not_found": "name"}.get(kind)
    return AdapterControlError(STATUS.get(kind, 400), CODES.get(kind, "invalid_adapter"),
                               f"{where}{message}", param)


def _members(engine: Any) -> list[tuple[str, Any]]:
    if isinstance(engine, ReplicaPool):
        return [(r.label, r.engine) for r in engine.replicas]
    return [("", engine)]


def adapters_of(engine: Any) -> list[str]:
    """The adapters a request may name on this engine now (a pool: any replica's)."""
    names: set[str] = set()
    for _, member in _members(engine):
        names.update(member.stats().lora_names)
    return sorted(names)


async def _call(label: str, member: Any, op: str, name: str, path: str | None) -> Any:
    where = f"replica {label}: " if label else ""
    if isinstance(member, RemoteEngine):
        body = {"name": name, "path": path} if op == "load" else {"name": name}
        status, doc = await member.control(f"adapters/{op}", body, CONTROL_TIMEOUT_S)
        if status == 200:
            await member.refresh_stats()       # its lora_names now, for the replica choice
            return doc
        if status in (0, 503):
            raise AdapterControlError(503, "replica_down", where + str(doc.get("error", "unreachable")))
        kind = doc.get("code") if doc.get("code") in STATUS else {404: "not_found", 409: "conflict"}.get(status, "invalid")
        raise _error(kind, str(doc.get("error", "")), where)
    fn = getattr(member, f"{op}_adapter", None)
    if fn is None:
        raise _error("unsupported", f"engine {getattr(member, 'name', '')} cannot load or unload LoRA adapters "
                                    "(only tokenyard's own engines serve adapters)", where)
    try:
        return await (fn(name, path) if op == "load" else fn(name))
    except EngineDeadError as e:
        raise AdapterControlError(503, "engine_unavailable", where + str(e)) from None
    except Exception as e:  # noqa: BLE001 - adapter errors map to their status; the rest is the adapter's fault
        found = error_kind(e)
        if found is None:
            raise _error("invalid", f"{type(e).__name__}: {e}", where) from None
        raise _error(*found, where) from None


async def load_adapter(engine: Any, name: str, path: str) -> dict[str, Any]:
    """Load on the engine (every replica of a pool); all or nothing. Returns the engine's answer
    (a pool: the first replica's, with "replicas": their labels)."""
    members = _members(engine)
    results = await asyncio.gather(*(_call(label, m, "load", name, path) for label, m in members),
                                   return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if not failed:
        info = dict(results[0]) if isinstance(results[0], dict) else {}
        if len(members) > 1:
            info["replicas"] = [label for label, _ in members]
        return info
    # undo where it worked, so every replica serves the same set of adapters
    await asyncio.gather(*(_call(label, m, "unload", name, None) for (label, m), r in zip(members, results)
                           if not isinstance(r, BaseException)), return_exceptions=True)
    first = failed[0]
    if isinstance(first, AdapterControlError):
        raise first
    raise AdapterControlError(400, "invalid_adapter", f"{type(first).__name__}: {first}", "path")


async def unload_adapter(engine: Any, name: str) -> None:
    """Unload from every member that holds it; AdapterControlError (404 none holds it, 409 requests still
    use it on some member: those members keep it)."""
    every = _members(engine)
    # a remote replica's stats may be a poll old: ask it anyway (a 404 from one that lacks it is no failure)
    members = [(label, m) for label, m in every
               if len(every) == 1 or isinstance(m, RemoteEngine) or name in m.stats().lora_names]
    if not members:
        raise _error("not_found", f"no LoRA adapter {name!r} on this engine")
    results = await asyncio.gather(*(_call(label, m, "unload", name, None) for label, m in members),
                                   return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    serious = [r for r in failed if not (isinstance(r, AdapterControlError) and r.status == 404)]
    if serious or len(failed) == len(results):
        first = (serious or failed)[0]
        if isinstance(first, AdapterControlError):
            raise first
        raise AdapterControlError(400, "invalid_adapter", f"{type(first).__name__}: {first}", "name")
