"""What one request used, kept when it ends however it ends (finished, aborted, failed).

Issue 11 will persist these (Redis, exactly once by request id); for now a `UsageSink` is any
callable taking a record, and the default keeps the most recent ones in memory.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable


@dataclass(slots=True)
class UsageRecord:
    request_id: str
    time: float                    # unix seconds when the request arrived
    engine: str
    requested_model: str
    route_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_micros: int               # from the engine's prices, integer micro-units
    status: str                    # "ok", "client_disconnected", "slow_client", "error", "draining"
    finish_reason: str | None
    ttft_s: float | None
    e2e_s: float
    stream: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


UsageSink = Callable[[UsageRecord], None]


class RecentUsage:
    """The default sink: the last `size` records, newest last."""

    def __init__(self, size: int = 1000) -> None:
        self.records: deque[UsageRecord] = deque(maxlen=size)

    def __call__(self, record: UsageRecord) -> None:
        self.records.append(record)

    def find(self, request_id: str) -> UsageRecord | None:
        for rec in reversed(self.records):
            if rec.request_id == request_id:
                return rec
        return None
