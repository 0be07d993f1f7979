"""A client that leaves a non-streamed request before its reply is a 499 in the records, and no
error in the log (it used to log "ASGI callable returned without starting response" each time)."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time
from contextlib import contextmanager

import pytest
from gateway_helpers import KEY, ROOT, Running, mock_deployment, running_gateway
from reliability_common import ErrorLogs


@contextmanager
def served_like_production(doc):
    """The app under tokenyard/gateway/server/server.py's uvicorn settings (its guarded protocol), not the tests' plain one."""
    from tokenyard.gateway.config.deployment import parse_deployment
    from tokenyard.gateway.server.app import create_app
    from tokenyard.gateway.server.server import GuardedServer, uvicorn_config
    dep = parse_deployment(doc, base_dir=ROOT)
    app = create_app(dep, dev_key=KEY)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = GuardedServer(uvicorn_config(app, dep.connections))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.01)
    try:
        yield Running(app, server, sock.getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.mark.parametrize("serve", [running_gateway, served_like_production], ids=["tests", "production"])
def test_cut_non_stream_requests_log_no_error(serve):
    doc = mock_deployment(output_len=40, token_ms=10, max_sleep_ms=5)
    body = json.dumps({"model": "mock", "messages": [{"role": "user", "content": "hi"}]}).encode()
    with serve(doc) as srv, ErrorLogs() as errors:
        for i in range(5):
            sock = socket.create_connection(("127.0.0.1", srv.port))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {KEY}\r\nx-request-id: cut{i}\r\n".encode()
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.1)
            if i % 2:   # half of them reset (RST) rather than close (FIN)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        deadline = time.monotonic() + 10
        while sum(1 for r in srv.gateway.usage.records if r.status == "client_disconnected") < 5:
            assert time.monotonic() < deadline, "the cut requests were not recorded"
            time.sleep(0.02)
        time.sleep(0.2)     # uvicorn logs after the app returns
        assert srv.chat({"model": "mock", "messages": [{"role": "user", "content": "x"}]})[0] == 200
    assert not errors.records, errors.records
