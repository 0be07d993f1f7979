"""Replica cold start, by phase (issue 52, item 1): `tokenyard engine serve` from process start to
ready, per engine of the packaged deployment, `--repeats` fresh processes each.

For each start: the wall time the launcher saw (Popen to the first /ready 200), the replica's own
`tokenyard_engine_startup_seconds` phases (imports, weights_read, quantise_pack, kv_allocation,
compile, warm_up, other), and the latency of the first and the tenth request after ready (the same
short prompt, `--max-tokens` greedy tokens, one at a time) to show what is still paid lazily.
Reported per engine: the median of each figure over the repeats.

With `--first-after-s S` (the first request S seconds after ready), the sixth request is also sent
after a rest of S seconds (`--control-pause-s`): a control that tells a cost of the first request
(lazy work, first calls) from a cost of any request after a rest (a cold CPU, threads put to sleep),
reported as first / sixth and sixth / tenth over the starts.

The prepared-weights cache (docs/engine.md, "Start-up and the prepared-weights cache") is measured
in a folder of the bench's own: `--weight-cache warm` (default) fills it with one unrecorded start per
engine, then records starts that read it; `cold` gives every recorded start an empty folder (it
computes and stores everything, as a first start on a machine does); `off` runs without the cache.

    python -m tokenyard.bench.startup_bench [--engines demo-small demo-large smollm2-135m] [--repeats 3]
        [--weight-cache warm|cold|off] [--first-tolerance 1.05] [--first-after-s 0] [--control-pause-s S]
        [--name startup_phases]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from tokenyard.bench.serve_launch import free_port, stop_processes

ROOT = Path(__file__).resolve().parent.parent.parent
CONTROL_AT = 5          # the request (0-based) sent after the control pause: the sixth
PHASE_RE = re.compile(r'^tokenyard_engine_startup_seconds{engine="[^"]+",phase="([a-z_]+)"} (\S+)$', re.M)


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _generate(base: str, rid: str, max_tokens: int) -> float:
    body = json.dumps({"request_id": rid, "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                       "params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}).encode()
    req = urllib.request.Request(base + "/v1/engine/generate", body, {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        lines = r.read().splitlines()
    if not lines or not json.loads(lines[-1]).get("finished"):
        raise RuntimeError(f"request {rid} did not finish: {lines[-1:]}")
    return time.perf_counter() - t0


def one_start(engine: str, max_tokens: int, timeout_s: float, cache_env: dict[str, str] | None = None,
              first_after_s: float = 0.0, control_pause_s: float = 0.0) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(cache_env or {})}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tokenyard.cli.main", "engine", "serve", "--engine", engine,
                             "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{engine} exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{engine} not ready after {timeout_s} s")
            try:
                if _get(base + "/ready", 0.5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.02)
        ready_wall = time.monotonic() - t0
        phases = {m.group(1): float(m.group(2)) for m in PHASE_RE.finditer(_get(base + "/metrics")[1].decode())}
        latencies, engine_s, sent_after_ready = [], [], []
        time.sleep(first_after_s)      # a replica that waits for traffic: whatever runs in the meantime shows
        for i in range(10):
            if i == CONTROL_AT:
                time.sleep(control_pause_s)    # the control: a later request after the same rest
            before = _busy_s(base)
            sent_after_ready.append(time.monotonic() - t0 - ready_wall)
            latencies.append(_generate(base, f"r{i}", max_tokens))
            engine_s.append(_busy_s(base) - before)
    finally:
        stop_processes(proc, grace_s=30)
    return {"engine": engine, "ready_wall_s": ready_wall, "phases_s": phases,
            "reported_total_s": sum(phases.values()), "first_request_s": latencies[0],
            "tenth_request_s": latencies[9],
            # Every request's latency, the engine's own busy seconds in it (its steps, from
            # /v1/engine/stats: what is not in them was paid outside the engine's step), and when it
            # was sent (seconds after ready was seen).
            "latencies_s": latencies, "engine_busy_s": engine_s, "sent_after_ready_s": sent_after_ready,
            "first_over_median_of_rest": latencies[0] / statistics.median(latencies[1:])}


def _busy_s(base: str) -> float:
    return float(json.loads(_get(base + "/v1/engine/stats")[1])["busy_seconds"])


def position_ratios(latencies: list[list[float]]) -> list[float]:
    """Per request position (0 = first after ready), the geometric mean over starts of that request's
    latency over the median of the start's other requests. The control for the first: a position
    that is no slower than the rest sits near 1.0, with the spread any position shows."""
    n = min(len(lat) for lat in latencies)
    out = []
    for pos in range(n):
        logs = [math.log(lat[pos] / statistics.median(lat[:pos] + lat[pos + 1:n])) for lat in latencies]
        out.append(math.exp(statistics.fmean(logs)))
    return out


def control_figures(latencies: list[list[float]]) -> dict[str, float | list[float]]:
    """Over the starts (each 10 latencies, the sixth sent after the same rest as the first): first /
    sixth (near 1: the first pays nothing of its own) and sixth / tenth (what a rest costs any
    request), each a geometric mean with its 95 % bootstrap interval."""
    full = [lat for lat in latencies if len(lat) >= 10]
    out: dict[str, float | list[float]] = {}
    for key, (a, b) in (("first_over_control", (0, CONTROL_AT)), ("control_over_tenth", (CONTROL_AT, 9))):
        mean, lo, hi = geomean_ci([lat[a] / lat[b] for lat in full] or [1.0])
        out[f"{key}_geomean"], out[f"{key}_ci95"] = mean, [lo, hi]
    return out


def geomean_ci(ratios: list[float], resamples: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """Geometric mean of ratios and its 95 % bootstrap interval over starts (resampled with a fixed seed)."""
    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    lo, hi = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return math.exp(statistics.fmean(logs)), math.exp(lo), math.exp(hi)


def _cache_env(mode: str, folder: Path) -> dict[str, str]:
    if mode == "off":
        return {"TOKENYARD_WEIGHT_CACHE": "off"}
    return {"TOKENYARD_WEIGHT_CACHE": "on", "TOKENYARD_WEIGHT_CACHE_DIR": str(folder)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", nargs="+", default=["demo-small", "demo-large", "smollm2-135m"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--first-tolerance", type=float, default=1.05,
                    help="a start's first request counts as no slower when <= this x the median of requests 2-10")
    ap.add_argument("--first-after-s", type=float, default=0.0,
                    help="send the first request this many seconds after ready (default 0: at once); work a "
                         "replica does in its first idle seconds shows on requests sent then")
    ap.add_argument("--control-pause-s", type=float, default=None,
                    help="rest before the sixth request, the first's control (default: --first-after-s)")
    ap.add_argument("--ready-goal-s", type=float, default=2.0,
                    help="count the starts ready (Popen to /ready 200) within this many seconds (issue 52: 2 s)")
    ap.add_argument("--weight-cache", choices=("warm", "cold", "off"), default="warm",
                    help="prepared-weights cache: read back (warm), empty at every start (cold), or off")
    ap.add_argument("--name", default="startup_phases", help="results file: bench/results/NAME.json")
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/NAME.json")
    args = ap.parse_args()
    control_pause_s = args.first_after_s if args.control_pause_s is None else args.control_pause_s
    if control_pause_s < 0 or args.first_after_s < 0:
        ap.error("--first-after-s and --control-pause-s must be >= 0")
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder(args.name)
    runs = []
    with tempfile.TemporaryDirectory(prefix="tokenyard-startup-") as tmp:
        for engine in args.engines:
            if args.weight_cache == "warm":      # fill the folder: one start, not recorded
                one_start(engine, 1, args.timeout_s, _cache_env("warm", Path(tmp) / "warm"))
            for i in range(args.repeats):
                env = _cache_env(args.weight_cache, Path(tmp) / ("warm" if args.weight_cache == "warm" else f"{engine}-{i}"))
                runs.append({**one_start(engine, args.max_tokens, args.timeout_s, env, args.first_after_s, control_pause_s),
                             "weight_cache": args.weight_cache, "first_after_s": args.first_after_s,
                             "control_pause_s": control_pause_s})
                print(json.dumps(runs[-1]), flush=True)
    figures = {}
    for engine in args.engines:
        mine = [r for r in runs if r["engine"] == engine]
        names = sorted({p for r in mine for p in r["phases_s"]}, key=lambda p: list(mine[0]["phases_s"]).index(p)
                       if p in mine[0]["phases_s"] else 99)
        figures[engine] = {
            "ready_wall_s": statistics.median(r["ready_wall_s"] for r in mine),
            "reported_total_s": statistics.median(r["reported_total_s"] for r in mine),
            "phases_s": {p: statistics.median(r["phases_s"].get(p, 0.0) for r in mine) for p in names},
            "first_request_s": statistics.median(r["first_request_s"] for r in mine),
            "tenth_request_s": statistics.median(r["tenth_request_s"] for r in mine),
            # "the first request after ready no slower than the tenth", read as: first <= median of
            # requests 2-10 x --first-tolerance (the tenth alone varies by more than the gap sought)
            "first_over_median_of_rest": statistics.median(r["first_over_median_of_rest"] for r in mine),
            "starts_first_no_slower": sum(r["first_over_median_of_rest"] <= args.first_tolerance for r in mine),
            "starts": len(mine),
            # every start, not the median: the ready goal is per start
            "ready_wall_s_max": max(r["ready_wall_s"] for r in mine),
            "starts_ready_within_goal": sum(r["ready_wall_s"] <= args.ready_goal_s for r in mine)}
        if len(mine) >= 2:
            # One start's first-over-rest ratio moves by more than the tolerance with the machine's noise
            # alone (every later position is "slower" in some starts too): over the starts, the first
            # request's ratio to the tenth (geometric mean, 95 % bootstrap interval) and each position's
            # ratio to the rest of its start, the control the first is read against.
            mean, lo, hi = geomean_ci([r["latencies_s"][0] / r["latencies_s"][9] for r in mine
                                       if len(r["latencies_s"]) >= 10] or [1.0])
            figures[engine]["first_over_tenth_geomean"] = mean
            figures[engine]["first_over_tenth_ci95"] = [lo, hi]
            figures[engine]["position_over_rest_geomean"] = position_ratios([r["latencies_s"] for r in mine])
            if control_pause_s > 0:
                figures[engine].update(control_figures([r["latencies_s"] for r in mine]))
    print(json.dumps(figures, indent=1))
    if not args.no_results:
        print("wrote", rec.write(figures, runs, repeats=args.repeats, max_tokens=args.max_tokens,
                                 weight_cache=args.weight_cache, first_tolerance=args.first_tolerance,
                                 ready_goal_s=args.ready_goal_s, first_after_s=args.first_after_s,
                                 control_pause_s=control_pause_s,
                                 engine_process=os.environ.get("TOKENYARD_ENGINE_PROCESS", "auto")))


if __name__ == "__main__":
    main()
