"""The waiting line in front of one engine: priority classes, round robin between tenants.

Class 0 (interactive) is always served before class 1 (batch). Within a class each tenant has
its own FIFO and tenants take turns, one request each (round robin by request count): a tenant
with a hundred requests queued delays another tenant's next request by at most one of its own
per turn, however early it queued them. Removal is eager (the queue is bounded and small), so
the counts that wait prediction reads are exact.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from policies.schema import PRIORITIES

NUM_CLASSES = len(PRIORITIES)


@dataclass(slots=True, eq=False)
class Waiter:
    """One queued request. `future` resolves when the engine has room for it."""

    tenant: str
    priority: int                 # 0 interactive, 1 batch
    deadline: float               # event-loop time by which it must have started
    blocks: int                   # KV blocks its prompt needs (for the room check)
    future: asyncio.Future
    enqueued: float = 0.0
    timer: asyncio.TimerHandle | None = field(default=None)


class FairQueue:
    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        # Per class: tenant -> its FIFO, in turn order (the first tenant goes next).
        self._classes: list[OrderedDict[str, deque[Waiter]]] = [OrderedDict() for _ in range(num_classes)]
        self._depth = [0] * num_classes

    def __len__(self) -> int:
        return sum(self._depth)

    def depth(self, priority: int) -> int:
        return self._depth[priority]

    def push(self, w: Waiter) -> None:
        turns = self._classes[w.priority]
        q = turns.get(w.tenant)
        if q is None:
            q = turns[w.tenant] = deque()    # a new tenant joins at the end of the turn order
        q.append(w)
        self._depth[w.priority] += 1

    def peek(self) -> Waiter | None:
        for turns in self._classes:
            if turns:
                return turns[next(iter(turns))][0]
        return None

    def pop(self) -> Waiter:
        for cls, turns in enumerate(self._classes):
            if turns:
                tenant = next(iter(turns))
                q = turns[tenant]
                w = q.popleft()
                if q:
                    turns.move_to_end(tenant)   # its next request waits for everyone else's turn
                else:
                    del turns[tenant]
                self._depth[cls] -= 1
                return w
        raise IndexError("pop from an empty FairQueue")

    def remove(self, w: Waiter) -> bool:
        turns = self._classes[w.priority]
        q = turns.get(w.tenant)
        if q is None:
            return False
        try:
            q.remove(w)
        except ValueError:
            return False
        if not q:
            del turns[w.tenant]
        self._depth[w.priority] -= 1
        return True

    def ahead(self, tenant: str, priority: int) -> int:
        """How many queued requests a new request of `tenant` in class `priority` would wait behind.

        Every request of a more urgent class, and under round robin, from each tenant of its own
        class, at most one more than the tenant itself has queued."""
        n = sum(self._depth[:priority])
        turns = self._classes[priority]
        own = len(turns.get(tenant, ()))
        for t, q in turns.items():
            n += own if t == tenant else min(len(q), own + 1)
        return n
