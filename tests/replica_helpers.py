"""Engine replica processes (`tokenyard engine serve`) on loopback, for the test_replicas_* files."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 2.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class ReplicaProcess:
    """One replica of engine `name` from a one-engine deployment file written to tmp_path."""

    def __init__(self, tmp_path: Path, engine: dict[str, Any], name: str = "mock", grace_s: float = 10.0,
                 port: int | None = None) -> None:
        self.engine = engine
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp_path / f"replica-{self.port}.yaml"
        cfg.write_text(yaml.safe_dump({"server": {"drain_grace_s": grace_s}, "engines": {name: engine}}))
        self.log = tmp_path / f"replica-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenyard.cli.main", "engine", "serve", "--engine", name,
                                      "--port", str(self.port), "--config", str(cfg)],
                                     cwd=ROOT, env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 30.0) -> "ReplicaProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if get_json(self.url + "/ready", 0.5)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"replica on {self.port} not ready: {self.log.read_text()[-2000:]}")

    def restart(self, tmp_path: Path) -> "ReplicaProcess":
        """A new process on the same port (after kill)."""
        return ReplicaProcess(tmp_path, self.engine, port=self.port).wait_ready()

    def stats(self) -> dict[str, Any]:
        return get_json(self.url + "/v1/engine/stats")[1]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


def start_replicas(tmp_path: Path, n: int, **mock_options: Any) -> list[ReplicaProcess]:
    engine = {"type": "mock", "model": str(ROOT / "models" / "demo-small"), **mock_options}
    procs = [ReplicaProcess(tmp_path, engine) for _ in range(n)]
    try:
        for p in procs:
            p.wait_ready()
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def pool_deployment(urls: list[str], local: bool = False, **pool: Any) -> dict[str, Any]:
    """A gateway deployment whose engine "mock" is served by the given replicas."""
    replicas: list[dict[str, Any]] = [{"url": u} for u in urls] + ([{"local": True}] if local else [])
    engine = {"type": "mock", "model": str(ROOT / "models" / "demo-small"), "replicas": replicas}
    if pool:
        engine["replica_pool"] = pool
    return {"server": {"access_log": False}, "engines": {"mock": engine}}
