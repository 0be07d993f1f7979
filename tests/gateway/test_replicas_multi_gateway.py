"""Three gateway processes (`tokenyard serve`, mock engines) on one Redis share a tenant's rate
limit exactly: hammered through all three at once for several windows, the requests admitted
never exceed burst + rate x elapsed time, and the limit is not over-strict either (the approach
of test_rate_limit_exact.py, through the full gateway)."""
from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time

import yaml
from gateway_helpers import SHARED_REDIS, delete_prefix, unique_prefix
from replica_helpers import ROOT, free_port, get_json

WINDOW_S = 0.5
LIMIT = 10                 # requests per window: 20/s, burst 10
RUN_S = 2.5
KEY = "ty-multigateway-test-key"


def _hammer(port: int, stop_at: float, out: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = json.dumps({"model": "mock", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    while time.monotonic() < stop_at:
        sent = time.monotonic()
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        out.append((sent, time.monotonic(), resp.status, port))


def test_three_gateways_on_one_redis_keep_rate_limits_exact(tmp_path):
    prefix = unique_prefix("multigw")
    doc = {"server": {"access_log": False}, "redis_url": SHARED_REDIS, "redis_prefix": prefix,
           "rate_limits": {"window_s": WINDOW_S, "requests": LIMIT, "tokens": 0},
           "spend": {"spool_dir": str(tmp_path / "spool")},
           "engines": {"mock": {"type": "mock", "model": str(ROOT / "models" / "demo-small"), "output_len": 1}}}
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENYARD_DEV_KEY": KEY}
    env.pop("REDIS_URL", None)
    ports = [free_port() for _ in range(3)]
    procs = [subprocess.Popen([sys.executable, "-m", "tokenyard.cli.main", "serve", "--config", str(cfg), "--port", str(p)],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / f"gw{p}.log").open("wb"))
             for p in ports]
    try:
        deadline = time.monotonic() + 40
        for p in ports:
            while True:
                try:
                    if get_json(f"http://127.0.0.1:{p}/ready", 0.5)[0] == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, (tmp_path / f"gw{p}.log").read_text()[-2000:]
                time.sleep(0.05)
        results: list = []
        stop_at = time.monotonic() + RUN_S
        threads = [threading.Thread(target=_hammer, args=(ports[i % 3], stop_at, results)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        delete_prefix(SHARED_REDIS, prefix)
    statuses = {s for _, _, s, _ in results}
    assert statuses <= {200, 429}, statuses
    ok = [r for r in results if r[2] == 200]
    span = max(r[1] for r in results) - min(r[0] for r in results)
    allowed = LIMIT + LIMIT / WINDOW_S * span
    print(f"{len(results)} requests, {len(ok)} admitted in {span:.2f} s; allowed {allowed:.1f}")
    assert len(results) > 3 * len(ok), "the gateways were not pushed past the limit"
    assert len(ok) <= allowed, f"admitted {len(ok)} > burst + rate x time = {allowed:.1f}"
    assert len(ok) >= 0.8 * LIMIT / WINDOW_S * span, f"only {len(ok)} admitted of {allowed:.1f}"
    assert {r[3] for r in ok} == set(ports), "each gateway admitted some"
