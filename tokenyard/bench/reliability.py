"""The reliability suite at full size (issue 15): the same scenarios as tests/test_reliability_*.py
and tests/gateway/test_fuzz_openapi.py (tests/reliability_*.py), with the sizes of the issue.

    .venv/bin/python -m tokenyard.bench.reliability all            # everything below, one summary table
    .venv/bin/python -m tokenyard.bench.reliability overload       # 3x capacity for 60 s (--seconds)
    .venv/bin/python -m tokenyard.bench.reliability disconnects    # 10,000 mock + 1,000 demo-small requests (--mock-n, --demo-n)
    .venv/bin/python -m tokenyard.bench.reliability engine-failure # 20 step exceptions + 3 killed tensor-parallel workers
    .venv/bin/python -m tokenyard.bench.reliability redis          # Redis down 30 s under traffic and back (--outage-s)
    .venv/bin/python -m tokenyard.bench.reliability fuzz           # schemathesis, 150 cases per operation and mode
    .venv/bin/python -m tokenyard.bench.reliability flood          # 400 made-up-key clients, then 1,000 clients, 30 s each
    .venv/bin/python -m tokenyard.bench.reliability slow-connections  # 20,400 slow-header sockets next to a normal client
    --json PATH writes the figures through bench/results_io (date, machine, commit, command, load) to PATH.

Needs the shared Redis on 127.0.0.1:6379 (unique prefixes, deleted afterwards) and
/usr/bin/redis-server (the outage runs on a private one). Everything is loopback. Prints each
scenario's figures and problems, then a table; exits 1 if any promise was broken.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tests"))   # the scenarios live with the tests that run them small

from reliability_common import Report  # noqa: E402
from reliability_disconnects import run_disconnects  # noqa: E402
from reliability_edge import run_slow_connections, run_unauth_flood  # noqa: E402
from reliability_failures import run_step_exceptions, run_tp_worker_kills, tp_checkpoint  # noqa: E402
from reliability_fuzz import run_fuzz  # noqa: E402
from reliability_overload import run_overload  # noqa: E402
from reliability_redis import run_redis_outage  # noqa: E402


def _row(report: "Report") -> tuple[str, str, str]:
    f = report.figures
    name = report.name
    if name == "overload":
        held = (f"{f['offered_rps']} rps offered ({f['offered_rps'] / f['capacity_rps']:.0f}x {f['capacity_rps']}) "
                f"for {f['seconds']:.0f} s: {f['requests']} requests, {f['served_rps']} rps served, {f['shed']} shed")
        detail = (f"shed p99 {f['shed_at_once_p99_ms']} ms (gateway {f['shed_server_p99_ms']} ms), TTFT p99 "
                  f"{f['admitted_ttft_p99_ms']} ms vs SLO {f['deadline_ms']} ms, hung {f['hung']}, "
                  f"statuses {f['statuses']}")
    elif name.startswith("disconnects"):
        held = (f"{f['requests']} requests in {f['seconds']} s, {f['cut']} cut, {f['completed']} complete, "
                f"{f['reached_engine']} reached the engine")
        detail = (f"KV free after {f['kv_blocks_free_after']}, records {f['records']}, lost {f['records_lost']}, "
                  f"usage mismatches {f['usage_mismatches']}, errors logged {f['error_logs']}")
    elif name == "redis outage":
        held = (f"Redis down {f['outage_s']:.0f} s: {f['requests_during_outage']} requests, "
                f"{f['served_from_key_cache']} served from the key cache (open), {f['closed_503']} 503 (closed)")
        detail = (f"unknown keys 503 {f['unknown_key_503']}, spooled {f['records_spooled']}, records {f['records']}, "
                  f"lost {f['records_lost']}, limits back after {f['limits_back_after_s']} s")
    elif name == "unauthenticated flood":
        held = (f"{f['flooders']} made-up-key clients ({f['flood_requests']} requests), then {f['clients']} "
                f"clients, {f['seconds']:.0f} s each")
        detail = (f"5/min tenant {f['tight_successes']} <= {f['tight_bound']}, 10/min tenant "
                  f"{f['limited_successes']} <= {f['limited_bound']}, first-time keys in {f['fresh_keys_in']}/"
                  f"{f['fresh_keys']}, redis errors {f['redis_errors']}, busy {f['redis_busy']}")
    elif name == "slow connections":
        held = f"{f['attack'].get('opened')} slow-header sockets, {f['held_at_once']} at once"
        detail = (f"probe p50/p99 {f['probe_p50_ms_during']}/{f['probe_p99_ms_during']} ms (before "
                  f"{f['probe_p50_ms_before']}/{f['probe_p99_ms_before']}), failed {f['probes_failed']}, gateway fds "
                  f"max {f['gateway_fds_max']}, stderr {f['gateway_stderr_bytes']} B")
    elif name.startswith("fuzz"):
        held = f"{f['cases']} cases over {f['operations']} operations in {f['seconds']} s"
        detail = f"statuses {f['statuses']}, bad responses {f['failures']}, errors logged {f['error_logs']}"
    else:
        held = f"{f['faults']} faults, {f['restarts']} restarts"
        detail = f"in-flight failed cleanly {f['in_flight_failed_cleanly']}, KV free after {f['kv_blocks_free_after']}"
        if "restart_s_max" in f:
            detail += f", slowest restart {f['restart_s_max']} s"
    return name, held, detail + ("" if not report.problems else f"; PROBLEMS: {report.problems}")


def _write_json(recorder, reports: list) -> None:
    """Raw output through bench/results_io (date, machine, commit, command, load): one figures entry per
    scenario, and its problems (none when it held)."""
    figures = {r.name: r.figures for r in reports}
    runs = [{"scenario": r.name, "problems": r.problems} for r in reports]
    recorder.write(figures, runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["all", "overload", "disconnects", "engine-failure", "redis", "fuzz", "flood",
                                     "slow-connections"])
    ap.add_argument("--flood-s", type=float, default=30.0, help="each phase of the flood scenario")
    ap.add_argument("--slow-total", type=int, default=20_400, help="slow-header connections opened")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--seconds", type=float, default=60.0, help="overload duration")
    ap.add_argument("--mock-n", type=int, default=10_000)
    ap.add_argument("--demo-n", type=int, default=1_000)
    ap.add_argument("--step-faults", type=int, default=20)
    ap.add_argument("--tp-kills", type=int, default=3)
    ap.add_argument("--outage-s", type=float, default=30.0)
    ap.add_argument("--fuzz-examples", type=int, default=150, help="cases per operation and generation mode")
    args = ap.parse_args()
    recorder = None
    if args.json is not None:
        from tokenyard.bench.results_io import RunRecorder
        recorder = RunRecorder(args.json.stem, out_dir=args.json.parent)

    def want(name: str) -> bool:
        return args.what in ("all", name)
    reports = []
    t0 = time.perf_counter()

    def run(fn, *a, **kw):
        t = time.perf_counter()
        report = fn(*a, **kw)
        report.figures["wall_s"] = round(time.perf_counter() - t, 1)
        print(f"== {report.name}: {json.dumps(report.figures, default=str)}", flush=True)
        for p in report.problems:
            print(f"   PROBLEM: {p}", flush=True)
        reports.append(report)

    if want("overload"):
        run(run_overload, seconds=args.seconds)
    if want("disconnects"):
        run(run_disconnects, args.mock_n, "mock", concurrency=32, seed=21)
        run(run_disconnects, args.demo_n, "demo-small", concurrency=16, seed=22)
    if want("engine-failure"):
        run(run_step_exceptions, args.step_faults)
        run(run_tp_worker_kills, args.tp_kills, tp_checkpoint(Path(tempfile.mkdtemp(prefix="tyrel-tp-"))))
    if want("redis"):
        run(run_redis_outage, args.outage_s)
    if want("fuzz"):
        run(run_fuzz, args.fuzz_examples, seed=1)
    if want("flood"):
        run(run_unauth_flood, args.flood_s, flooders=400, clients=1000, pool_size=64)
    if want("slow-connections"):
        run(run_slow_connections, args.slow_total, min(args.slow_total, 18_000), max_connections=4096, fd_limit=None,
            header_timeout_s=10.0)
    rows = [_row(r) for r in reports]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    print(f"\n{'scenario':<{w0}}  {'load / faults':<{w1}}  result")
    for name, held, detail in rows:
        print(f"{name:<{w0}}  {held:<{w1}}  {detail}")
    broken = sum(len(r.problems) for r in reports)
    if recorder is not None:
        _write_json(recorder, reports)
    print(f"\n{len(reports)} scenarios in {time.perf_counter() - t0:.0f} s; problems: {broken}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
