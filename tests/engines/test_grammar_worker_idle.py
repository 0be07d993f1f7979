"""The grammar worker starts in the idle scheduling class (its seconds of start-up take only CPU the
engine leaves) and leaves it once ready, or as soon as a check waits for it: an idle-class process gets
no CPU while the engine keeps the cores busy, and a check has a time budget."""
from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from tokenyard.engines.runtime.grammar_worker import GrammarBudget, GrammarWorker, set_idle

ROOT = Path(__file__).resolve().parents[2]
FINE = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="scheduling classes are Linux's")


def _policy(worker: GrammarWorker) -> int:
    assert worker._proc is not None
    return os.sched_getscheduler(worker._proc.pid)


def test_set_idle_moves_a_process_in_and_out_of_the_idle_class():
    import subprocess
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert set_idle(proc.pid, True) and os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        assert set_idle(proc.pid, False) and os.sched_getscheduler(proc.pid) == os.SCHED_OTHER
    finally:
        proc.kill()
        proc.wait()
    assert not set_idle(proc.pid, True)      # gone: refused, not raised


def test_the_worker_starts_idle_and_leaves_the_idle_class_when_ready():
    async def run() -> None:
        worker = GrammarWorker(ROOT / "models" / "demo-small", GrammarBudget(time_s=60), name="t")
        try:
            await worker.start()
            assert _policy(worker) == os.SCHED_IDLE       # its imports and first compile: idle CPU only
            assert worker._ready is not None
            await asyncio.wait_for(asyncio.shield(worker._ready), 120)
            for _ in range(100):                          # the child switches itself just before it says ready
                if _policy(worker) == os.SCHED_OTHER:
                    break
                await asyncio.sleep(0.01)
            assert _policy(worker) == os.SCHED_OTHER
            await worker.check(FINE)
        finally:
            worker.close()
    asyncio.run(run())


def test_a_check_waiting_for_the_start_lifts_the_worker_at_once():
    async def run() -> None:
        worker = GrammarWorker(ROOT / "models" / "demo-small", GrammarBudget(time_s=60), name="t")
        try:
            await worker.start()
            assert _policy(worker) == os.SCHED_IDLE
            check = asyncio.create_task(worker.check(FINE))
            await asyncio.sleep(0)                        # the check runs up to its wait for ready
            assert _policy(worker) == os.SCHED_OTHER
            await asyncio.wait_for(check, 120)
        finally:
            worker.close()
    asyncio.run(run())
