"""Engine failure: an exception inside the step loop (mock engine) and a killed tensor-parallel
worker (torch engine, tensor_parallel_size=2, tiny random checkpoint). In-flight requests end
with a clean error (SSE error event / 500 JSON error, never a hang or a trace), the engine is
rebuilt (AsyncEngine restart), later requests succeed, and /metrics counts failures and restarts.
A replacement that cannot be built is retried with backoff a bounded number of times, then the
engine stays down (503, /health "down")."""
from __future__ import annotations

import asyncio
import json

import pytest
from reliability_common import MODEL, explain, full_run_selected
from reliability_failures import run_step_exceptions, run_tp_worker_kills, tp_checkpoint

from tokenyard.engines.core.errors import EngineDeadError
from tokenyard.engines.runtime.async_engine import AsyncEngine
from tokenyard.engines.serving.mock_engine import MockEngine


def test_step_exception_fails_in_flight_cleanly_and_engine_restarts():
    report = run_step_exceptions(2)
    assert not report.problems, explain(report)


@pytest.mark.timeout(240)
def test_killed_tensor_parallel_worker_restarts_engine(tmp_path_factory):
    report = run_tp_worker_kills(1, tp_checkpoint(tmp_path_factory.mktemp("tp")))
    assert not report.problems, explain(report)
    print(report.figures)


def test_restart_attempts_are_bounded_with_backoff():
    """A factory that keeps failing: bounded attempts with growing waits, then the engine stays dead."""
    calls: list[float] = []

    def factory():
        calls.append(1)
        raise RuntimeError("cannot load weights")

    async def main():
        eng = MockEngine(MODEL, token_ms=2, output_len=50)
        ae = AsyncEngine(eng, "m", factory=factory, max_restart_attempts=3, restart_backoff_s=0.01)
        await ae.start()
        eng.step = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
        stream = ae.add_request("r1", [1, 2, 3], {"max_tokens": 10})
        out = await asyncio.wait_for(stream.get(), 5)
        assert out.finish_reason == "error" and "boom" in out.error
        for _ in range(200):
            if ae.dead and "restart attempts failed" in ae.dead:
                break
            await asyncio.sleep(0.01)
        assert ae.dead and "3 restart attempts failed" in ae.dead, ae.dead
        assert (ae.num_restarts, ae.num_failed_restarts) == (0, 3)
        with pytest.raises(EngineDeadError):
            ae.add_request("r2", [1, 2, 3], {"max_tokens": 10})
        await ae.stop()

    asyncio.run(main())
    assert len(calls) == 3


def test_engine_without_factory_keeps_old_behaviour():
    """No factory (engines built by hand): no restart; a transient step failure fails only its requests."""
    async def main():
        eng = MockEngine(MODEL, token_ms=1, output_len=5)
        ae = AsyncEngine(eng, "m")
        await ae.start()
        original = eng.step
        eng.step = lambda: (_ for _ in ()).throw(RuntimeError("once"))
        out = await asyncio.wait_for(ae.add_request("a", [1, 2], {"max_tokens": 3}).get(), 5)
        assert out.finish_reason == "error"
        eng.step = original
        outs = [o async for o in ae.add_request("b", [1, 2], {"max_tokens": 3})]
        assert outs[-1].finish_reason == "length" and ae.num_restarts == 0 and ae.dead is None
        await ae.stop()

    asyncio.run(main())


@pytest.mark.reliability
@pytest.mark.timeout(1800)
def test_engine_failures_full(request, tmp_path_factory):
    if not full_run_selected(request.config):
        pytest.skip("full size: pytest -m reliability")
    for report in (run_step_exceptions(20), run_tp_worker_kills(3, tp_checkpoint(tmp_path_factory.mktemp("tp")))):
        assert not report.problems, explain(report)
        print(json.dumps(report.figures))
