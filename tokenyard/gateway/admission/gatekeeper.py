"""The admission steps of one request, in order, and their undoing in reverse.

    p = await gatekeeper.enter(key_record, engine, prompt_tokens, max_tokens, deadline)  # 429 / 503
    ...                                      # the engine runs the request
    p.end(used_tokens)                       # or p.end(None) when it never ran

Order (docs/architecture.md, the request path): reserve limits, hold the budget, then admit. The
limit is reserved first so a tenant over its limits is told so (429 with its own retry hint)
instead of taking a queue place; a request that is then shed or expires in the queue gets its
whole reservation back, since it cost nothing. A request that ran gives back the tokens it did
not use (max_tokens it never reached).
The budget hold (tokenyard/gateway/spend/budget_hold.py: the worst-case cost against the policy's budgets)
is settled with the actual cost when the usage record is made (`p.billing(sink)` wraps the usage
sink), and released whole when the request never ran.
"""
from __future__ import annotations

import asyncio

from tokenyard.gateway.admission.engine_queues import Admission, Slot
from tokenyard.gateway.admission.rate_limiter import RateLimiter, Reservation
from tokenyard.gateway.admission.shedding import shed
from tokenyard.gateway.auth.api_keys import PRIORITIES, KeyRecord
from tokenyard.gateway.edge.errors import RateLimited
from tokenyard.gateway.spend.budget_hold import BudgetCharge, BudgetReached, Hold, refusal_message
from tokenyard.gateway.spend.usage import UsageRecord, UsageSink


class Pass:
    __slots__ = ("_limiter", "reservation", "slot", "_ended", "hold")

    def __init__(self, limiter: RateLimiter, reservation: Reservation, slot: Slot, hold: Hold | None = None) -> None:
        self._limiter = limiter
        self.reservation = reservation
        self.slot = slot
        self._ended = False
        self.hold = hold

    @property
    def headers(self) -> dict[str, str]:
        return self.reservation.headers

    def end(self, used_tokens: int | None) -> None:
        """Release the engine slot and refund what was not used; safe to call more than once."""
        if self._ended:
            return
        self._ended = True
        res = self.reservation
        self.slot.release(served=used_tokens is not None)
        if used_tokens is None:
            self._limiter.refund(res, requests=1, tokens=res.tokens)
            if self.hold is not None:
                self.hold.release()
        else:
            self._limiter.refund(res, tokens=res.tokens - used_tokens)

    def billing(self, sink: UsageSink) -> UsageSink:
        """The usage sink for this request: its record's cost settles the budget hold first."""
        if self.hold is None:
            return sink

        def settle_then(record: UsageRecord) -> None:
            self.hold.settle(record.cost_micros)
            sink(record)
        return settle_then


class Gatekeeper:
    def __init__(self, limiter: RateLimiter, admission: Admission) -> None:
        self.limiter = limiter
        self.admission = admission

    async def enter(self, rec: KeyRecord, engine: str, prompt_tokens: int, max_tokens: int,
                    deadline: float, priority: int | None = None, rate: tuple[int, int, int] | None = None,
                    budget: BudgetCharge | None = None) -> Pass:
        """priority (admission class index), rate (limits) and budget (the budgets to hold the
        worst-case cost against) come from the policy when it sets them."""
        res = await self.limiter.reserve(rec, prompt_tokens + max_tokens, engine, rate)
        hold = None
        try:
            if budget is not None:
                hold = await budget.reserve(prompt_tokens, max_tokens)
            slot = await self.admission.admit(rec, engine, prompt_tokens, deadline, priority, max_tokens)
        except BaseException as e:
            self.limiter.refund(res, requests=1, tokens=res.tokens)
            if hold is not None:
                hold.release()
            if isinstance(e, BudgetReached):
                err = RateLimited(refusal_message(rec.tenant, e), code="insufficient_quota", headers=res.headers)
                err.type = "insufficient_quota"
                raise err from None
            if hasattr(e, "headers"):
                e.headers = {**res.headers, **e.headers}
            raise
        if asyncio.get_running_loop().time() > deadline:
            # Granted in time, but the deadline passed before this task resumed: still never started.
            slot.release(served=False)
            self.limiter.refund(res, requests=1, tokens=res.tokens)
            if hold is not None:
                hold.release()
            self.admission.metrics.expired.labels(engine, PRIORITIES[slot.priority]).inc()
            raise shed("expired", engine, 0.001)
        return Pass(self.limiter, res, slot, hold)
