"""A gateway on a free port in a background thread, for the test_gateway_* files."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import uvicorn

from tokenyard.gateway.config.deployment import parse_deployment
from tokenyard.gateway.server.app import create_app

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def mock_deployment(**engine_options: Any) -> dict[str, Any]:
    """A deployment document with one mock engine named "mock"."""
    return {"server": {"access_log": False},
            "engines": {"mock": {"type": "mock", "model": str(ROOT / "models" / "demo-small"), **engine_options}}}


class Running:
    def __init__(self, app, server: uvicorn.Server, port: int) -> None:
        self.app = app
        self.gateway = app.state.gateway
        self.server = server
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"

    def engine(self, name: str = "mock"):
        return self.gateway.handles[name].engine

    def request(self, method: str, path: str, body: bytes | str | dict | None = None,
                headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        if isinstance(body, dict):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode()
        try:
            conn.request(method, path, body=body, headers={**AUTH, **(headers or {})})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def chat(self, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
        status, hdrs, data = self.request("POST", "/v1/chat/completions", body, headers)
        return status, hdrs, json.loads(data) if data else None

    def wait_idle(self, name: str = "mock", timeout: float = 5.0) -> Any:
        """Wait until the engine runs nothing and every KV block is free; return its stats."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.engine(name).stats()
            idle = (s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks
                    and not self.engine(name).engine.has_unfinished())
            if idle or time.monotonic() > deadline:
                return s
            time.sleep(0.01)


@contextmanager
def running_gateway(document: dict[str, Any], handles=None, usage_sink=None, guarded: bool = False) -> Iterator[Running]:
    """guarded: serve as `tokenyard serve` does (tokenyard/gateway/server/server.py: connection deadlines, cap, 431)
    instead of plain uvicorn."""
    if "spool_dir" not in (document.get("spend") or {}):
        # Records spooled during a test's Redis outage must never land in the repository's
        # .tokenyard/ (and be replayed later by another run): a throwaway folder per gateway.
        import tempfile
        document = {**document, "spend": {**(document.get("spend") or {}),
                                          "spool_dir": tempfile.mkdtemp(prefix="tytest-spool-")}}
    if "data_dir" not in (document.get("batch") or {}):
        # Likewise Batch API files (uploads by tests and the fuzzer): never in the repository's .tokenyard/.
        import tempfile
        document = {**document, "batch": {**(document.get("batch") or {}),
                                          "data_dir": tempfile.mkdtemp(prefix="tytest-batch-")}}
    if document.get("redis_url") and "redis_prefix" not in document and "enabled" not in document["spend"]:
        # A test on the shared Redis without a prefix of its own is not about spend: keep its usage
        # records out of the shared "tokenyard:" keys (spend tests use unique_prefix()).
        document = {**document, "spend": {**document["spend"], "enabled": False}}
    if "engine_process" not in (document.get("server") or {}):
        # The default steps torch engines in a process of their own (a fresh interpreter importing torch:
        # seconds per gateway); tests that want it say so, the rest keep their engines in-process.
        document = {**document, "server": {**(document.get("server") or {}), "engine_process": False}}
    dep = parse_deployment(document, base_dir=ROOT)
    app = create_app(dep, handles=handles, usage_sink=usage_sink, dev_key=KEY)
    # proto IPPROTO_TCP, as uvicorn's own bind gets it from getaddrinfo: asyncio sets TCP_NODELAY
    # only on sockets that say so, and without it a two-write reply waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if guarded:
        from tokenyard.gateway.server.server import GuardedServer, uvicorn_config
        server = GuardedServer(uvicorn_config(app, dep.connections))
    else:
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1)
        server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    # Engines load in the app's start-up: a real model (SmolLM2's int4 repack) on a busy 2-core machine
    # took over 30 s.
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test gateway did not start")
        time.sleep(0.01)
    try:
        yield Running(app, server, port)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def sse_events(raw: bytes) -> list[Any]:
    """Parse an SSE body into JSON objects (and the string "[DONE]")."""
    events = []
    for block in raw.decode("utf-8").split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# --- keys, limits, admission (issue 10) ---------------------------------------------------------
SHARED_REDIS = "redis://127.0.0.1:6379"


def add_key(srv: Running, tenant: str, **record: Any) -> str:
    """A new key known to a gateway without Redis (preloaded into its key cache)."""
    from tokenyard.gateway.auth.api_keys import generate_key, new_record
    key = generate_key()
    srv.gateway.keys.preload(new_record(key, tenant, **record))
    return key


def unique_prefix(tag: str) -> str:
    import secrets
    return f"tytest:{tag}:{secrets.token_hex(4)}:"


def delete_prefix(url: str, prefix: str) -> None:
    """Remove every Redis key under a test's prefix."""
    import redis
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=prefix.replace("[", "\\[") + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


class PrivateRedis:
    """A redis-server of the test's own on a free port, so it can be stopped (never the shared one)."""

    def __init__(self, data_dir: Path | None = None, port: int | None = None) -> None:
        """data_dir: run with an append-only file there (so a restart on the same port keeps the data)."""
        import subprocess
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.data_dir = data_dir
        if data_dir is not None:
            data_dir.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}"
        persist = ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(data_dir)] if data_dir else \
            ["--appendonly", "no"]
        self.proc = subprocess.Popen(["/usr/bin/redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", *persist],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis(port=self.port, socket_connect_timeout=0.2).ping():
                    return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("private redis-server did not start")
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def restart(self) -> "PrivateRedis":
        """Start again on the same port and data folder (the append-only file brings the data back)."""
        self.stop()
        return PrivateRedis(self.data_dir, self.port)


# --- spend ledger (issue 11) --------------------------------------------------------------------
def wait_ledger(srv: Running, timeout: float = 15.0, spool_empty: bool = True) -> None:
    """Wait until every usage record handed to the ledger is in Redis (or, with spool_empty False,
    at least durable somewhere: Redis or the spool)."""
    ledger = srv.gateway.ledger
    deadline = time.monotonic() + timeout
    while True:
        settled = ledger.pending == 0 and (not spool_empty or (not ledger.redis_down and not ledger.spool.pending()))
        if settled:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"ledger not settled: pending={ledger.pending} down={ledger.redis_down} "
                                 f"spooled={ledger.spool.pending()}")
        time.sleep(0.02)
