"""`tokenyard bench fleet`: replay a day of traffic against scaling policies in the fleet simulator
(issue 52, item 4) and report goodput, shedding, p99 TTFT and replica-hours per policy.

    tokenyard bench fleet [--curve bench/results/fleet_service_curve.json] [--engine smollm2-135m]
        [--period-s 86400 --night-rps 1 --peak-rps 8 --spikes 3 --spike-factor 3 --spike-s 600]
        [--cold-start-s S] [--wake-s S] [--lead-time-s S] [--warm-pool 2] [--slo-ttft-s 2 --slo-itl-s 0.25]
        [--seed 0]

Inputs: the service curve (service_curve.py measures and fits it; its JSON is committed), the
cold start (default: the engine's measured `ready_wall_s` in bench/results/startup_phases.json) and
the wake time of a sleeping replica (default: the engine's level-2 `wake_s` in
bench/results/sleep_wake.json, else the cold start). Writes bench/results/<name>.json (RunRecorder)
and a PNG beside it, and prints the table.

Policies, each run with shedding on and off: static_peak (a fixed fleet for the busiest minute),
static_average (for the mean rate), reactive_util (HPA on utilisation), desired_replicas (the
gateway's rule, no warm pool) and desired_replicas+pool (the rule with `--warm-pool` sleeping
replicas). Both desired-replicas policies get the same rule, lead time included (`--lead-time-s`,
default the cold start): the pool changes how fast a replica arrives, not what the operator tells
the rule. Giving the pool's rule the wake time as its lead time (as this bench first did) switched
the rule's backlog projection off ((arrival - service) x 0.18 s is nothing), while the autoscaler
still only looks every `--tick-s` and every replica beyond the pool still cold starts: the pool then
did worse than no pool, and no pool with a 0.18 s lead time did worse still (bench/RESULTS.md,
"Issue 52, what was left"). Fixed fleets are sized from one replica's capacity: the highest steady Poisson rate at
which one simulated replica keeps its p99 TTFT within the SLO without shedding.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tokenyard.bench.fleet.service_curve import CURVE_PATH, ServiceCurve

ROOT = Path(__file__).resolve().parents[3]
STARTUP_PATH = ROOT / "bench" / "results" / "startup_phases.json"
SLEEP_WAKE_PATH = ROOT / "bench" / "results" / "sleep_wake.json"


def measured_cold_start(engine: str, path: Path = STARTUP_PATH) -> float | None:
    """The engine's median process-start-to-ready seconds from the startup benchmark, if recorded."""
    try:
        doc = json.loads(path.read_text())
        return float(doc["figures"][engine]["ready_wall_s"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def measured_wake(engine: str, path: Path = SLEEP_WAKE_PATH) -> float | None:
    """The engine's level-2 wake seconds from the sleep/wake benchmark, if recorded (level 2: the
    level that also gives the weights' memory back, the one a pool that costs less than a replica keeps)."""
    try:
        doc = json.loads(path.read_text())
        return float(doc["figures"][engine]["level2"]["wake_s"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def replica_capacity(cfg: Any, seed: int = 0) -> float:
    """Requests/s one replica sustains with its p99 TTFT within the SLO and nothing shed: a
    bisection over steady Poisson traces of 10 minutes (the trace's request shapes)."""
    from tokenyard.bench.fleet.policies import StaticPolicy
    from tokenyard.bench.fleet.simulator import simulate
    from tokenyard.bench.fleet.trace import make_trace
    from tokenyard.bench.serving_metrics import percentile
    sim_cfg, trace_cfg = cfg

    def ok(rate: float) -> bool:
        steady = replace(trace_cfg, period_s=600.0, night_rps=rate, peak_rps=rate, spikes=0, seed=seed)
        res = simulate(replace(sim_cfg, end_s=600.0), StaticPolicy("one", 1), make_trace(steady).requests)
        if any(o.status != "served" for o in res.outcomes):
            return False
        return percentile([o.ttft_s for o in res.outcomes if o.ttft_s is not None], 99) <= sim_cfg.slo.ttft_s

    lo, hi = 0.0, 1.0
    while ok(hi) and hi < 1e4:
        lo, hi = hi, hi * 2
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def make_policies(peak_n: int, avg_n: int, start_n: int, max_n: int, lead_time_s: float, slo_ttft_s: float,
                  warm_pool: int) -> list[Any]:
    """The policies the table compares, fresh (they keep state). The two desired-replicas policies
    share one rule config: only the warm pool differs."""
    from tokenyard.bench.fleet.policies import DesiredReplicasPolicy, ReactiveUtilisation, StaticPolicy
    from tokenyard.gateway.config.autoscaling_config import DesiredReplicasConfig

    def rule() -> DesiredReplicasConfig:
        return DesiredReplicasConfig(slo_ttft_s=slo_ttft_s, lead_time_s=lead_time_s, max_replicas=max_n)

    return [StaticPolicy("static_peak", peak_n), StaticPolicy("static_average", avg_n),
            ReactiveUtilisation(start=start_n, max_replicas=max_n),
            DesiredReplicasPolicy(rule(), start=start_n),
            DesiredReplicasPolicy(rule(), name="desired_replicas+pool", warm_pool=warm_pool, start=start_n)]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--curve", type=Path, default=CURVE_PATH, help="service curve JSON (service_curve.py)")
    ap.add_argument("--straight-prefill", action="store_true",
                    help="ignore the curve's prefill_table: prefill as its fitted straight line (for comparison)")
    ap.add_argument("--engine", default="smollm2-135m", help="whose cold start to read from startup_phases.json")
    ap.add_argument("--cold-start-s", type=float, help="process start to ready (default: measured, see --engine)")
    ap.add_argument("--wake-s", type=float,
                    help="a sleeping replica to ready (default: measured level 2, see --engine; else the cold start)")
    ap.add_argument("--lead-time-s", type=float,
                    help="the desired-replicas rule's lead_time_s, both with and without the pool (default: the cold start)")
    ap.add_argument("--warm-pool", type=int, default=2, help="sleeping replicas kept by desired_replicas+pool")
    ap.add_argument("--sleep-cost-share", type=float, default=1.0, help="a sleeping replica's cost (share of one)")
    ap.add_argument("--period-s", type=float, default=86_400.0)
    ap.add_argument("--night-rps", type=float, default=1.0)
    ap.add_argument("--peak-rps", type=float, default=8.0)
    ap.add_argument("--spikes", type=int, default=3)
    ap.add_argument("--spike-factor", type=float, default=3.0)
    ap.add_argument("--spike-s", type=float, default=600.0)
    ap.add_argument("--slo-ttft-s", type=float, default=2.0)
    ap.add_argument("--slo-itl-s", type=float, default=0.25)
    ap.add_argument("--tick-s", type=float, default=15.0, help="autoscaler period")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="fleet_sim", help="bench/results/<name>.json and <name>.png")
    ap.add_argument("--no-results", action="store_true", help="print the table only")


def run(args: argparse.Namespace) -> int:
    from tokenyard.bench.fleet.report import figures, plot, table
    from tokenyard.bench.fleet.simulator import DEFAULT_COLD_START_S, SLO, FleetTimes, Shedding, SimConfig, simulate
    from tokenyard.bench.fleet.trace import TraceConfig, make_trace
    from tokenyard.bench.results_io import RunRecorder

    rec = RunRecorder(args.name)
    try:
        curve = ServiceCurve.load(args.curve)
        if args.straight_prefill:
            curve.prefill_table = []
        cold = args.cold_start_s if args.cold_start_s is not None else measured_cold_start(args.engine)
        wake = args.wake_s if args.wake_s is not None else measured_wake(args.engine)
        times = FleetTimes(cold_start_s=DEFAULT_COLD_START_S if cold is None else cold, wake_s=wake)
        lead = times.cold_start_s if args.lead_time_s is None else args.lead_time_s
        trace_cfg = TraceConfig(period_s=args.period_s, night_rps=args.night_rps, peak_rps=args.peak_rps,
                                spikes=args.spikes, spike_factor=args.spike_factor, spike_s=args.spike_s, seed=args.seed)
        base = SimConfig(curve=curve, times=times, slo=SLO(args.slo_ttft_s, args.slo_itl_s), tick_s=args.tick_s,
                         sleep_cost_share=args.sleep_cost_share, end_s=args.period_s)
        if args.warm_pool < 0 or args.slo_ttft_s <= 0 or args.slo_itl_s <= 0 or lead < 0:
            raise ValueError("--warm-pool and --lead-time-s must be >= 0 and the SLO's --slo-ttft-s and "
                             "--slo-itl-s > 0")
    except ValueError as e:
        print(f"tokenyard bench fleet: {e}", file=sys.stderr)
        return 2
    trace = make_trace(trace_cfg)
    capacity = replica_capacity((base, trace_cfg), args.seed)
    peak_n = max(1, math.ceil(trace.window_peak_rps(60.0) / capacity))
    avg_n = max(1, math.ceil(trace.mean_rps() / capacity))
    start_n = max(1, math.ceil(trace.rate_at(0.0) / capacity))
    max_n = 2 * peak_n + 2

    rows, results = [], []
    for shed in (True, False):
        cfg = replace(base, shedding=Shedding(enabled=shed))
        for policy in make_policies(peak_n, avg_n, start_n, max_n, lead, args.slo_ttft_s, args.warm_pool):
            res = simulate(cfg, policy, trace.requests)
            rows.append(figures(res, cfg, shed))
            results.append(res)
    text = table(rows)
    print(f"trace: {len(trace.requests)} requests over {args.period_s:g} s, mean {trace.mean_rps():.2f}/s, "
          f"busiest minute {trace.window_peak_rps():.2f}/s; one replica sustains {capacity:.2f}/s "
          f"(static_peak {peak_n}, static_average {avg_n}); cold start {times.cold_start_s:.1f} s, "
          f"wake {times.wake:.2f} s{' (= cold start, not measured)' if times.wake_s is None else ''}; "
          f"rule lead time {lead:.1f} s")
    print(text)
    if not args.no_results:
        step = max(args.period_s / 400, 1.0)
        rate = [(i * step, trace.rate_at(i * step)) for i in range(int(args.period_s / step) + 1)]
        png = plot(rows, results, rate, rec.out_dir / f"{args.name}.png")
        # The replica counts over the day, every 96th of it (the plot has them all): files stay small.
        keep = ("t", "ready", "target", "asleep", "queue")
        timelines = {f"{f.policy}{'' if f.shedding else ' (no shed)'}":
                     [{k: row[k] for k in keep} for row in res.timeline[::max(1, len(res.timeline) // 96)]]
                     for f, res in zip(rows, results)}
        rec.write({"table": [f.to_dict() for f in rows], "replica_capacity_rps": capacity,
                   "static_peak_replicas": peak_n, "static_average_replicas": avg_n,
                   "trace": {**asdict(trace_cfg), "requests": len(trace.requests), "mean_rps": trace.mean_rps(),
                             "busiest_minute_rps": trace.window_peak_rps(), "spike_starts_s": trace.spike_starts},
                   "times": {"cold_start_s": times.cold_start_s, "wake_s": times.wake,
                             "wake_measured": times.wake_s is not None, "kv_tokens": times.kv_tokens,
                             "lead_time_s": lead},
                   "slo": asdict(base.slo), "tick_s": args.tick_s, "sleep_cost_share": args.sleep_cost_share,
                   "warm_pool": args.warm_pool, "curve": curve.to_dict(), "plot": png.name},
                  [{"policy": k, "timeline": v} for k, v in timelines.items()])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
