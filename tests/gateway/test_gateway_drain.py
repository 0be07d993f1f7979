"""SIGTERM drain of a real `tokenyard serve` process: in-flight finish, new requests 503, exit 0."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import yaml
from gateway_helpers import ROOT, SHARED_REDIS, delete_prefix, sse_events, unique_prefix


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict, key: str, timeout: float = 20) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_sigterm_drains_then_exits(tmp_path):
    port = _free_port()
    cfg = tmp_path / "deploy.yaml"
    prefix = unique_prefix("drain")   # the dev key's record goes under it, removed at the end
    cfg.write_text(yaml.safe_dump({
        "server": {"host": "127.0.0.1", "port": port, "drain_grace_s": 20}, "redis_prefix": prefix,
        "engines": {"mock": {"type": "mock", "model": str(ROOT / "models" / "demo-small"), "token_ms": 25}}}))
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:6379", "TOKENYARD_DEV_KEY": "drain-key",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tokenyard.cli.main", "serve", "--config", str(cfg)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                conn.request("GET", "/ready")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.05)
        # Two in-flight requests (one streamed, one not) of about 51 tokens x 25 ms = 1.3 s each.
        results: dict[str, tuple[int, bytes]] = {}
        body = {"model": "mock", "messages": [{"role": "user", "content": "SECRET-PROMPT-42"}]}
        threads = [threading.Thread(target=lambda k=k, s=s: results.__setitem__(k, _post(port, {**body, "stream": s},
                                                                                           "drain-key")))
                   for k, s in (("stream", True), ("plain", False))]
        for t in threads:
            t.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        status, raw = _post(port, body, "drain-key")   # a new request during the drain
        assert status == 503 and json.loads(raw)["error"]["code"] == "draining"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/ready")
        assert conn.getresponse().status == 503
        conn.close()
        for t in threads:
            t.join(15)
        assert results["plain"][0] == 200
        assert json.loads(results["plain"][1])["choices"][0]["finish_reason"] == "stop"
        events = sse_events(results["stream"][1])
        assert results["stream"][0] == 200 and events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        assert proc.wait(15) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err
        # The access log was flushed: one JSON line per chat request, without prompt text.
        lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
        chat = [x for x in lines if x["path"] == "/v1/chat/completions"]
        assert sorted(x["status"] for x in chat) == [200, 200, 503]
        assert "SECRET-PROMPT-42" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        delete_prefix(SHARED_REDIS, prefix)
