"""Workers on other "nodes" outlive engines: one `python -m tokenyard.engines.pp.stage_worker` process (the
torch.distributed environment over loopback, no --once) serves engine after engine that rank 0
builds in the same process on the same MASTER_PORT (each engine a new generation in rank 0's
store); when it is killed mid-stream the engine fails naming it, and a restarted worker (a pod
restart) joins the next engine."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.engine_helpers import run_to_completion
from tests.engines.test_pipeline_faults import OPTS, REPO, _free_port
from tokenyard.engines import Engine, SamplingParams


@pytest.mark.timeout(180)
def test_worker_rejoins_rebuilt_engines_and_a_restarted_worker_joins(checkpoint_dir, monkeypatch, tmp_path):
    path = checkpoint_dir("llama")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    log = open(tmp_path / "worker.log", "w")

    def start_worker() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tokenyard.engines.pp.stage_worker", "--timeout", "60"],
                                env={**os.environ, **env, "RANK": "1", "OMP_NUM_THREADS": "1"}, cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT)

    for k, v in {**env, "RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    short = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    worker = start_worker()
    try:
        outputs = []
        for _ in range(3):   # three engines in a row, the same worker process
            eng = Engine(path, pipeline_parallel_size=2, **OPTS)
            try:
                eng.add_request("a", [5, 6, 7, 8], short)
                outputs.append(run_to_completion(eng)["a"])
            finally:
                eng.close()
        assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) == 5
        assert worker.poll() is None   # still serving

        eng = Engine(path, pipeline_parallel_size=2, **OPTS)
        try:
            eng.add_request("b", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
            for _ in range(4):
                eng.step()
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            t0 = time.monotonic()
            done = []
            while eng.has_unfinished():
                done += [o for o in eng.step() if o.finished]
            assert time.monotonic() - t0 < 20
            assert done[0].finish_reason == "error" and "pipeline stage 1 (rank 1)" in done[0].error, done
        finally:
            eng.close()

        worker = start_worker()   # the pod restarts
        eng = Engine(path, pipeline_parallel_size=2, **OPTS)
        try:
            eng.add_request("c", [5, 6, 7, 8], short)
            assert run_to_completion(eng)["c"] == outputs[0]
        finally:
            eng.close()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        log.close()
