"""One hostile request must not freeze the gateway (issue 46, items 1-2): while a single request of
each hostile kind runs through `tokenyard serve` (loopback), /health is polled every ~10 ms and
another stream runs on a different engine; the goals are /health p99 <= 50 ms and no gap between
the other stream's chunks over 200 ms.

Engines: "demo" (torch, models/demo-small: real grammars) takes the hostile requests; "other" (mock,
a token every 5 ms) streams the other request. Both modes: engines stepped on a thread of the gateway
(the default) and each in a process of its own (server.engine_process). Hostile kinds:
  multipleof_issue   the issue's schema: 50 integer properties, multipleOf 1024, 1023, ... 975 (it
                     took 24.5 s to compile on SmolLM2; now refused by the keyword check: no range)
  multipleof_bounded the same with a range of 256 multiples each (compiles: worker, then the engine)
  slow_patterns      four strings of 500..4000 letter-digit pairs (24 s to compile on demo-small:
                     refused when the grammar worker is killed at grammar_compile_timeout_s, 5 s)
  tools_1mb          a ~1 MB body of 100 tools with long descriptions (refused before templating)
Each is measured over [its start, max(its end, start + 2 s)], so the p99 has ~150+ samples even when
the refusal is immediate. The gateway's dev key sends everything (no Redis).

    .venv/bin/python -m tokenyard.bench.hostile_requests     # writes bench/results/hostile_requests.json
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import threading
import time
from pathlib import Path

from tokenyard.bench.serve_launch import _stop, free_port, spawn_gateway

ROOT = Path(__file__).resolve().parent.parent.parent
OUT = ROOT / "bench" / "out"
MIN_WINDOW_S = 2.0
HEALTH_EVERY_S = 0.010
GOAL_HEALTH_P99_S = 0.050
GOAL_GAP_S = 0.200


def hostile_bodies() -> dict[str, dict]:
    def fmt(name: str, schema: dict) -> dict:
        return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}

    def chat(response_format: dict) -> dict:
        return {"model": "demo", "messages": [{"role": "user", "content": "Fill the form."}], "max_tokens": 8,
                "response_format": response_format}

    issue = {"type": "object", "properties": {f"f{i}": {"type": "integer", "multipleOf": 1024 - i} for i in range(50)},
             "required": [f"f{i}" for i in range(50)]}
    bounded = {"type": "object", "required": [f"f{i}" for i in range(50)], "properties": {
        f"f{i}": {"type": "integer", "multipleOf": 1024 - i, "minimum": 0, "maximum": (1024 - i) * 255}
        for i in range(50)}}
    patterns = {"type": "object", "required": [f"p{i}" for i in range(4)], "properties": {
        f"p{i}": {"type": "string", "pattern": "^([a-z][0-9]){%d,%d}$" % (500 + i, 4000 + i)} for i in range(4)}}
    desc = " ".join(["describe"] * 1100)
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": desc,
                                               "parameters": {"type": "object", "properties": {}}}} for i in range(100)]
    return {"multipleof_issue": chat(fmt("issue", issue)),
            "multipleof_bounded": chat(fmt("bounded", bounded)),
            "slow_patterns": chat(fmt("patterns", patterns)),
            "tools_1mb": {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                          "max_tokens": 8}}


class Health:
    """GET /health every ~10 ms on one keep-alive connection; (start time, latency) of each."""

    def __init__(self, port: int, key: str) -> None:
        self.port, self.key = port, key
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while not self.stop.is_set():
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            self.samples.append((t0, time.perf_counter() - t0))
            time.sleep(HEALTH_EVERY_S)
        conn.close()


class OtherStream:
    """A long stream on the mock engine; arrival time of each chunk with text."""

    def __init__(self, port: int, key: str) -> None:
        self.port, self.key = port, key
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        body = {"model": "other", "messages": [{"role": "user", "content": "stream"}], "max_tokens": 4000,
                "stream": True}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        while not self.stop.is_set() and (line := resp.readline()):
            if line.startswith(b"data: {") and b'"content":"' in line.replace(b" ", b""):
                self.times.append(time.perf_counter())
        conn.close()


def post(port: int, key: str, body: dict) -> tuple[int, str | None, float, int]:
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=data,
                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    doc = json.loads(resp.read() or b"null")
    conn.close()
    code = (doc.get("error") or {}).get("code") if isinstance(doc, dict) else None
    return resp.status, code, time.perf_counter() - t0, len(data)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def measure(port: int, key: str, kind: str, body: dict) -> dict:
    health, other = Health(port, key), OtherStream(port, key)
    other.thread.start()
    deadline = time.monotonic() + 30
    while not other.times:
        if time.monotonic() > deadline:
            raise RuntimeError("the other stream did not start")
        time.sleep(0.005)
    health.thread.start()
    time.sleep(0.5)                                  # a baseline of both before the hostile request
    start = time.perf_counter()
    status, code, took, size = post(port, key, body)
    end = max(start + took, start + MIN_WINDOW_S)
    while time.perf_counter() < end + 0.1:
        time.sleep(0.02)
    health.stop.set()
    other.stop.set()
    health.thread.join(30)
    other.thread.join(30)
    lat = [d for t, d in health.samples if start <= t <= end]
    gaps = [b - a for a, b in zip(other.times, other.times[1:]) if start <= b <= end + GAP_GOAL_PAD]
    return {"kind": kind, "body_bytes": size, "status": status, "error_code": code, "request_s": round(took, 3),
            "window_s": round(end - start, 3), "health_samples": len(lat),
            "health_p50_ms": round(pct(lat, 0.5) * 1e3, 2), "health_p99_ms": round(pct(lat, 0.99) * 1e3, 2),
            "health_max_ms": round(max(lat, default=float("nan")) * 1e3, 2),
            "stream_chunks": sum(1 for t in other.times if start <= t <= end),
            "stream_max_gap_ms": round(max(gaps, default=float("nan")) * 1e3, 2),
            "health_goal_met": pct(lat, 0.99) <= GOAL_HEALTH_P99_S,
            "gap_goal_met": bool(gaps) and max(gaps) <= GOAL_GAP_S}


GAP_GOAL_PAD = 0.25      # a gap that ends just after the window still began inside it


def run_mode(engine_process: bool, kinds: list[str]) -> list[dict]:
    OUT.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cfg = OUT / f"hostile_requests_{'process' if engine_process else 'thread'}.yaml"
    cfg.write_text(json.dumps({
        "server": {"host": "127.0.0.1", "port": port, "access_log": False, "engine_process": engine_process},
        "engines": {"demo": {"type": "torch", "model": str(ROOT / "models" / "demo-small"), "dtype": "float32",
                             "kv_cache_memory": 8 << 20},
                    "other": {"type": "mock", "model": str(ROOT / "models" / "demo-small"), "token_ms": 5,
                              "output_len": 4000}}}))
    key = "bench-admin-" + secrets.token_hex(8)
    proc = spawn_gateway(cfg, {**os.environ, "TOKENYARD_DEV_KEY": key}, port, timeout_s=300)
    try:
        warm = {"type": "json_schema", "json_schema": {"name": "warm", "schema": {
            "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}}}
        status, _, _, _ = post(port, key, {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 4, "response_format": warm})
        if status != 200:
            raise RuntimeError(f"warm-up schema request answered {status}")
        bodies = hostile_bodies()
        rows = []
        for kind in kinds:
            row = {"mode": "engine_process" if engine_process else "thread", **measure(port, key, kind, bodies[kind])}
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        _stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="thread,engine_process")
    ap.add_argument("--kinds", default="multipleof_issue,multipleof_bounded,slow_patterns,tools_1mb")
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/hostile_requests.json")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder("hostile_requests")
    kinds = args.kinds.split(",")
    runs = [row for mode in args.modes.split(",") for row in run_mode(mode == "engine_process", kinds)]
    figures = {f"{r['mode']}_{r['kind']}_{k}": r[k] for r in runs
               for k in ("status", "health_p99_ms", "stream_max_gap_ms")}
    figures["all_goals_met"] = all(r["health_goal_met"] and r["gap_goal_met"] for r in runs)
    if not args.no_results:
        rec.write(figures, runs, goal_health_p99_ms=GOAL_HEALTH_P99_S * 1e3, goal_max_gap_ms=GOAL_GAP_S * 1e3,
                  health_every_ms=HEALTH_EVERY_S * 1e3, min_window_s=MIN_WINDOW_S)


if __name__ == "__main__":
    main()
