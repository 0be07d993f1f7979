"""The waiting line in front of one engine: priority classes, weighted fair share between tenants.

Class 0 (interactive) is always served before class 1 (batch). Within a class, tenants share by
start-time fair queueing over tokens: each request costs the tokens it reserves (prompt +
max_tokens) divided by its tenant's weight (the policy's `tenants.NAME.weight`, default 1), and
gets a virtual start tag = max(the class's virtual time, the finish tag of its tenant's previous
request). The queue serves the smallest start tag first and advances the virtual time to it.

What that gives: while tenants are backlogged, each is served tokens in proportion to its weight
(weight 2 gets twice the tokens of weight 1, whatever the request sizes), and a tenant that was
idle re-enters at the current virtual time, so it cannot bank credit while away. When the class's
queue runs empty every tag is forgotten: with nobody waiting there is no share to keep, and a
tenant is not held back later for work it was served before the idle moment. With equal weights
and equal request sizes this is round robin, one request each. Removal is eager (the queue is
bounded and small), so the counts that wait prediction reads are exact.
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from tokenyard.policies.schema import PRIORITIES

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
    cost: int = 1                 # tokens it reserves: prompt + max_tokens
    weight: int = 1               # its tenant's share
    start: float = 0.0            # virtual start tag (set by push)
    finish: float = 0.0           # virtual finish tag = start + cost / weight


class _Class:
    """One priority class: per-tenant FIFOs and the virtual clock."""

    __slots__ = ("tenants", "finish", "vtime", "depth")

    def __init__(self) -> None:
        self.tenants: dict[str, deque[Waiter]] = {}
        self.finish: dict[str, float] = {}   # finish tag of each tenant's last queued (or served) request
        self.vtime = 0.0
        self.depth = 0

    def head(self) -> tuple[str, Waiter] | None:
        best: tuple[str, Waiter] | None = None
        for tenant, q in self.tenants.items():   # few tenants queue at once; a scan beats a heap's upkeep
            if best is None or q[0].start < best[1].start:
                best = (tenant, q[0])
        return best

    def settle(self) -> None:
        """After a removal: with nothing queued nobody is behind anybody, so every tag can go (a
        tenant is not held back for work done before an idle moment); else sweep idle tags."""
        if self.depth == 0:
            self.finish.clear()
        else:
            self.forget_idle()

    def forget_idle(self) -> None:
        # A tenant with nothing queued re-enters at the virtual time, so its old tag can go once the
        # clock has passed it (keeps the map as small as the set of recently active tenants). Swept
        # only when the map has grown well past the queued tenants: amortised O(1) per pop.
        if len(self.finish) <= 2 * len(self.tenants) + 64:
            return
        for t in [t for t, f in self.finish.items() if f <= self.vtime and t not in self.tenants]:
            del self.finish[t]


class FairQueue:
    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        self._classes = [_Class() for _ in range(num_classes)]

    def __len__(self) -> int:
        return sum(c.depth for c in self._classes)

    def depth(self, priority: int) -> int:
        return self._classes[priority].depth

    def push(self, w: Waiter) -> None:
        c = self._classes[w.priority]
        w.start = max(c.vtime, c.finish.get(w.tenant, 0.0))
        w.finish = w.start + max(1, w.cost) / max(1, w.weight)
        c.finish[w.tenant] = w.finish
        c.tenants.setdefault(w.tenant, deque()).append(w)
        c.depth += 1

    def peek(self) -> Waiter | None:
        for c in self._classes:
            found = c.head()
            if found is not None:
                return found[1]
        return None

    def pop(self) -> Waiter:
        for c in self._classes:
            found = c.head()
            if found is None:
                continue
            tenant, w = found
            q = c.tenants[tenant]
            q.popleft()
            if not q:
                del c.tenants[tenant]
            c.vtime = max(c.vtime, w.start)
            c.depth -= 1
            c.settle()
            return w
        raise IndexError("pop from an empty FairQueue")

    def remove(self, w: Waiter) -> bool:
        """Take a waiter out (deadline, client gone). Later requests of its tenant keep their tags:
        moving them up would let a tenant jump the line by queueing and cancelling."""
        c = self._classes[w.priority]
        q = c.tenants.get(w.tenant)
        if q is None:
            return False
        try:
            q.remove(w)
        except ValueError:
            return False
        if not q:
            del c.tenants[w.tenant]
            if c.finish.get(w.tenant) == w.finish:
                c.finish[w.tenant] = w.start    # its last request left: give back the share it held
        c.depth -= 1
        c.settle()
        return True

    def ahead(self, tenant: str, priority: int) -> int:
        """How many queued requests a new request of `tenant` in class
        `priority` would wait behind: every request of a more urgent class, and in its own class
        those whose start tag is not later than the tag it would get (each FIFO's tags rise, so
        each count stops at the first later tag)."""
        n = sum(c.depth for c in self._classes[:priority])
        c = self._classes[priority]
        start = max(c.vtime, c.finish.get(tenant, 0.0))
        for q in c.tenants.values():
            for w in q:
                if w.start > start:
                    break
                n += 1
        return n
