"""Putting one replica of an engine to sleep and waking it (the admin API and `tokenyard engine sleep`).

    members = replicas_of(handle.engine)                 # a pool's replicas, or the lone engine as one
    await sleep_replica(members[0], level=1, drain_timeout_s=30)
    await wake_replica(members[0])

sleep: the pool stops choosing the replica while another is awake (`sleep_pending`), the replica
finishes the requests it has (up to drain_timeout_s; past it the sleep is refused and it stays
awake), then releases its KV cache (level 1) and its weights (level 2). A request that reaches it
asleep wakes it (tokenyard/gateway/backends/replica_pool.py decides when that happens). wake: at once,
answering when it serves again, with the seconds it took. Failures come back as ReplicaControlError
with the HTTP status and error code the admin API answers.
"""
from __future__ import annotations

from typing import Any

from tokenyard.engines.core.errors import EngineDeadError
from tokenyard.engines.core.sleep_level import SleepBusy, SleepUnsupported, check_sleep_level
from tokenyard.gateway.backends.replica_pool import Replica, ReplicaPool
from tokenyard.gateway.config.replica_config import PoolConfig

CONTROL_SLACK_S = 10.0        # beyond the drain timeout, for the replica to release its memory and answer
WAKE_TIMEOUT_S = 600.0        # a level-2 wake reloads the weights: a large model takes minutes


class ReplicaControlError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def replicas_of(engine: Any) -> list[Replica]:
    """A pool's replicas; any other engine as a single replica labelled "local"."""
    if isinstance(engine, ReplicaPool):
        return engine.replicas
    return [Replica("local", engine, PoolConfig(), remote=False)]


def describe(index: int, r: Replica) -> dict[str, Any]:
    return {"index": index, "replica": r.label, "state": r.state, "sleep_state": r.sleep_state,
            "sleep_level": r.sleep_level, "routable": r.routable,
            "can_sleep": r.remote or hasattr(r.engine, "sleep")}


async def sleep_replica(r: Replica, level: Any, drain_timeout_s: float) -> dict[str, Any]:
    try:
        level = check_sleep_level(level)
    except ValueError as e:
        raise ReplicaControlError(400, "invalid_sleep_level", str(e), "level") from None
    if not r.remote and not hasattr(r.engine, "sleep"):
        raise _unsupported(r)
    r.sleep_pending = True
    try:
        if r.remote:
            status, doc = await r.engine.control("sleep", {"level": level, "drain_timeout_s": drain_timeout_s},
                                                 drain_timeout_s + CONTROL_SLACK_S)
            if status != 200:
                raise _from_reply(r, status, doc)
            seconds = doc.get("seconds")
        else:
            try:
                seconds = await r.engine.sleep(level, drain_timeout_s)
            except SleepUnsupported as e:
                raise ReplicaControlError(409, "sleep_not_supported", f"replica {r.label}: {e}") from None
            except SleepBusy as e:
                raise ReplicaControlError(409, "replica_busy", f"replica {r.label}: {e}") from None
            except EngineDeadError as e:
                raise ReplicaControlError(503, "replica_down", f"replica {r.label}: {e}") from None
    finally:
        r.sleep_pending = False
    r.wake_sent = False
    return {"replica": r.label, "sleep_level": r.sleep_level, "sleep_state": r.sleep_state, "seconds": seconds}


async def wake_replica(r: Replica) -> dict[str, Any]:
    if r.remote:
        status, doc = await r.engine.control("wake", {}, WAKE_TIMEOUT_S)
        if status != 200:
            raise _from_reply(r, status, doc)
        seconds, phases = doc.get("seconds"), doc.get("phases") or {}
    else:
        if not hasattr(r.engine, "wake"):
            raise _unsupported(r)
        try:
            phases = await r.engine.wake()
        except Exception as e:  # noqa: BLE001 - the engine failed its requests and restarts or is dead
            raise ReplicaControlError(503, "replica_down", f"replica {r.label} failed while waking: "
                                                           f"{type(e).__name__}: {e}") from None
        seconds = r.engine.last_wake_s if phases else 0.0
    return {"replica": r.label, "sleep_level": r.sleep_level, "sleep_state": r.sleep_state, "seconds": seconds,
            "phases": phases}


def _unsupported(r: Replica) -> ReplicaControlError:
    return ReplicaControlError(409, "sleep_not_supported",
                               f"replica {r.label} cannot sleep (an upstream, or an engine "
                               f"without sleep support)")


def _from_reply(r: Replica, status: int, doc: dict[str, Any]) -> ReplicaControlError:
    """A remote replica's refusal as the admin API's answer (its message kept)."""
    message = f"replica {r.label}: {doc.get('error') or 'no answer'}"
    if status == 400:
        return ReplicaControlError(400, str(doc.get("code") or "invalid_sleep_level"), message,
                                   doc.get("param") or "level")
    if status == 409:
        return ReplicaControlError(409, str(doc.get("code") or "replica_busy"), message)
    return ReplicaControlError(503, "replica_down", message)
