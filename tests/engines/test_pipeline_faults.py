"""Pipeline faults and separate nodes.

- A stage killed mid-stream: every in-flight request fails with an error naming the stage, well
  before tp_timeout_s; the engine refuses new work; a new engine serves.
- A stage that hangs (stopped, sockets open): the engine gives up after tp_timeout_s.
- "Separate nodes": rank 1 started on its own as `python -m tokenyard.engines.pp.stage_worker --once` with
  the torch.distributed environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK) over loopback,
  and the engine (rank 0) meeting it there instead of spawning: same greedy tokens as one process,
  as a pipeline stage (P=2) and as a tensor-parallel rank (TP=2).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine_helpers import random_prompts, run_to_completion
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.core.errors import EngineDeadError

OPTS = dict(dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=64, progress=False, tp_timeout_s=30.0)
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_killed_stage_fails_requests_then_restart_serves(checkpoint_dir):
    path = checkpoint_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    eng = Engine(path, pipeline_parallel_size=2, **OPTS)
    try:
        for i, p in enumerate(random_prompts(4, 5, 20, 512, seed=71)):
            eng.add_request(f"r{i}", p, params)
        for _ in range(6):
            eng.step()
        assert eng.micro.num_in_flight >= 1
        stage = eng.runner.workers.procs[1]
        os.kill(stage.pid, signal.SIGKILL)
        t0 = time.monotonic()
        finished = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out
            assert time.monotonic() - t0 < 20, "in-flight requests did not fail within 20 s"
        assert set(finished) == {"r0", "r1", "r2", "r3"}
        assert all(o.finish_reason == "error" and "pipeline stage 1 (rank 1)" in o.error
                   for o in finished.values()), finished
        assert eng.dead is not None and "pipeline stage 1" in eng.dead
        with pytest.raises(EngineDeadError, match="start a new one"):
            eng.add_request("late", [1, 2, 3], params)
    finally:
        eng.close()
    fresh = Engine(path, pipeline_parallel_size=2, **OPTS)
    try:
        fresh.add_request("again", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(run_to_completion(fresh)["again"]) == 4
    finally:
        fresh.close()


@pytest.mark.timeout(120)
def test_hung_stage_fails_requests_after_the_timeout(checkpoint_dir):
    """A stage that stops answering (SIGSTOP: alive, sockets open) is declared dead once a reply
    takes longer than tp_timeout_s, rather than hanging the engine."""
    eng = Engine(checkpoint_dir("llama"), pipeline_parallel_size=2, **OPTS)
    stage = eng.runner.workers.procs[1]
    try:
        # Lowered after start-up (which under load alone can take longer than this).
        eng.runner.timeout_s = 3.0
        eng.add_request("r0", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        for _ in range(4):
            eng.step()
        os.kill(stage.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        finished = []
        while eng.has_unfinished():
            finished += [o for o in eng.step() if o.finished]
        elapsed = time.monotonic() - t0
        assert 2.5 < elapsed < 20, elapsed
        assert finished[0].finish_reason == "error" and "pipeline stage 1 (rank 1)" in finished[0].error, finished
        assert eng.dead is not None
    finally:
        if stage.is_alive():
            os.kill(stage.pid, signal.SIGKILL)
        eng.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 1)])
def test_ranks_meet_through_the_torch_distributed_environment(checkpoint_dir, monkeypatch, tp, pp):
    path = checkpoint_dir("llama")
    prompts = random_prompts(3, 4, 30, 512, seed=72)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    single = Engine(path, **OPTS)
    for i, p in enumerate(prompts):
        single.add_request(f"r{i}", p, params)
    want = run_to_completion(single)

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    node2 = subprocess.Popen([sys.executable, "-m", "tokenyard.engines.pp.stage_worker", "--once", "--timeout", "60"],
                             env={**os.environ, **env, "RANK": "1", "OMP_NUM_THREADS": "1"}, cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for k, v in {**env, "RANK": "0"}.items():
            monkeypatch.setenv(k, v)
        eng = Engine(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **OPTS)
        try:
            assert eng.runner.workers.remote and not eng.runner.workers.procs   # nothing spawned
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, params)
            assert run_to_completion(eng) == want
        finally:
            eng.close()
        assert node2.wait(timeout=30) == 0, node2.stdout.read()
    finally:
        if node2.poll() is None:
            node2.kill()
            node2.wait()


def test_incomplete_environment_is_an_error(checkpoint_dir, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="MASTER_ADDR, WORLD_SIZE set but MASTER_PORT, RANK missing"):
        Engine(checkpoint_dir("llama"), pipeline_parallel_size=2, **OPTS)
