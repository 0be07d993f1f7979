"""A pipeline stage killed behind the gateway (torch engine, pipeline_parallel_size=2, tiny random
checkpoint): in-flight requests end with a clean error (SSE error event / JSON error, no hang),
the gateway's restart logic builds a new engine (new stage processes), the next request is
served, and no KV block leaks. The same harness as the tensor-parallel worker kill."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
from gateway_helpers import running_gateway
from reliability_common import Report, check_idle, explain
from reliability_failures import _clean_errors, _in_flight_then, _wait_restarts, tp_checkpoint


@pytest.mark.timeout(240)
def test_killed_pipeline_stage_restarts_engine_behind_the_gateway(tmp_path_factory):
    checkpoint = tp_checkpoint(tmp_path_factory.mktemp("pp"))
    report = Report("pipeline stage killed")
    doc = {"server": {"access_log": False},
           "engines": {"pp": {"type": "torch", "model": str(checkpoint), "pipeline_parallel_size": 2,
                              "dtype": "float32", "kv_cache_memory": 4 << 20, "max_num_batched_tokens": 64,
                              "tp_timeout_s": 30.0}}}
    with running_gateway(doc) as srv:
        stage = srv.engine("pp").engine.runner.workers.procs[1]

        def kill() -> None:
            os.kill(stage.pid, signal.SIGKILL)

        results = asyncio.run(_in_flight_then(srv.port, "pp", 2, 1, 400, kill, after_events=2))
        clean = _clean_errors(results, report)
        report.check(clean == len(results) == 3, f"{clean}/{len(results)} in-flight requests failed cleanly")
        _wait_restarts(srv, "pp", 1, 90)
        report.check(not stage.is_alive(), "the killed stage is alive")
        fresh = srv.engine("pp").engine
        report.check(fresh.runner.workers.procs[1].pid != stage.pid, "the restarted engine kept the dead stage")
        status, _, body = srv.chat({"model": "pp", "max_tokens": 6, "temperature": 0,
                                    "messages": [{"role": "user", "content": "after the restart"}]})
        report.check(status == 200 and body["usage"]["completion_tokens"] >= 1, f"after restart: {status} {body}")
        check_idle(srv, report, "pp")
    assert not report.problems, explain(report)
