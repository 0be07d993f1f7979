"""Turning requests away early, politely: predicted wait, and the replies for each reason.

A request that would wait longer than its deadline is refused at once rather than queued to
time out: the client learns in a millisecond (with a Retry-After hint) instead of after its
whole deadline, and no engine work is spent on it.

Predicted wait = (requests ahead of it + 1) / (service rate - arrival rate of more urgent
classes). The service rate is the number of requests the engine runs at once divided by how long
one holds its slot (an EWMA of dispatch-to-end times, i.e. Little's law). A batch request is
also overtaken by every interactive request that arrives while it waits, so the interactive
arrival rate (admitted in the last second) is taken off the rate it is served at; when
interactive traffic alone fills the engine, batch requests are shed at once instead of queuing
to expire. Before the first request has finished there is no estimate, so nothing is shed on
prediction (the queue bound and deadlines still apply).

Reasons and replies:
    predicted_wait   503 engine_overloaded   the engine cannot start it before its deadline
    queue_full       503 queue_full          the engine's queue holds admission.max_queue
    tenant_concurrency 429 concurrency_limit_exceeded  the tenant has its cap of requests in flight
    expired          503 deadline_exceeded   the deadline passed while it was queued
"""
from __future__ import annotations

import math
import time
from collections import deque

from tokenyard.gateway.edge.errors import APIError, RateLimited, Unavailable, retry_headers


class ServiceRate:
    """How fast one engine frees room: EWMA of the time a request holds an engine slot."""

    __slots__ = ("alpha", "mean_s", "samples")

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.mean_s: float | None = None
        self.samples = 0

    def observe(self, held_s: float) -> None:
        self.samples += 1
        self.mean_s = held_s if self.mean_s is None else self.mean_s + self.alpha * (held_s - self.mean_s)

    def per_second(self, running: int) -> float | None:
        """Requests finished per second with `running` requests on the engine (None: unknown yet)."""
        if self.mean_s is None:
            return None
        return max(1, running) / max(self.mean_s, 1e-4)


class ArrivalRate:
    """Requests admitted (queued or started) per second over the last `window_s`."""

    __slots__ = ("window_s", "_times")

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque()

    def add(self) -> None:
        self._times.append(time.monotonic())

    def per_second(self) -> float:
        cutoff = time.monotonic() - self.window_s
        while self._times and self._times[0] < cutoff:
            self._times.popleft()
        return len(self._times) / self.window_s


class WindowedRate:
    """Events per second over a window of up to `max_window_s` seconds, in one-second buckets: O(1)
    memory and time per event whatever the rate (ArrivalRate keeps a timestamp per event)."""

    __slots__ = ("_counts", "_stamps")

    def __init__(self, max_window_s: int = 600) -> None:
        self._counts = [0] * max_window_s
        self._stamps = [-1] * max_window_s       # the second each bucket counts

    def add(self, now: float | None = None) -> None:
        sec = int(time.monotonic() if now is None else now)
        i = sec % len(self._counts)
        if self._stamps[i] != sec:
            self._stamps[i], self._counts[i] = sec, 0
        self._counts[i] += 1

    def per_second(self, window_s: float, now: float | None = None) -> float:
        """Mean rate over the last `window_s` whole seconds (the current, partial one included)."""
        sec = int(time.monotonic() if now is None else now)
        n = max(1, min(int(window_s), len(self._counts)))
        total = sum(c for c, t in zip(self._counts, self._stamps) if sec - n < t <= sec)
        return total / n


def predicted_wait(ahead: int, rate: float | None, overtaking_rate: float = 0.0) -> float:
    """Seconds until a new request starts; inf when more urgent arrivals alone use up the engine."""
    if rate is None:
        return 0.0
    left = rate - overtaking_rate
    return math.inf if left <= 0.05 * rate else (ahead + 1) / left


def shed(reason: str, engine: str, retry_s: float, detail: str = "") -> APIError:
    headers = retry_headers(retry_s)
    if reason == "tenant_concurrency":
        return RateLimited(f"Too many concurrent requests for this tenant{detail}; retry after "
                           f"{math.ceil(retry_s * 1000)} ms", code="concurrency_limit_exceeded", headers=headers)
    if reason == "queue_full":
        return Unavailable(f"Engine {engine} is overloaded: its queue is full{detail}", code="queue_full",
                           headers=headers)
    if reason == "expired":
        return Unavailable(f"The request's deadline passed while it waited for engine {engine}{detail}",
                           code="deadline_exceeded", headers=headers)
    return Unavailable(f"Engine {engine} is overloaded: the predicted wait exceeds the request's deadline{detail}",
                       code="engine_overloaded", headers=headers)
