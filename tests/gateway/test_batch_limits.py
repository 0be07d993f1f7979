"""The adaptive cap on batch lines in flight (tokenyard/gateway/batch/adaptive_limit.py): it halves while the
event loop lags past batch.max_loop_lag_ms, never below one line, and grows back when the loop is
on time; the idle-capacity gate (idle_capacity.py) keeps batch lines out of a busy engine; and the
disk storage (file_storage.py) never writes outside its folder, whatever the tenant's name."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from tokenyard.gateway.batch.adaptive_limit import AdaptiveLimit
from tokenyard.gateway.batch.idle_capacity import IdleCapacity


def test_limit_halves_while_the_loop_lags_and_recovers():
    async def scenario() -> tuple[float, float, float]:
        limit = AdaptiveLimit(maximum=16, max_lag_s=0.002)
        limit.start()
        await asyncio.sleep(0.25)
        calm = limit.limit
        end = time.monotonic() + 0.8
        while time.monotonic() < end:       # hog the loop: every sample wakes ~5 ms late
            time.sleep(0.005)
            await asyncio.sleep(0)
        lagging = limit.limit
        await asyncio.sleep(1.0)            # on time again: +1 per 100 ms
        recovered = limit.limit
        await limit.stop()
        return calm, lagging, recovered

    calm, lagging, recovered = asyncio.run(scenario())
    assert calm > lagging                   # 16 on an idle machine (a loaded one may have lagged already)
    assert lagging == 1.0                   # 16 -> 8 -> 4 -> 2 -> 1, then held at one line
    assert recovered > lagging


def test_acquire_waits_for_a_free_place_and_off_means_the_maximum():
    async def scenario() -> bool:
        limit = AdaptiveLimit(maximum=2, max_lag_s=0)
        limit.start()                       # max_lag_s 0: no sampling, the limit stays 2
        await limit.acquire()
        await limit.acquire()
        third = asyncio.get_running_loop().create_task(limit.acquire())
        await asyncio.sleep(0.05)
        waiting = not third.done()
        limit.release()
        await asyncio.wait_for(third, 1)
        return waiting and limit.running == 2 and limit.limit == 2

    assert asyncio.run(scenario())


def _queue(running: int, queued: int, free: int, total: int = 100, slots: int = 10) -> SimpleNamespace:
    stats = SimpleNamespace(num_free_blocks=free, num_total_blocks=total)
    return SimpleNamespace(queue=[None] * queued, running=running, slots=slots,
                           engine=SimpleNamespace(stats=lambda: stats))


def test_idle_capacity_rules():
    admission = SimpleNamespace(queues={})
    cap = IdleCapacity(admission, idle_share=0.5, bulk_engines={"bulk"})
    admission.queues["e"] = _queue(running=4, queued=0, free=90)
    assert cap.has_room("e")                                    # 5 of 10 slots with this line
    admission.queues["e"] = _queue(running=5, queued=0, free=90)
    assert not cap.has_room("e")                                # a 6th would pass half the slots
    admission.queues["e"] = _queue(running=0, queued=1, free=100)
    assert not cap.has_room("e")                                # someone waits in the queue
    admission.queues["e"] = _queue(running=1, queued=0, free=40)
    assert not cap.has_room("e")                                # 60 % of the KV blocks in use
    admission.queues["bulk"] = _queue(running=9, queued=0, free=5)
    assert cap.has_room("bulk")                                 # a bulk engine is used to the full
    admission.queues["bulk"] = _queue(running=10, queued=0, free=5)
    assert not cap.has_room("bulk")


def test_disk_storage_stays_inside_its_folder(tmp_path):
    import pytest

    from tokenyard.gateway.batch.file_storage import DiskStorage
    root = tmp_path / "data"
    disk = DiskStorage(root)
    for tenant in ("acme", "..", ".", ".hidden"):
        assert disk.put(tenant, "file-1", [b"a", b"bc"]) == 3
        with disk.open(tenant, "file-1") as f:
            assert f.read() == b"abc"
    assert sorted(p.name for p in root.iterdir()) == ["_.", "_..", "_.hidden", "acme"]
    assert not (tmp_path / "file-1").exists()
    for tenant, file_id in (("a/b", "file-1"), ("acme", "../x"), ("acme", ".tmp")):
        with pytest.raises(ValueError):
            disk.put(tenant, file_id, [b"x"])
    disk.delete("acme", "file-1")
    assert not (root / "acme" / "file-1").exists()
    assert list((root / "acme").iterdir()) == []      # no temporary file left behind


def test_a_waiting_acquire_gives_up_when_told():
    """A cancelled batch waiting for a slot that another batch's lines hold stops waiting at once."""
    async def scenario() -> tuple[bool, float, int]:
        limit = AdaptiveLimit(maximum=1, max_lag_s=0)
        assert await limit.acquire()
        stop = {"now": False}
        waiter = asyncio.get_running_loop().create_task(limit.acquire(lambda: stop["now"]))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        t0 = time.monotonic()
        stop["now"] = True
        got = await asyncio.wait_for(waiter, 1)
        return got, time.monotonic() - t0, limit.running

    got, waited_s, running = asyncio.run(scenario())
    assert got is False and running == 1 and waited_s < 0.5     # no slot taken; the holder keeps its one
