"""`tokenyard serve` with server.workers: 2 (tokenyard/gateway/server/supervisor.py), mock engine: one engine
core shared by two worker processes; a worker killed is started again, a core killed is started again and
the workers link to it again; SIGTERM drains and leaves no process behind. Also the default rule for
which engines step in a process of their own (engine_pool.in_own_process)."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml
from gateway_helpers import ROOT, SHARED_REDIS, delete_prefix, unique_prefix

from tokenyard.gateway.backends.engine_pool import in_own_process
from tokenyard.gateway.config.deployment import DeploymentError, parse_deployment

DEMO = ROOT / "models" / "demo-small"


def test_auto_puts_torch_engines_in_a_process_embeddings_ones_too_and_keeps_mock_in():
    dep = parse_deployment({"engines": {
        "t": {"type": "torch", "model": str(DEMO)},
        "emb": {"type": "torch", "model": str(DEMO), "embeddings": True},
        "m": {"type": "mock", "model": str(DEMO)},
        "pool": {"type": "torch", "model": str(DEMO), "replicas": [{"url": "http://127.0.0.1:1"}]}}}, ROOT)
    auto = {n: in_own_process(s, dep.engine_process) for n, s in dep.engines.items()}
    assert dep.engine_process is None and auto == {"t": True, "emb": True, "m": False, "pool": False}
    assert {n: in_own_process(s, True) for n, s in dep.engines.items()} == {"t": True, "emb": True, "m": True,
                                                                             "pool": False}
    assert not any(in_own_process(s, False) for s in dep.engines.values())


def test_worker_stall_s_is_a_positive_number_of_seconds():
    engines = {"m": {"type": "mock", "model": str(DEMO)}}
    assert parse_deployment({"engines": engines}, ROOT).worker_stall_s == 30.0
    assert parse_deployment({"server": {"worker_stall_s": 2.5}, "engines": engines}, ROOT).worker_stall_s == 2.5
    for bad in (0, -1, "30", True):
        with pytest.raises(DeploymentError, match="server.worker_stall_s must be a number > 0"):
            parse_deployment({"server": {"worker_stall_s": bad}, "engines": engines}, ROOT)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chat(port: int, max_tokens: int = 4) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", "/v1/chat/completions",
                     json.dumps({"model": "mock", "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": max_tokens}),
                     {"Authorization": "Bearer workers-key", "Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _children(pid: int) -> tuple[list[int], list[int]]:
    lines = {}
    for p in psutil.Process(pid).children():
        try:
            lines[p.pid] = " ".join(p.cmdline())
        except psutil.Error:         # exited (a zombie until the supervisor reaps it)
            continue
    return ([p for p, line in lines.items() if "tokenyard.gateway.server.worker" in line],
            [p for p, line in lines.items() if "tokenyard.engines.serving.engine_core" in line])


def _wait(what, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_two_workers_share_one_core_survive_kills_and_drain(tmp_path):
    port = _free_port()
    prefix = unique_prefix("workers")
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(yaml.safe_dump({
        "server": {"host": "127.0.0.1", "port": port, "workers": 2, "drain_grace_s": 10, "access_log": False},
        "redis_prefix": prefix,
        "engines": {"mock": {"type": "mock", "model": str(DEMO), "token_ms": 2}}}))
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:6379", "TOKENYARD_DEV_KEY": "workers-key",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tokenyard.cli.main", "serve", "--config", str(cfg)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    everyone: set[int] = set()
    try:
        def ready() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            try:
                return _chat(port)[0] == 200
            except OSError:
                return False
        _wait(ready, 60)
        workers, cores = _children(proc.pid)
        assert len(workers) == 2 and len(cores) == 1
        everyone |= set(workers) | set(cores)
        # both workers are linked to the one core (plus its listening socket)
        _wait(lambda: len(psutil.Process(cores[0]).net_connections(kind="unix")) >= 3, 60)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: _chat(port), range(16)))
        assert all(s == 200 and b["usage"]["completion_tokens"] == 4 for s, b in results)

        os.kill(workers[0], signal.SIGKILL)                 # a worker dies: another takes its place
        fresh = _wait(lambda: (w := _children(proc.pid)[0]) and len(w) == 2 and workers[0] not in w and w)
        everyone |= set(fresh)
        os.kill(cores[0], signal.SIGKILL)                   # the core dies: started again, the workers relink
        new_core = _wait(lambda: (c := _children(proc.pid)[1]) and c[0] != cores[0] and c)
        everyone |= set(new_core)
        _wait(lambda: all(_chat(port)[0] == 200 for _ in range(4)), 60)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stderr.read().split("engine mock failed")[0]
        time.sleep(0.2)
        assert not [p for p in everyone if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in everyone:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        delete_prefix(SHARED_REDIS, prefix)


def test_admission_counts_the_requests_other_workers_hold_in_the_core():
    """A worker's queue sees the engine full when its own running requests plus the other workers' (as the
    core last reported them) reach the engine's slots."""
    from types import SimpleNamespace

    from tokenyard.gateway.admission.engine_queues import EngineQueue
    from tokenyard.gateway.config.deployment import AdmissionConfig

    stats = SimpleNamespace(max_num_seqs=4, num_steps=1, num_free_blocks=1000)
    engine = SimpleNamespace(others_in_flight=0, stats=lambda: stats)
    q = EngineQueue("e", engine, AdmissionConfig(), None)
    q.running = 2
    assert q._room_for(1)
    engine.others_in_flight = 2           # the other worker holds two: the engine's 4 slots are taken
    assert not q._room_for(1)
    q.running, engine.others_in_flight = 0, 4
    assert not q._room_for(1)
    engine.others_in_flight, stats.num_free_blocks = 1, 0
    assert not q._room_for(1)             # idle here is not idle there: the KV check still applies
    engine.others_in_flight = 0
    assert q._room_for(1)                 # the whole engine idle takes anything
