"""Wake time per sleep level against a cold start (issue 52, item 2), on `tokenyard engine serve`
replicas of the packaged deployment's engines.

Per engine: one replica is started (cold start: Popen to the first /ready 200, and the first
request's latency); its greedy reference tokens are taken; then `--repeats` times for each level:
POST /v1/engine/sleep (its seconds, the process's resident memory before and after), POST
/v1/engine/wake (the call's wall time and the phases the replica reports), and a request whose
tokens must equal the reference. Then, per level, a request sent to the sleeping replica with no
wake call (the wake on demand: that request's latency vs an awake replica's).

    python -m tokenyard.bench.sleep_wake_bench [--engines demo-small smollm2-135m] [--repeats 3]

Writes bench/results/sleep_wake.json (tokenyard.bench.results_io.RunRecorder).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tokenyard.bench.serve_launch import free_port, stop_processes

ROOT = Path(__file__).resolve().parent.parent.parent
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]


def _call(url: str, body: dict | None = None, timeout: float = 600.0) -> tuple[int, Any, float]:
    """(status, JSON answer, wall seconds) of a GET (body None) or POST."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    return status, json.loads(raw) if raw else None, time.perf_counter() - t0


def _generate(base: str, rid: str, max_tokens: int) -> tuple[list[int], float]:
    body = json.dumps({"request_id": rid, "prompt_token_ids": PROMPT,
                       "params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}).encode()
    req = urllib.request.Request(base + "/v1/engine/generate", body, {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        lines = [json.loads(x) for x in r.read().splitlines() if x.strip()]
    if not lines or not lines[-1].get("finished") or lines[-1].get("finish_reason") == "error":
        raise RuntimeError(f"request {rid} did not finish: {lines[-1:]}")
    return [t for line in lines for t in line["new_token_ids"]], time.perf_counter() - t0


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _start(engine: str, timeout_s: float) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tokenyard.cli.main", "engine", "serve", "--engine", engine,
                             "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        if time.monotonic() - t0 > timeout_s:
            proc.kill()
            raise RuntimeError(f"{engine} not ready after {timeout_s} s")
        try:
            if _call(base + "/ready", timeout=0.5)[0] == 200:
                return proc, base, time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.02)


def bench_engine(engine: str, repeats: int, max_tokens: int, timeout_s: float) -> dict[str, Any]:
    proc, base, cold_s = _start(engine, timeout_s)
    try:
        ref, first_s = _generate(base, "ref", max_tokens)
        _, awake_s = _generate(base, "awake", max_tokens)
        cycles = []
        for level in (1, 2):
            for i in range(repeats):
                rss_awake = _rss_mib(proc.pid)
                status, slept, sleep_wall = _call(base + "/v1/engine/sleep", {"level": level})
                if status != 200:
                    raise RuntimeError(f"{engine}: sleep {level} answered {status}: {slept}")
                rss_asleep = _rss_mib(proc.pid)
                status, woke, wake_wall = _call(base + "/v1/engine/wake", {})
                if status != 200:
                    raise RuntimeError(f"{engine}: wake answered {status}: {woke}")
                tokens, after_s = _generate(base, f"l{level}-{i}", max_tokens)
                cycles.append({"level": level, "sleep_s": slept["seconds"], "sleep_wall_s": sleep_wall,
                               "wake_wall_s": wake_wall, "wake_s": woke["seconds"], "wake_phases_s": woke["phases"],
                               "rss_awake_mib": rss_awake, "rss_asleep_mib": rss_asleep,
                               "first_request_after_wake_s": after_s, "tokens_equal": tokens == ref})
                print(json.dumps({"engine": engine, **cycles[-1]}), flush=True)
        on_demand = []
        for level in (1, 2):
            _call(base + "/v1/engine/sleep", {"level": level})
            tokens, latency = _generate(base, f"demand-{level}", max_tokens)   # wakes the replica itself
            on_demand.append({"level": level, "request_s": latency, "tokens_equal": tokens == ref})
    finally:
        stop_processes(proc, grace_s=30)
    return {"engine": engine, "cold_start_ready_s": cold_s, "first_request_s": first_s, "awake_request_s": awake_s,
            "reference_tokens": ref, "cycles": cycles, "on_demand": on_demand}


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"cold_start_ready_s": run["cold_start_ready_s"], "awake_request_s": run["awake_request_s"]}
    for level in (1, 2):
        mine = [c for c in run["cycles"] if c["level"] == level]
        demand = next(d for d in run["on_demand"] if d["level"] == level)
        wake = statistics.median(c["wake_wall_s"] for c in mine)
        out[f"level{level}"] = {
            "sleep_s": statistics.median(c["sleep_s"] for c in mine),
            "wake_s": wake, "wake_vs_cold_start": wake / run["cold_start_ready_s"],
            "rss_awake_mib": statistics.median(c["rss_awake_mib"] for c in mine),
            "rss_asleep_mib": statistics.median(c["rss_asleep_mib"] for c in mine),
            "first_request_after_wake_s": statistics.median(c["first_request_after_wake_s"] for c in mine),
            "request_to_sleeping_replica_s": demand["request_s"],
            "tokens_equal": all(c["tokens_equal"] for c in mine) and demand["tokens_equal"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", nargs="+", default=["demo-small", "smollm2-135m"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/sleep_wake.json")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder("sleep_wake")
    runs = [bench_engine(e, args.repeats, args.max_tokens, args.timeout_s) for e in args.engines]
    figures = {r["engine"]: summarise(r) for r in runs}
    print(json.dumps(figures, indent=1))
    if not args.no_results:
        print("wrote", rec.write(figures, runs, repeats=args.repeats, max_tokens=args.max_tokens))


if __name__ == "__main__":
    main()
