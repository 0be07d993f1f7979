"""Sleep levels of an engine (a warm pool: a replica kept loaded without paying for all its memory).

    level 0   awake
    level 1   the KV cache is freed (and the prefix cache with it); the weights stay in memory
    level 2   the weights are dropped as well; waking reloads them the way the engine loads them at
              start (the checkpoint, through whatever cache the load path has)

An engine only sleeps when it has nothing in flight: the caller drains it first (AsyncEngine.sleep
waits for the requests running to finish, up to a timeout), so no request ever loses its KV.
A request that arrives while the engine sleeps is queued and wakes it; none is refused for it.

States, as the replica reports them and the gateway's metrics count them: "awake", "asleep",
"waking" (a wake is under way; requests wait for it).
"""
from __future__ import annotations

from tokenyard.engines.core.errors import EngineError, RequestError

SLEEP_LEVELS = (1, 2)
AWAKE, ASLEEP, WAKING = "awake", "asleep", "waking"


class SleepLevelError(RequestError):
    """A sleep level that is not 1 or 2 (the HTTP edges answer 400 naming `level`)."""


class SleepUnsupported(EngineError, ValueError):
    """This engine cannot sleep (tensor or pipeline parallel, speculative decoding)."""


class SleepBusy(EngineError, RuntimeError):
    """The engine still had requests in flight when the drain timeout ran out (HTTP 409)."""


def check_sleep_level(value: object) -> int:
    """The level as an int, or SleepLevelError naming what was given."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in SLEEP_LEVELS:
        raise SleepLevelError(f"level must be 1 (free the KV cache) or 2 (also drop the weights), got {value!r}")
    return value
