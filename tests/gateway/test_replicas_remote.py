"""Remote engine replicas (`tokenyard engine serve`, mock engines) behind one gateway on loopback:
serving, prefix affinity with balance, a SIGKILLed replica (clean errors, retry before the first
token, ejection, re-admission) and a drained replica finishing its work."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from gateway_helpers import running_gateway, sse_events
from replica_helpers import pool_deployment, start_replicas

LONG = " ".join(f"rule{i}" for i in range(40))          # a system prompt of several KV blocks


def _ask(srv, user: str, system: str | None = None, stream: bool = False, **extra):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    body = {"model": "mock", "messages": messages, "stream": stream, **extra}
    if stream:
        status, _, raw = srv.request("POST", "/v1/chat/completions", body)
        return status, sse_events(raw)
    status, _, data = srv.chat(body)
    return status, data


def _served_by(pool, fn):
    """Run fn (one request) and say which replica index it was routed to."""
    before = [r.chosen for r in pool.replicas]
    result = fn()
    moved = [i for i, r in enumerate(pool.replicas) if r.chosen != before[i]]
    assert len(moved) == 1, moved
    return moved[0], result


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_two_remote_replicas_serve_with_prefix_affinity_and_balance(tmp_path):
    reps = start_replicas(tmp_path, 2, token_ms=1, output_len=4)
    try:
        with running_gateway(pool_deployment([r.url for r in reps], health_interval_s=0.2)) as srv:
            pool = srv.engine()
            assert [r.routable for r in pool.replicas] == [True, True]
            # Both replicas serve, streamed and not, concurrently.
            with ThreadPoolExecutor(8) as ex:
                results = list(ex.map(lambda i: _ask(srv, f"question {i}", stream=i % 2 == 0), range(8)))
            assert all(s == 200 for s, _ in results)
            assert all(ev[-1] == "[DONE]" for s, ev in results[::2])
            assert all(r.chosen > 0 for r in pool.replicas)
            assert sum(st["num_steps"] > 0 for st in (rp.stats() for rp in reps)) == 2
            # One system prompt, many user turns: always the same replica.
            first, _ = _served_by(pool, lambda: _ask(srv, "turn 0", LONG))
            for i in range(1, 6):
                idx, (status, _) = _served_by(pool, lambda: _ask(srv, f"turn {i}", LONG))
                assert status == 200 and idx == first
            # 16 distinct prefixes spread evenly, and each comes back to where it went first.
            systems = [f"tenant policy {k}: " + LONG for k in range(16)]
            home = [_served_by(pool, lambda s=s: _ask(srv, "hello", s))[0] for s in systems]
            # Ties alternate; the replicas' polled KV usage (refreshed on its own clock) can tip one
            # placement either way, so "evenly" is within two of 8 each, never all on one replica.
            assert min(home.count(0), home.count(1)) >= 6, home
            again = [_served_by(pool, lambda s=s: _ask(srv, "another turn", s))[0] for s in systems]
            assert again == home
            hits = sum(r.affinity_hits for r in pool.replicas)
            assert hits >= 5 + 16
            metrics = srv.request("GET", "/metrics")[2].decode()
            assert 'tokenyard_replica_up{engine="mock"' in metrics
            assert "tokenyard_replica_prefix_affinity_hits_total" in metrics
            assert 'tokenyard_engine_replicas{engine="mock",state="up"} 2.0' in metrics
    finally:
        for r in reps:
            r.stop()


def test_requests_not_started_on_a_killed_replica_are_retried_elsewhere(tmp_path):
    reps = start_replicas(tmp_path, 2, token_ms=1, output_len=4)
    try:
        # Health checks far apart and a high ejection bar: the dead replica stays "healthy"
        # for a while, so new requests do reach it and must be retried on the other one.
        dep = pool_deployment([r.url for r in reps], policy="round_robin", health_interval_s=30,
                              eject_after_failures=1000)
        with running_gateway(dep) as srv:
            pool = srv.engine()
            reps[0].kill()
            results = [_ask(srv, f"q{i}", stream=i % 2 == 1) for i in range(6)]
            assert all(s == 200 for s, _ in results), results
            assert all(ev[-1] == "[DONE]" for s, ev in results[1::2])
            assert pool.retries >= 2 and pool.replicas[0].retries_from == pool.retries
    finally:
        for r in reps:
            r.stop()


def test_killed_replica_errors_in_flight_is_ejected_and_readmitted(tmp_path):
    reps = start_replicas(tmp_path, 2, token_ms=25, output_len=60)
    try:
        dep = pool_deployment([r.url for r in reps], health_interval_s=0.1, eject_after_failures=2,
                              readmit_after_successes=2)
        with running_gateway(dep) as srv:
            pool = srv.engine()
            a, b = pool.replicas
            with ThreadPoolExecutor(4) as ex:
                futures = [ex.submit(_ask, srv, f"long {i}", None, True) for i in range(4)]
                _wait(lambda: a.engine.num_in_flight == 2 and b.engine.num_in_flight == 2)
                time.sleep(0.2)                        # tokens are streaming
                reps[0].kill()
                results = [f.result(timeout=20) for f in futures]
            errors = [ev for s, ev in results if isinstance(ev[-1], dict) and "error" in ev[-1]]
            done = [ev for s, ev in results if ev[-1] == "[DONE]"]
            assert len(errors) == 2 and len(done) == 2, results
            assert all(ev[-1]["error"]["code"] == "engine_error" for ev in errors)
            assert all(len(ev) > 3 for ev in errors)        # they had streamed tokens: no retry
            _wait(lambda: not a.routable)
            assert a.ejections == 1 and pool.retries == 0
            chosen_a = a.chosen
            with ThreadPoolExecutor(4) as ex:
                later = list(ex.map(lambda i: _ask(srv, f"after {i}", max_tokens=2), range(6)))
            assert all(s == 200 for s, _ in later)
            assert a.chosen == chosen_a                   # nothing new went to the dead replica
            assert 'tokenyard_replica_up{engine="mock",replica="%s"} 0.0' % a.label in \
                srv.request("GET", "/metrics")[2].decode()
            reps[0] = reps[0].restart(tmp_path)           # back on the same port: re-admitted
            _wait(lambda: a.routable)
            with ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda i: _ask(srv, f"back {i}", max_tokens=2), range(6)))
            assert a.chosen > chosen_a
    finally:
        for r in reps:
            r.stop()


def test_drained_replica_finishes_in_flight_work(tmp_path):
    reps = start_replicas(tmp_path, 2, token_ms=25, output_len=40)
    try:
        with running_gateway(pool_deployment([r.url for r in reps], health_interval_s=0.1)) as srv:
            pool = srv.engine()
            a, b = pool.replicas
            with ThreadPoolExecutor(4) as ex:
                futures = [ex.submit(_ask, srv, f"long {i}", None, True) for i in range(2)]
                _wait(lambda: a.engine.num_in_flight == 1 and b.engine.num_in_flight == 1)
                reps[0].terminate()                        # SIGTERM: drain
                _wait(lambda: not a.routable, 5)
                during = [ex.submit(_ask, srv, f"during {i}", max_tokens=2) for i in range(4)]
                results = [f.result(timeout=20) for f in futures]
                assert all(f.result(timeout=20)[0] == 200 for f in during)
            for status, events in results:
                assert status == 200 and events[-1] == "[DONE]", events[-3:]
                assert events[-2]["choices"][0]["finish_reason"] == "stop" and len(events) >= 40
            assert reps[0].proc.wait(10) == 0              # exits 0 once its request finished
    finally:
        for r in reps:
            r.stop()


def test_input_a_replica_refuses_is_a_400_naming_the_parameter(tmp_path):
    """A remote replica checks parameters only when the request reaches it: what it refuses is the
    client's 400 (in-band for a stream that already began), never a retry or an engine 500."""
    reps = start_replicas(tmp_path, 1, token_ms=1, output_len=4)
    try:
        with running_gateway(pool_deployment([r.url for r in reps], health_interval_s=0.2)) as srv:
            for extra, param, code in (({"logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter"),
                                       ({"logprobs": True}, "logprobs", "unsupported_parameter"),
                                       ({"response_format": {"type": "json_object"}}, "response_format",
                                        "invalid_response_format")):
                status, data = _ask(srv, "hello", **extra)
                assert status == 400 and data["error"]["param"] == param, data
                assert data["error"]["code"] == code and data["error"]["type"] == "invalid_request_error"
                status, events = _ask(srv, "hello", stream=True, **extra)
                assert status == 200 and events[-1]["error"]["param"] == param, events
            status, _ = _ask(srv, "hello")           # the replica is still healthy and serving
            assert status == 200 and srv.engine().replicas[0].routable
            statuses = [r.status for r in srv.gateway.usage.records]
            assert statuses == ["rejected"] * 6 + ["ok"], statuses
    finally:
        for r in reps:
            r.stop()
