"""Two gateways on one Redis (one prefix) switch to a new policy version together: the one that
took the PUT installs it before answering; the other gets it through pub/sub well within a second."""
from __future__ import annotations

import time

from gateway_helpers import SHARED_REDIS, delete_prefix, running_gateway, unique_prefix
from policy_gateway_helpers import BASE_POLICY, chat, make_keys, put_policy, two_engine_deployment, wait_for


def test_two_gateways_switch_versions_together_via_pubsub():
    prefix = unique_prefix("polsync")
    keys = make_keys(prefix, "acme")
    pin = BASE_POLICY + "rules:\n  - name: everything-%s\n    action: {pin: %s}\n"
    try:
        with running_gateway(two_engine_deployment(prefix)) as one, running_gateway(two_engine_deployment(prefix)) as two:
            for version, engine in ((1, "small"), (2, "large"), (3, "small")):
                t0 = time.monotonic()
                status, body = put_policy(one, keys["admin"], pin % (engine, engine))
                assert status == 200 and body["version"] == version
                assert one.gateway.policy.number == version          # in force before the answer
                lag = wait_for(lambda: two.gateway.policy.number == version, timeout=1.0, step=0.002)
                assert time.monotonic() - t0 < 1.0 and lag < 1.0
                assert two.gateway.policy.version.hash == one.gateway.policy.version.hash
                for srv in (one, two):
                    status, headers, _ = chat(srv, keys["acme"])
                    assert status == 200 and headers["x-tokenyard-engine"] == engine
                    assert headers["x-tokenyard-route-reason"] == f"rule:everything-{engine}"
            # A rollback through the other gateway reaches the first the same way.
            status, _, _ = two.request("POST", "/admin/policy/rollback/2", headers={"Authorization": f"Bearer {keys['admin']}"})
            assert status == 200
            wait_for(lambda: one.gateway.policy.number == 4, timeout=1.0)
            assert one.gateway.policy.version.hash == two.gateway.policy.version.hash
    finally:
        delete_prefix(SHARED_REDIS, prefix)
