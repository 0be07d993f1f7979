"""The thread-safe hand-off between callers and an engine's step thread.

add_request and abort may be called from any thread (the gateway's event loop); they only put
messages here. The step thread takes them at the start of each step, so the scheduler's state
is touched by that thread alone. The inbox also knows which request ids are live (queued or
running), so a duplicate id is refused at once and has_unfinished needs no scheduler access.
"""
from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

from tokenyard.engines.core.errors import RequestError

T = TypeVar("T")


class RequestInbox(Generic[T]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new: list[T] = []
        self._aborts: list[str] = []
        self._live: dict[str, T] = {}

    def add(self, request_id: str, make: Callable[[], T]) -> T:
        """Queue `make()` under request_id; `make` runs under the lock (arrival order, seeds)."""
        with self._lock:
            if request_id in self._live:
                raise RequestError(f"request id {request_id!r} is already in use")
            item = make()
            self._live[request_id] = item
            self._new.append(item)
            return item

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def take(self) -> tuple[list[T], list[str]]:
        """What arrived since the last step: new requests and abort ids."""
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
        return new, aborts

    def get(self, request_id: str) -> T | None:
        with self._lock:
            return self._live.get(request_id)

    def done(self, request_id: str) -> None:
        """The request finished (or was aborted): its id may be used again."""
        with self._lock:
            self._live.pop(request_id, None)

    def clear(self) -> list[T]:
        """Forget everything (the engine failed); returns the requests that were live."""
        with self._lock:
            live = list(self._live.values())
            self._live.clear()
            self._new.clear()
        return live

    def unless_live(self, match: Callable[[T], bool], action: Callable[[], None]) -> int:
        """Run `action()` under the lock when no live request `match`es; else return how many do (and
        run nothing). Under the lock, so no add() slips in between the count and the action (a LoRA
        adapter is unloaded this way: engines compute a request's adapter inside `make`)."""
        with self._lock:
            busy = sum(1 for item in self._live.values() if match(item))
            if not busy:
                action()
            return busy

    @property
    def has_live(self) -> bool:
        with self._lock:
            return bool(self._live)

    @property
    def num_new(self) -> int:
        with self._lock:
            return len(self._new)
