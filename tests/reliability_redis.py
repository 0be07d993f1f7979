"""The Redis-outage scenario: a private redis-server stopped under traffic and started again,
with a fail-open and a fail-closed gateway."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from gateway_helpers import PrivateRedis, mock_deployment, running_gateway, wait_ledger
from reliability_common import Report, _counter, check_ledger, pct


# --- Redis outage ---------------------------------------------------------------------------------
def run_redis_outage(outage_s: float, gap_s: float = 0.02) -> Report:
    """A private redis-server stopped for outage_s under traffic, then started again (same data)."""
    import redis

    from tokenyard.gateway.auth.api_keys import KeyStore
    report = Report("redis outage")
    tmp = Path(tempfile.mkdtemp(prefix="tyrel-redis-"))
    private = PrivateRedis(tmp / "redis")
    prefix = "rel:"
    seen: dict[str, dict] = {}
    try:
        client = redis.Redis(port=private.port)
        store = KeyStore(client, prefix)
        acme, _ = store.create("acme", rpm=1_000_000, tpm=1_000_000_000)     # limited, but never reached
        globex, _ = store.create("globex", rpm=1_000_000, tpm=1_000_000_000)
        tight, _ = store.create("tight", rpm=2, tpm=1_000_000)   # 2 requests per minute
        unseen, _ = store.create("acme")                        # valid, never used before the outage

        def doc(mode: str, ttl: float) -> dict:
            engine = mock_deployment(ttft_ms=2, token_ms=2, output_len=10, max_sleep_ms=2)
            engine["engines"]["mock"]["prices"] = {"input": 123_457, "cached_input": 61_729, "output": 987_653}
            return {**engine,
                    "redis_url": private.url, "redis_prefix": prefix, "redis_timeout_ms": 200,
                    "auth": {"key_cache_ttl_s": ttl},
                    "rate_limits": {"on_redis_error": mode, "redis_retry_s": 0.2},
                    "spend": {"spool_dir": str(tmp / f"spool-{mode}"), "replay_interval_s": 0.2}}

        with running_gateway(doc("open", 0.5)) as fopen, running_gateway(doc("closed", 0.5)) as fclosed:
            counter = [0]

            def chat(srv, key: str, tag: str) -> tuple[int, dict, dict]:
                counter[0] += 1
                rid = f"{tag}-{counter[0]}"
                status, headers, body = srv.chat({"model": "mock", "max_tokens": 6,
                                                  "messages": [{"role": "user", "content": f"outage {rid}"}]},
                                                 {"Authorization": f"Bearer {key}", "x-request-id": rid})
                if status == 200:
                    seen[rid] = {"usage": body["usage"]}
                return status, headers, body

            for srv in (fopen, fclosed):
                for key in (acme, globex):
                    status, headers, _ = chat(srv, key, "before")
                    report.check(status == 200 and "x-ratelimit-remaining-tokens" in headers, "before the outage")
            report.check([chat(fopen, tight, "tight")[0] for _ in range(3)] == [200, 200, 429],
                         "the tight key is not limited before the outage")
            private.stop()
            t_stop = time.monotonic()
            during = {"open_ok": 0, "open_other": 0, "closed_503": 0, "closed_other": 0, "unknown_key_503": 0,
                      "bad_key_refused": 0, "tight_open_ok": 0}
            latencies = []
            rounds = 0
            while time.monotonic() - t_stop < outage_s:
                rounds += 1
                t0 = time.perf_counter()
                status, headers, body = chat(fopen, acme if rounds % 2 else globex, "open")
                latencies.append(time.perf_counter() - t0)
                during["open_ok" if status == 200 and "x-ratelimit-remaining-tokens" not in headers
                       else "open_other"] += 1
                status, headers, body = chat(fclosed, acme, "closed")
                closed_ok = status == 503 and body["error"]["code"] == "rate_limiter_unavailable" and \
                    int(headers.get("retry-after-ms", 0)) > 0
                during["closed_503" if closed_ok else "closed_other"] += 1
                if rounds % 10 == 1:
                    s1 = chat(fopen, unseen, "unseen")[2]
                    during["unknown_key_503"] += s1.get("error", {}).get("code") == "auth_unavailable"
                    during["bad_key_refused"] += chat(fclosed, "ty-not-a-key", "bad")[0] in (401, 503)
                    during["tight_open_ok"] += chat(fopen, tight, "tight")[0] == 200
                time.sleep(gap_s)
            report.check(during["open_other"] == 0, f"fail-open gateway refused cached keys: {during}")
            report.check(during["closed_other"] == 0, f"fail-closed gateway did not answer 503: {during}")
            report.check(during["unknown_key_503"] >= 1 and during["bad_key_refused"] >= 1, f"auth: {during}")
            report.check(during["tight_open_ok"] >= 1, "fail-open gateway still limits without Redis")
            private = private.restart()
            client.close()
            client = redis.Redis(port=private.port)
            t_back = time.monotonic()
            for srv in (fopen, fclosed):
                deadline = time.monotonic() + 30
                while True:   # limits come back once the guard retries Redis
                    status, headers, _ = chat(srv, acme, "after")
                    if status == 200 and "x-ratelimit-remaining-tokens" in headers:
                        break
                    report.check(status in (200, 503), f"after the outage: {status}")
                    if time.monotonic() > deadline:
                        report.problems.append("limits did not come back after Redis returned")
                        break
                    time.sleep(0.1)
            recovery_s = time.monotonic() - t_back
            # Limits apply again: 3 requests of a 2-per-minute key cannot all pass (GCRA has refilled
            # part of its bucket during a long outage, so not necessarily the very first one is refused).
            after = [chat(fopen, tight, "tight")[0] for _ in range(3)]
            report.check(429 in after and set(after) <= {200, 429}, f"the tight key is not limited after the outage: {after}")
            status, _, _ = chat(fopen, unseen, "unseen-after")
            report.check(status == 200, f"a valid key unknown to the cache is refused after the outage: {status}")
            for srv in (fopen, fclosed):
                wait_ledger(srv, timeout=60)
            spooled = sum(_counter(s.request("GET", "/metrics")[2].decode(), "tokenyard_spend_records_total"
                                  '{outcome="spooled"}') for s in (fopen, fclosed))
            reached = list(seen)   # every 200 reached the engine; refusals never do
            check_ledger(client, prefix, ["acme", "globex", "tight"], reached, seen, report)
            report.figures.update(outage_s=outage_s, requests_during_outage=sum(during.values()),
                                  served_from_key_cache=during["open_ok"], closed_503=during["closed_503"],
                                  unknown_key_503=during["unknown_key_503"], records_spooled=int(spooled),
                                  open_p99_ms=round(pct(latencies, 0.99) * 1000, 1),
                                  limits_back_after_s=round(recovery_s, 2))
        client.close()
    finally:
        private.stop()
    return report
