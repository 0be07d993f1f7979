"""Admission under a burst beyond capacity (mock engine): shed at once with Retry-After, expired
requests never reach the engine, admitted ones complete, interactive overtakes batch, and a
noisy tenant cannot starve another tenant of the same class."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from gateway_helpers import add_key, mock_deployment, running_gateway

MSG = [{"role": "user", "content": "hi"}]


def _record_engine(srv) -> list[tuple[str, float]]:
    """Wrap the mock engine's add_request: (client request id, wall time) of every request it receives."""
    eng = srv.engine().engine
    seen: list[tuple[str, float]] = []
    original = eng.add_request

    def add_request(request_id, *args, **kwargs):
        seen.append((request_id.rsplit("-", 1)[0], time.time()))
        return original(request_id, *args, **kwargs)

    eng.add_request = add_request
    return seen


def _burst(url: str, key: str, n: int, deadline_ms: int, gap_s: float = 0.0) -> list[dict]:
    """n requests, one every gap_s (0: all at once), from another process; latency from each send."""
    out = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "burst_client.py"), url, key, str(n),
                          str(deadline_ms), str(gap_s)], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_burst_sheds_fast_expired_never_reach_engine_admitted_complete():
    doc = {**mock_deployment(token_ms=10, output_len=8, max_sleep_ms=2),
           "admission": {"max_running": 4, "max_queue": 64, "tick_ms": 2}}
    with running_gateway(doc) as srv:
        key = add_key(srv, "burst")
        for _ in range(6):   # warm-up: the engine's service rate is measured from these
            assert srv.chat({"model": "mock", "messages": MSG}, {"Authorization": f"Bearer {key}"})[0] == 200
        seen = _record_engine(srv)
        url = srv.base_url + "/v1/chat/completions"
        # ~80 ms per request, 4 at a time: 50 requests/s of capacity. 90 arrive in 0.27 s (330/s).
        results = _burst(url, key, 90, 400, gap_s=0.003)
        ok = [r for r in results if r["status"] == 200]
        shed = [r for r in results if r["status"] != 200]
        assert {r["status"] for r in shed} <= {503}, {r["status"] for r in shed}
        assert len(ok) >= 12 and len(shed) >= 30, (len(ok), len(shed))
        for r in ok:   # admitted requests complete
            assert r["body"]["choices"][0]["finish_reason"] == "length"
            assert r["body"]["usage"]["completion_tokens"] == 8
        for r in shed:
            assert r["body"]["error"]["code"] in ("engine_overloaded", "queue_full", "deadline_exceeded")
            assert int(r["headers"]["Retry-After"]) >= 1 and int(r["headers"]["retry-after-ms"]) >= 1
        at_once = sorted(r["latency"] for r in shed if r["body"]["error"]["code"] != "deadline_exceeded")
        print(f"burst: {len(ok)} served, {len(shed)} shed ({len(at_once)} at once), shed p50 "
              f"{at_once[len(at_once) // 2] * 1000:.1f} ms max {at_once[-1] * 1000:.1f} ms")
        assert len(at_once) >= 30
        # "At once" means long before the 400 ms deadline they would otherwise wait out. The bounds leave
        # room for a loaded 2-core machine (p50 39 ms seen there with other work running; ~5 ms idle);
        # the shed latency itself is measured by tokenyard/bench/admission_overload.py, not asserted here.
        assert at_once[len(at_once) // 2] < 0.1 and at_once[-1] < 0.3, at_once[-5:]
        # Nothing shed or expired reached the engine; everything that did started within its deadline.
        received = {rid: t for rid, t in seen}
        assert not {r["id"] for r in shed} & set(received)
        assert {r["id"] for r in ok} == set(received)
        arrivals = {rec.request_id.rsplit("-", 1)[0]: rec.time for rec in srv.gateway.usage.records}
        late = [rid for rid, t in received.items() if t - arrivals[rid] > 0.4 + 0.005]
        assert not late, late
        text = srv.request("GET", "/metrics")[2].decode()
        assert 'tokenyard_admission_shed_total{engine="mock",reason="predicted_wait"}' in text
        assert 'tokenyard_admission_queue_depth{engine="mock",priority="batch"}' in text
        assert 'tokenyard_admission_predicted_wait_seconds{engine="mock"}' in text
        assert srv.wait_idle().num_running == 0


def test_queued_requests_that_expire_never_reach_the_engine():
    # Cold start: no service rate measured yet, so nothing is shed on prediction; they queue and expire.
    doc = {**mock_deployment(token_ms=50, output_len=8, max_sleep_ms=2), "admission": {"max_running": 1, "tick_ms": 2}}
    with running_gateway(doc) as srv:
        seen = _record_engine(srv)
        blocker = threading.Thread(target=srv.chat, args=({"model": "mock", "messages": MSG},
                                                          {"x-request-id": "blocker"}))
        blocker.start()
        time.sleep(0.03)
        results: list[tuple[int, dict, float]] = []

        def late(i: int) -> None:
            t0 = time.perf_counter()
            status, headers, body = srv.chat({"model": "mock", "messages": MSG},
                                             {"x-request-id": f"late{i}", "x-request-deadline-ms": "100"})
            results.append((status, {**headers, **body}, time.perf_counter() - t0))

        threads = [threading.Thread(target=late, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in [*threads, blocker]:
            t.join(10)
        assert [r[0] for r in results] == [503] * 4
        for _, r, latency in results:
            assert r["error"]["code"] == "deadline_exceeded" and "retry-after-ms" in r
            assert 0.09 <= latency < 0.4, latency   # answered when its deadline passed, not before
        assert [rid for rid, _ in seen] == ["blocker"]
        text = srv.request("GET", "/metrics")[2].decode()
        assert 'tokenyard_admission_expired_total{engine="mock",priority="interactive"} 4.0' in text


def _post_in_order(srv, items: list[tuple[str, str]], gap: float = 0.012, max_tokens: int = 3) -> list[threading.Thread]:
    threads = []
    for rid, key in items:
        t = threading.Thread(target=srv.chat, args=({"model": "mock", "messages": MSG, "max_tokens": max_tokens},
                                                    {"Authorization": f"Bearer {key}", "x-request-id": rid}))
        t.start()
        threads.append(t)
        time.sleep(gap)
    return threads


def test_interactive_overtakes_batch_and_tenants_take_turns():
    doc = {**mock_deployment(token_ms=5, output_len=80, max_sleep_ms=2),
           "admission": {"max_running": 1, "tick_ms": 2, "max_concurrent_per_tenant": 0}}
    with running_gateway(doc) as srv:
        batch = add_key(srv, "nightly", priority="batch")
        interactive = add_key(srv, "chat")
        noisy = add_key(srv, "noisy")
        quiet = add_key(srv, "quiet")
        seen = _record_engine(srv)

        def blocker() -> threading.Thread:   # 80 tokens x 5 ms: holds the one slot while others queue
            t = threading.Thread(target=srv.chat, args=({"model": "mock", "messages": MSG}, {"x-request-id": "blk"}))
            t.start()
            time.sleep(0.03)
            return t

        threads = [blocker()]
        threads += _post_in_order(srv, [(f"b{i}", batch) for i in range(4)] + [(f"i{i}", interactive) for i in range(3)])
        for t in threads:
            t.join(20)
        order = [rid for rid, _ in seen]
        assert order == ["blk", "i0", "i1", "i2", "b0", "b1", "b2", "b3"], order

        seen.clear()
        threads = [blocker()]
        threads += _post_in_order(srv, [(f"n{i}", noisy) for i in range(10)] + [(f"q{i}", quiet) for i in range(2)])
        for t in threads:
            t.join(20)
        order = [rid for rid, _ in seen][1:]
        # Round robin: the quiet tenant's two requests go 2nd and 4th, not after the noisy tenant's ten.
        assert order.index("q0") <= 1 and order.index("q1") <= 3, order
        assert sorted(order) == sorted([f"n{i}" for i in range(10)] + ["q0", "q1"])


def test_per_tenant_concurrency_cap_is_429_with_retry_after():
    doc = {**mock_deployment(token_ms=20, output_len=10, max_sleep_ms=2), "admission": {"max_concurrent_per_tenant": 2}}
    with running_gateway(doc) as srv:
        key = add_key(srv, "capped")
        other = add_key(srv, "other")
        threads = _post_in_order(srv, [("c0", key), ("c1", key)], gap=0.01, max_tokens=10)   # 200 ms each
        time.sleep(0.05)
        status, headers, body = srv.chat({"model": "mock", "messages": MSG}, {"Authorization": f"Bearer {key}"})
        assert status == 429 and body["error"]["code"] == "concurrency_limit_exceeded"
        assert int(headers["retry-after-ms"]) > 0 and headers["retry-after"]
        assert srv.chat({"model": "mock", "messages": MSG}, {"Authorization": f"Bearer {other}"})[0] == 200
        for t in threads:
            t.join(10)
        assert srv.chat({"model": "mock", "messages": MSG}, {"Authorization": f"Bearer {key}"})[0] == 200
        assert srv.gateway.admission.tenants == {}
        text = srv.request("GET", "/metrics")[2].decode()
        assert 'tokenyard_admission_shed_total{engine="mock",reason="tenant_concurrency"} 1.0' in text
        assert json.loads(srv.request("GET", "/health")[2])["status"] == "ok"
