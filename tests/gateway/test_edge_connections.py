"""What a connection may cost a gateway served as `tokenyard serve` does (tokenyard/gateway/server/connection_guard.py):
a head that never completes and a body that stops half way are cut with 408 after their deadlines,
a silent connection is closed, an oversized head (a 1 MB Bearer token) gets 431 that the client can
read, the connection cap closes the oldest idle/slow connection instead of refusing a new client
and refuses (503, Retry-After) only when every connection is busy; the accept-error log is
rate-limited and the open-file limit raised at start."""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import resource
import socket
import threading
import time

from gateway_helpers import mock_deployment, running_gateway

from tokenyard.gateway.server.connection_guard import QuietAcceptErrors, fit_max_connections, raise_fd_limit

CHAT = {"model": "mock", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _doc(**server) -> dict:
    doc = mock_deployment()
    doc["server"].update({"header_timeout_s": 0.5, "body_timeout_s": 0.5, **server})
    return doc


def _read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return out
        out += chunk


def test_one_megabyte_bearer_header_gets_431_not_a_reset():
    with running_gateway(_doc(), guarded=True) as srv:
        for path in ("/v1/models", "/v1/chat/completions"):
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
            conn.request("POST" if "chat" in path else "GET", path, body=json.dumps(CHAT),
                         headers={"Authorization": "Bearer ty-" + "x" * (1 << 20), "Content-Type": "application/json"})
            resp = conn.getresponse()
            body = json.loads(resp.read())
            conn.close()
            assert resp.status == 431, (path, resp.status)
            assert body["error"]["code"] == "headers_too_large"
        assert srv.server.connection_stats.too_large == 2
        # A head under the limit is served as before.
        status, _, _ = srv.request("GET", "/v1/models", headers={"X-Pad": "p" * 30_000})
        assert status == 200


def test_slow_head_and_silent_connection_are_closed_after_the_deadline():
    with running_gateway(_doc(), guarded=True) as srv:
        slow = socket.create_connection(("127.0.0.1", srv.port))
        silent = socket.create_connection(("127.0.0.1", srv.port))
        t0 = time.monotonic()
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthoriz")
        answer = _read_all(slow)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:60]
        assert _read_all(silent) == b""                 # never sent anything: just closed
        assert 0.4 < time.monotonic() - t0 < 3.0
        # A keep-alive connection that starts its next head and stalls is cut too.
        ka = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        ka.request("GET", "/health")
        assert ka.getresponse().read()
        ka.sock.sendall(b"GET /hea")
        assert _read_all(ka.sock).startswith(b"HTTP/1.1 408 ")
        ka.close()
        for s in (slow, silent):
            s.close()
        assert srv.server.connection_stats.head_timeouts == 2


def test_slow_body_is_cut_with_408_and_the_endpoint_sees_a_disconnect():
    with running_gateway(_doc(), guarded=True) as srv:
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"model\": \"mo")
        answer = _read_all(s)
        s.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:60]
        assert srv.server.connection_stats.body_timeouts == 1
        deadline = time.monotonic() + 5
        while srv.gateway.in_progress and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.gateway.in_progress == 0
        assert srv.chat(CHAT)[0] == 200


def test_connection_cap_closes_idle_connections_first_and_serves_new_clients():
    with running_gateway(_doc(max_connections=20, header_timeout_s=30), guarded=True) as srv:
        slow = []
        for _ in range(200):
            c = socket.create_connection(("127.0.0.1", srv.port))
            c.sendall(b"GET /heal")
            slow.append(c)
        for _ in range(20):
            t0 = time.perf_counter()
            assert srv.request("GET", "/health")[0] == 200
            assert time.perf_counter() - t0 < 0.5
        stats = srv.server.connection_stats
        assert stats.open <= 20 and stats.evicted >= 180 and stats.refused == 0
        assert len(srv.server.server_state.connections) <= 21
        for c in slow:
            c.close()


def test_connection_cap_refuses_with_503_when_every_connection_is_busy():
    doc = mock_deployment(ttft_ms=1500, output_len=2, max_sleep_ms=1500)
    doc["server"].update(max_connections=3)
    with running_gateway(doc, guarded=True) as srv:
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(srv.chat(CHAT)[0])) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        extra = socket.create_connection(("127.0.0.1", srv.port))
        answer = _read_all(extra)
        extra.close()
        for t in threads:
            t.join(10)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in answer, answer[:120]
        assert b"too_many_connections" in answer
        assert results == [200, 200, 200]


def test_accept_errors_are_logged_at_most_once_per_interval(caplog):
    handler = QuietAcceptErrors(every_s=60)
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR, logger="tokenyard.connections"):
            for _ in range(10_000):
                handler(loop, {"message": "socket.accept() out of system resource", "exception": OSError(24, "x")})
    finally:
        loop.close()
    lines = [r for r in caplog.records if "out of system resource" in r.getMessage()]
    assert len(lines) == 1 and handler.total == 10_000 and handler.suppressed == 9_999


def test_fd_limit_is_raised_to_the_hard_limit_and_bounds_max_connections():
    soft, hard = raise_fd_limit()
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == soft
    if hard != resource.RLIM_INFINITY:
        assert soft == hard
    assert fit_max_connections(4096, 1024, backlog=512) == 1024 - 256 - 512
    assert fit_max_connections(4096, 20_000) == 4096


def test_connection_settings_are_validated():
    import pytest
    from gateway_helpers import ROOT

    from tokenyard.gateway.config.deployment import DeploymentError, parse_deployment
    for bad in ({"max_connections": 0}, {"header_timeout_s": -1}, {"max_header_bytes": 10}, {"body_timeout_s": "x"}):
        doc = mock_deployment()
        doc["server"].update(bad)
        with pytest.raises(DeploymentError, match="server\\."):
            parse_deployment(doc, base_dir=ROOT)

