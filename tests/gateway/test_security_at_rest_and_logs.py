"""Secrets at rest and in logs: no plaintext API key (nor session id) anywhere in Redis (key
records, rate limits, spend records and rollups, sessions) or in the spend spool; prompts never in
the logs (access log and every app log, at DEBUG) or the spend ledger; API keys and CSRF tokens
compared with hmac.compare_digest (constant time) on every check."""
from __future__ import annotations

import hmac
import logging
import re
import secrets
from urllib.parse import urlencode

import pytest
import redis
from gateway_helpers import (
    KEY,
    SHARED_REDIS,
    delete_prefix,
    mock_deployment,
    running_gateway,
    sse_events,
    unique_prefix,
    wait_ledger,
)

import tokenyard.gateway.auth.api_keys
import tokenyard.gateway.auth.csrf
from tokenyard.gateway.auth.api_keys import KeyStore
from tokenyard.gateway.auth.sessions import COOKIE


def _dump(client: redis.Redis, prefix: str) -> bytes:
    """Every key name and value under the prefix, whatever its type."""
    out = []
    for name in client.scan_iter(match=prefix + "*", count=1000):
        out.append(name)
        kind = client.type(name)
        if kind == b"string":
            out.append(client.get(name) or b"")
        elif kind == b"hash":
            for k, v in client.hgetall(name).items():
                out += [k, v]
        elif kind == b"set":
            out += list(client.smembers(name))
        elif kind == b"zset":
            out += [m for m, _ in client.zrange(name, 0, -1, withscores=True)]
        elif kind == b"list":
            out += client.lrange(name, 0, -1)
        elif kind == b"stream":
            for _, fields in client.xrange(name):
                for k, v in fields.items():
                    out += [k, v]
    return b"\n".join(out)


def _sign_in(srv, key: str) -> str:
    status, headers, body = srv.request("GET", "/dashboard/login", headers={"Authorization": ""})
    sid = re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)
    token = re.search(rb'name="csrf_token" value="([^"]+)"', body).group(1).decode()
    status, headers, _ = srv.request("POST", "/dashboard/login", urlencode({"api_key": key, "csrf_token": token}),
                                     headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}",
                                              "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 303
    return re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += logging.Formatter().formatException(record.exc_info)
        self.lines.append(f"{record.name} {text}")


@pytest.fixture()
def debug_logs():
    """Every log record of the process at DEBUG (root, uvicorn, the access log)."""
    cap = _Capture()
    names = ["", "uvicorn", "uvicorn.error", "uvicorn.access", "tokenyard.access"]
    saved = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).addHandler(cap)
        logging.getLogger(n).setLevel(logging.DEBUG)
    try:
        yield cap
    finally:
        for n in names:
            logging.getLogger(n).removeHandler(cap)
            logging.getLogger(n).setLevel(saved[n])


def test_keys_hashed_at_rest_and_prompts_absent_from_logs(tmp_path, debug_logs):
    prefix = unique_prefix("sec")
    client = redis.Redis.from_url(SHARED_REDIS)
    store = KeyStore(client, prefix)
    acme, _ = store.create("acme", rpm=1000, tpm=1_000_000)
    globex, _ = store.create("globex")
    marker = "PROMPT-MARKER-" + secrets.token_hex(8)
    spool = tmp_path / "spool"
    doc = {**mock_deployment(output_len=8), "server": {"access_log": True}, "redis_url": SHARED_REDIS,
           "redis_prefix": prefix, "spend": {"spool_dir": str(spool)}}
    try:
        with running_gateway(doc) as srv:
            sessions = []
            for key in (acme, globex, KEY):
                auth = {"Authorization": f"Bearer {key}"}
                msg = [{"role": "user", "content": f"secret prompt {marker}"}]
                status, _, body = srv.chat({"model": "mock", "messages": msg}, auth)
                assert status == 200
                status, _, raw = srv.request("POST", "/v1/chat/completions",
                                             {"model": "mock", "messages": msg, "stream": True}, auth)
                assert status == 200 and sse_events(raw)[-1] == "[DONE]"
                # Error paths too: a refused parameter, a context too long, a bad role.
                assert srv.chat({"model": "mock", "messages": msg, "logprobs": True}, auth)[0] == 400
                assert srv.chat({"model": "mock", "messages": [{"role": "user", "content": marker * 3000}]},
                                auth)[0] == 400
                assert srv.chat({"model": "mock", "messages": [{"role": "bot", "content": marker}]}, auth)[0] == 400
                assert srv.request("GET", "/v1/spend/report", headers=auth)[0] == 200
                sessions.append(_sign_in(srv, key))
            wait_ledger(srv)
            stored = _dump(client, prefix)
            assert b"spend:" in stored and b"key:" in stored and b"session:" in stored and b"rl:" in stored
            for secret in (acme, globex, KEY, acme[3:], globex[3:], *sessions):
                assert secret.encode() not in stored, "a plaintext key or session id is stored in Redis"
            spooled = b"".join(p.read_bytes() for p in spool.rglob("*") if p.is_file())
            for secret in (acme, globex, KEY, marker):
                assert secret.encode() not in spooled
            assert marker.encode() not in stored, "prompt text in Redis (spend records must never hold it)"
    finally:
        client.close()
        delete_prefix(SHARED_REDIS, prefix)
    access = [line for line in debug_logs.lines if line.startswith("tokenyard.access")]
    assert len(access) >= 15, "the access log was not captured"
    leaked = [line for line in debug_logs.lines if marker in line]
    assert not leaked, f"prompt text in the logs: {leaked[:3]}"
    for key in (acme, globex, KEY):
        assert not [line for line in debug_logs.lines if key in line], "an API key in the logs"


def test_key_and_csrf_comparisons_are_constant_time(monkeypatch):
    calls = {"key": 0, "csrf": 0}
    real = hmac.compare_digest

    def counting(kind):
        def compare(a, b):
            calls[kind] += 1
            return real(a, b)
        return compare

    monkeypatch.setattr(tokenyard.gateway.auth.api_keys.hmac, "compare_digest", counting("key"))
    with running_gateway(mock_deployment()) as srv:
        monkeypatch.setattr(
            tokenyard.gateway.auth.csrf, "hmac", type("H", (), {"compare_digest": staticmethod(counting("csrf"))})
        )
        for _ in range(5):
            assert srv.chat({"model": "mock", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})[0] == 200
        assert calls["key"] >= 5, "API keys are not compared with hmac.compare_digest"
        before = calls["key"]
        assert srv.chat({"model": "mock", "messages": [{"role": "user", "content": "x"}]},
                        {"Authorization": "Bearer ty-wrong"})[0] == 401
        assert srv.request("GET", "/v1/models")[0] == 200
        assert calls["key"] > before
        _sign_in(srv, KEY)
        assert calls["csrf"] >= 1, "CSRF tokens are not compared with hmac.compare_digest"
    # And the comparison is over the full hashes: a key whose hash shares the record's id still fails.
    rec = tokenyard.gateway.auth.api_keys.new_record("ty-" + "a" * 43, "acme")
    forged = rec.key_hash[:16] + "0" * 48
    assert not rec.matches(forged)
