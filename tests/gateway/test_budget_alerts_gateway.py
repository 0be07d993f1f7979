"""Budget alerts through running gateways: a gateway stopped while its webhook receiver is down leaves
the alerts in the Redis outbox and the next gateway delivers each exactly once (signature checked
here by hand); across a Redis outage (a PRIVATE redis-server, stopped and restarted from its
append-only file) the thresholds crossed by spooled records fire once when the records are replayed;
`tokenyard spend alerts` lists them."""
from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import redis
from gateway_helpers import SHARED_REDIS, PrivateRedis, delete_prefix, running_gateway, unique_prefix, wait_ledger
from policy_gateway_helpers import BASE_POLICY, two_engine_deployment, wait_for

from tokenyard.gateway.spend.alerts import alerts_stream, outbox_key

SECRET = "gw-alert-secret"


class Receiver:
    """A webhook receiver on a free port; `status` is what it answers (after checking the signature)."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.got: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                ts, sig = self.headers["X-Tokenyard-Timestamp"], self.headers["X-Tokenyard-Signature"]
                mac = hmac.new(SECRET.encode(), ts.encode() + b"." + body, hashlib.sha256).hexdigest()
                signed = hmac.compare_digest("sha256=" + mac, sig)
                status = outer.status if signed else 401
                outer.got.append({"id": json.loads(body)["id"], "status": status, "alert": json.loads(body)})
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def delivered(self) -> list[str]:
        return [g["id"] for g in self.got if g["status"] == 200]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def alerts_config(url: str) -> dict:
    return {"interval_s": 0.1, "webhook_url": url, "backoff_s": 0.1, "max_backoff_s": 0.2, "timeout_s": 2,
            "lease_s": 3}


def chat(srv, model: str = "large", **body):
    return srv.chat({"model": model, "messages": [{"role": "user", "content": "Add 12 and 30."}], **body})


def test_alerts_left_in_the_outbox_by_a_stopped_gateway_are_delivered_once_by_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENYARD_ALERT_SECRET", SECRET)
    prefix = unique_prefix("alertgw")
    receiver = Receiver(503)
    policy = tmp_path / "policy.yaml"
    policy.write_text(BASE_POLICY + "tenants:\n  dev:\n    budget: {per_day: '0.00001', at_limit: downgrade}\n"
                      "    tag_budgets: {team: {search: {per_month: '0.00001'}}}\n")
    doc = two_engine_deployment(prefix, router={}, policy=str(policy),
                                spend={"alerts": alerts_config(receiver.url), "replay_interval_s": 0.1})
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        with running_gateway(doc) as srv:
            status, headers, _ = chat(srv, metadata={"team": "search"})
            assert status == 200 and headers["x-tokenyard-engine"] == "large"      # within budget before it
            wait_ledger(srv)
            wait_for(lambda: client.xlen(alerts_stream(prefix)) == 6, timeout=10)  # tenant + tag: 50, 80, 100 %
            wait_for(lambda: len({g["id"] for g in receiver.got}) == 6, timeout=10)
            srv.gateway.budgets.forget()
            status, _, body = chat(srv, metadata={"team": "search"})                # the tag budget denies
            assert status == 429 and body["error"]["code"] == "insufficient_quota"
            assert "tag team=search" in body["error"]["message"]
            status, headers, _ = chat(srv)                                          # the tenant's downgrades
            assert status == 200 and headers["x-tokenyard-route-reason"] == "budget_downgrade"
        # Stopped: every alert was tried, none accepted; all six wait in the outbox.
        assert receiver.got and not receiver.delivered() and client.hlen(outbox_key(prefix)) == 6
        receiver.status = 200
        with running_gateway(doc) as srv:
            wait_for(lambda: client.hlen(outbox_key(prefix)) == 0, timeout=10)
            assert chat(srv)[0] == 200                                              # more spend: nothing new
            wait_ledger(srv)
            time.sleep(0.5)
        ids = [a[1][b"a"] for a in client.xrange(alerts_stream(prefix))]
        fired = sorted(json.loads(a)["id"] for a in ids)
        assert len(fired) == 6 and sorted(receiver.delivered()) == fired           # each delivered exactly once
        kinds = sorted((g["alert"]["scope"], g["alert"]["period"], g["alert"]["threshold_pct"])
                       for g in receiver.got if g["status"] == 200)
        assert kinds == sorted((s, p, t) for s, p in (("tenant", "day"), ("tag", "month")) for t in (50, 80, 100))
        # The CLI lists them.
        import contextlib
        import io

        import yaml

        from tokenyard.cli.main import main
        config = tmp_path / "deployment.yaml"
        config.write_text(yaml.safe_dump(doc))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["spend", "--config", str(config), "alerts", "--since", "1h", "--format", "json"])
        listed = json.loads(out.getvalue())
        assert rc == 0 and sorted(a["id"] for a in listed["alerts"]) == fired
        assert listed["outbox"] == {"pending": 0, "dead": 0}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["spend", "--config", str(config), "alerts", "--since", "1h", "--tenant", "dev"])
        assert "tag team=search" in out.getvalue() and "100%" in out.getvalue()
    finally:
        receiver.close()
        client.close()
        delete_prefix(SHARED_REDIS, prefix)


def test_alerts_fire_once_when_records_spooled_in_a_redis_outage_are_replayed(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENYARD_ALERT_SECRET", SECRET)
    private = PrivateRedis(tmp_path / "redis")
    receiver = Receiver(200)
    prefix = "alertoutage:"
    doc = two_engine_deployment(prefix, router={}, redis_url=private.url, redis_timeout_ms=200,
                                rate_limits={"redis_retry_s": 0.2},
                                spend={"alerts": alerts_config(receiver.url), "replay_interval_s": 0.1,
                                       "spool_dir": str(tmp_path / "spool")})
    prices = "prices:\n  small: {input: 1, cached_input: 1, output: 1}\n  large: {input: 1, cached_input: 1, output: 1}\n"
    try:
        with running_gateway(doc) as srv:
            text = BASE_POLICY.split("prices:")[0] + prices + "router:\n  without_score: large\n"
            assert srv.request("PUT", "/admin/policy", text, {"Content-Type": "application/yaml"})[0] == 200
            assert chat(srv)[0] == 200
            wait_ledger(srv)
            cost = srv.gateway.usage.records[-1].cost_micros                        # 1 micro-unit per token
            assert cost > 10
            text += f"tenants:\n  dev:\n    budget: {{per_day: '{4 * cost / 1e6:.6f}', at_limit: downgrade}}\n"
            status, _, body = srv.request("PUT", "/admin/policy", text, {"Content-Type": "application/yaml"})
            assert status == 200, body
            time.sleep(0.4)                                                         # a pass: 25 %, nothing
            client = redis.Redis(port=private.port)
            assert client.xlen(alerts_stream(prefix)) == 0, (cost, text, client.xrange(alerts_stream(prefix)))
            client.close()
            private.stop()                                                          # Redis goes away
            for _ in range(4):                                                      # 125 % of the budget, spooled
                assert chat(srv)[0] == 200                                          # budgets fail open
            wait_ledger(srv, spool_empty=False)
            assert srv.gateway.ledger.spool.pending()
            time.sleep(0.4)                                                         # passes fail meanwhile
            private = private.restart()                                             # back, same data
            client = redis.Redis(port=private.port)
            wait_ledger(srv, timeout=20)
            wait_for(lambda: len(receiver.delivered()) == 3, timeout=10)
            # Redis restarts once more and more spend comes: nothing fires twice.
            private = private.restart()
            client.close()
            client = redis.Redis(port=private.port)
            for _ in range(2):
                chat(srv)
            wait_ledger(srv, timeout=20)
            time.sleep(0.6)
            alerts = [json.loads(a[1][b"a"]) for a in client.xrange(alerts_stream(prefix))]
            client.close()
        assert sorted(a["threshold_pct"] for a in alerts) == [50, 80, 100]
        assert all(a["budget"] == "tenant" and a["limit_micros"] == 4 * cost for a in alerts)
        assert sorted(receiver.delivered()) == sorted(a["id"] for a in alerts)
        assert len(receiver.got) == 3
    finally:
        receiver.close()
        private.stop()


def test_key_budget_by_name_denies_that_key_only(tmp_path):
    """A key budget counts the key's own spend (the dimension rollup the ledger wrote): the dev key
    (named "dev") is refused at its limit while another key of the same tenant is served."""
    from tokenyard.gateway.auth.api_keys import KeyStore
    prefix = unique_prefix("keybudget")
    policy = tmp_path / "policy.yaml"
    policy.write_text(BASE_POLICY + "tenants:\n  dev:\n    key_budgets: {dev: {per_day: '0.00001', at_limit: deny},"
                      " '*': {per_day: 1000, at_limit: downgrade}}\n")
    doc = two_engine_deployment(prefix, router={}, policy=str(policy), spend={"alerts": {"enabled": False}})
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        other = KeyStore(client, prefix).create("dev", name="other")[0]
        with running_gateway(doc) as srv:
            assert chat(srv)[0] == 200
            wait_ledger(srv)
            srv.gateway.budgets.forget()
            status, _, body = chat(srv)
            assert status == 429 and "key dev (" in body["error"]["message"], body
            status, headers, _ = srv.chat({"model": "large", "messages": [{"role": "user", "content": "hi"}]},
                                          {"Authorization": f"Bearer {other}"})
            assert status == 200 and headers["x-tokenyard-engine"] == "large"
            assert srv.gateway.alerts is None                 # spend.alerts.enabled: false
    finally:
        client.close()
        delete_prefix(SHARED_REDIS, prefix)
