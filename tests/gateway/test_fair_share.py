"""Weighted fair share in the admission queue (tokenyard/gateway/admission/fair_queue.py), on its own.

Each test drives the queue the way an engine under saturation does: every tenant keeps requests
waiting, and the engine takes one request whenever one finishes. The tokens each tenant is served
are then compared with its weight.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from tokenyard.gateway.admission.fair_queue import FairQueue, Waiter


def _waiter(tenant: str, cost: int, weight: int = 1, priority: int = 0) -> Waiter:
    loop = asyncio.new_event_loop()
    try:
        fut = loop.create_future()
    finally:
        loop.close()
    return Waiter(tenant, priority, deadline=1e9, blocks=1, future=fut, cost=cost, weight=weight)


def _saturate(weights: dict[str, int], costs: dict[str, list[int]], serves: int, backlog: int = 4,
              seed: int = 0) -> dict[str, int]:
    """Serve `serves` requests while every tenant keeps `backlog` waiting; tokens served per tenant."""
    rng = random.Random(seed)
    q = FairQueue()
    served = dict.fromkeys(weights, 0)
    for tenant, w in weights.items():
        for _ in range(backlog):
            q.push(_waiter(tenant, rng.choice(costs[tenant]), w))
    for _ in range(serves):
        w = q.pop()
        served[w.tenant] += w.cost
        q.push(_waiter(w.tenant, rng.choice(costs[w.tenant]), weights[w.tenant]))   # it stays backlogged
    return served


def test_weight_two_gets_twice_the_tokens_within_ten_percent():
    costs = {"a": [100, 200, 300], "b": [100, 200, 300]}
    served = _saturate({"a": 2, "b": 1}, costs, serves=3000)
    ratio = served["a"] / served["b"]
    assert 1.8 <= ratio <= 2.2, served


def test_share_is_by_tokens_not_by_request_count():
    # b sends requests five times larger: with equal weights it gets about as many tokens, i.e.
    # about a fifth of the requests a gets (round robin by count would give it five times the tokens).
    served = _saturate({"a": 1, "b": 1}, {"a": [100], "b": [500]}, serves=3000)
    assert 0.9 <= served["a"] / served["b"] <= 1.1, served


def test_three_tenants_split_by_weight():
    costs = {t: [50, 80, 400] for t in "abc"}
    served = _saturate({"a": 1, "b": 2, "c": 5}, costs, serves=6000, seed=3)
    total = sum(served.values())
    for tenant, weight in (("a", 1), ("b", 2), ("c", 5)):
        assert abs(served[tenant] / total - weight / 8) <= 0.1 * weight / 8, served


def test_equal_weights_and_sizes_is_round_robin():
    q = FairQueue()
    for i in range(3):
        q.push(_waiter("noisy", 10))
    q.push(_waiter("quiet", 10))
    order = [q.pop().tenant for _ in range(4)]
    assert order == ["noisy", "quiet", "noisy", "noisy"]


def test_an_idle_tenant_banks_no_credit():
    # "late" was away while "busy" was served 50 requests; on return it alternates with busy
    # instead of being served 50 times in a row.
    q = FairQueue()
    for _ in range(60):
        q.push(_waiter("busy", 10))
    for _ in range(50):
        q.pop()
    for _ in range(5):
        q.push(_waiter("late", 10))
    order = [q.pop().tenant for _ in range(10)]
    assert order.count("late") == 5 and order.count("busy") == 5, order
    assert order[:2] in (["busy", "late"], ["late", "busy"]), order


def test_priority_classes_come_before_weights():
    q = FairQueue()
    q.push(_waiter("heavy", 10, weight=100, priority=1))
    q.push(_waiter("light", 10, weight=1, priority=0))
    assert q.pop().tenant == "light"
    assert q.depth(1) == 1 and len(q) == 1


def test_remove_keeps_counts_and_ahead_exact():
    q = FairQueue()
    ws = [_waiter("a", 10) for _ in range(3)] + [_waiter("b", 10)]
    for w in ws:
        q.push(w)
    # A new request of b gets tag 10 (after its own one, tag 0): behind a's tags 0 and 10 and its own.
    assert q.ahead("b", 0) == 3
    assert q.ahead("c", 0) == 2              # a newcomer starts at the current virtual time
    assert q.remove(ws[1]) and not q.remove(ws[1])
    assert len(q) == 3 and q.depth(0) == 3
    popped = [q.pop() for _ in range(3)]
    assert ws[1] not in popped and len(q) == 0
    with pytest.raises(IndexError):
        q.pop()


def test_removing_a_tenants_last_request_returns_its_share():
    # a queued one big request and withdrew it: its next request is not pushed behind the one it withdrew.
    q = FairQueue()
    q.push(_waiter("b", 10))
    big = _waiter("a", 10_000)
    q.push(big)
    q.remove(big)
    q.push(_waiter("a", 10))
    assert [q.pop().tenant for _ in range(2)] == ["b", "a"]
    assert q.ahead("a", 0) == 0


def test_tags_are_forgotten_when_the_queue_runs_empty():
    # Thousands of one-off tenants (each queued and served alone) leave no state behind, and a
    # tenant served a huge request before an idle moment is not held back after it.
    q = FairQueue()
    for i in range(5000):
        q.push(_waiter(f"t{i}", 10))
        q.pop()
    q.push(_waiter("big", 1_000_000))
    q.pop()
    q.push(_waiter("big", 10))
    q.push(_waiter("other", 10))
    assert [q.pop().tenant for _ in range(2)] == ["big", "other"]     # a tie, in arrival order
    assert len(q._classes[0].finish) == 0
