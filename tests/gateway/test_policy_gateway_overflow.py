"""Overflow through real requests: the large engine is slow and busy (one slot, 400 ms per request),
so its predicted wait (admission's queue model) exceeds the request's deadline: the policy moves
the request to the small engine; with degrade off it sheds it before any queueing (503)."""
from __future__ import annotations

import threading

from gateway_helpers import SHARED_REDIS, delete_prefix, running_gateway, unique_prefix
from policy_gateway_helpers import BASE_POLICY, chat, make_keys, put_policy, two_engine_deployment, wait_for

RULES = """\
rules:
  - name: big
    match: {tags: {route: big}}
    action: {pin: large}
overflow: {degrade: %s}
"""


def test_overflow_degrades_to_the_other_engine_before_shedding():
    prefix = unique_prefix("poloverflow")
    keys = make_keys(prefix, "acme")
    doc = two_engine_deployment(prefix, large={"ttft_ms": 400, "max_num_seqs": 1})
    try:
        with running_gateway(doc) as srv:
            assert put_policy(srv, keys["admin"], BASE_POLICY + RULES % "true")[0] == 200
            big = {"metadata": {"route": "big"}}
            # One request through the large engine teaches admission its service time (~0.4 s).
            status, headers, _ = chat(srv, keys["acme"], **big)
            assert status == 200 and headers["x-tokenyard-engine"] == "large"
            # Keep its only slot busy, then ask with a 100 ms deadline: predicted wait ~400 ms.
            busy = threading.Thread(target=chat, args=(srv, keys["acme"]), kwargs=big)
            busy.start()
            wait_for(lambda: srv.gateway.admission.queues["large"].running == 1)
            status, headers, _ = chat(srv, keys["acme"], headers={"x-request-deadline-ms": "100"}, **big)
            assert status == 200 and headers["x-tokenyard-engine"] == "small"
            assert headers["x-tokenyard-route-reason"] == "overflow_degrade"
            record = srv.gateway.usage.records[-1]
            assert record.engine_state["large"]["predicted_ttft_ms"] > 100 and record.route_reason == "overflow_degrade"
            busy.join()
            # Degrade off: nowhere to go, so the policy sheds it (no queue place, no engine work).
            assert put_policy(srv, keys["admin"], BASE_POLICY + RULES % "false")[0] == 200
            busy = threading.Thread(target=chat, args=(srv, keys["acme"]), kwargs=big)
            busy.start()
            wait_for(lambda: srv.gateway.admission.queues["large"].running == 1)
            status, headers, body = chat(srv, keys["acme"], headers={"x-request-deadline-ms": "100"}, **big)
            assert status == 503 and body["error"]["code"] == "deadline_exceeded"
            assert int(headers["retry-after-ms"]) > 0
            busy.join()
            metrics = srv.request("GET", "/metrics")[2].decode()
            assert 'tokenyard_policy_decisions_total{action="degrade"} 1.0' in metrics
            assert 'tokenyard_policy_decisions_total{action="shed"} 1.0' in metrics
    finally:
        delete_prefix(SHARED_REDIS, prefix)
