"""The fleet simulator (issue 52, item 4) on tiny traces whose answers can be worked out by hand."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from tokenyard.bench.fleet import policies as fleet_policies
from tokenyard.bench.fleet.fleet_bench import replica_capacity
from tokenyard.bench.fleet.policies import DesiredReplicasPolicy, FleetView, ReactiveUtilisation, StaticPolicy
from tokenyard.bench.fleet.report import figures, table
from tokenyard.bench.fleet.service_curve import ServiceCurve, StepSample, fit
from tokenyard.bench.fleet.simulator import SLO, FleetTimes, Shedding, SimConfig, simulate
from tokenyard.bench.fleet.trace import Request, TraceConfig, make_trace
from tokenyard.gateway.admission import desired_replicas as gateway_rule
from tokenyard.gateway.config.autoscaling_config import DesiredReplicasConfig

TOL = 1e-9


def flat(step_s: float = 0.01, seqs: int = 4, **kw: float) -> ServiceCurve:
    """Every step takes step_s (plus what kw adds)."""
    return ServiceCurve(base_s=step_s, per_seq_s=0.0, per_ctx_token_s=0.0, per_prefill_token_s=0.0,
                        max_num_seqs=seqs, **kw)


def run(curve: ServiceCurve, reqs: list[Request], policy=None, **cfg):
    sim_cfg = SimConfig(curve=curve, **cfg)
    res = simulate(sim_cfg, policy or StaticPolicy("one", 1), reqs)
    return {o.req.id: o for o in res.outcomes}, res, sim_cfg


def test_one_request_known_step_time() -> None:
    out, _, _ = run(flat(), [Request(0, 0.0, 10, 5)])
    o = out[0]
    # One prefill step (first token at its end), then 4 decode steps of 10 ms.
    assert o.status == "served"
    assert o.ttft_s == pytest.approx(0.01, abs=TOL)
    assert o.e2e_s == pytest.approx(0.05, abs=TOL)
    assert o.itl_s == pytest.approx(0.01, abs=TOL)


def test_context_growth_in_a_decode_run() -> None:
    curve = ServiceCurve(base_s=0.0, per_seq_s=0.0, per_ctx_token_s=0.001, per_prefill_token_s=0.0,
                         prefill_base_s=0.01, max_num_seqs=4)
    out, _, _ = run(curve, [Request(0, 0.0, 10, 3)])
    # prefill 10 ms (first token, context 11); decode steps over context 11 then 12: 11 + 12 ms.
    assert out[0].e2e_s == pytest.approx(0.01 + 0.011 + 0.012, abs=TOL)


def test_slot_limit_queues_the_second_request() -> None:
    out, _, _ = run(flat(seqs=1), [Request(0, 0.0, 10, 5), Request(1, 0.0, 10, 5)],
                    shedding=Shedding(enabled=False))
    assert out[1].ttft_s == pytest.approx(0.05 + 0.01, abs=TOL)     # waits for the first to end


def test_batched_prefill_and_a_join_mid_decode_run() -> None:
    out, _, _ = run(flat(seqs=4), [Request(0, 0.0, 10, 5), Request(1, 0.0, 10, 5)])
    assert out[0].ttft_s == pytest.approx(0.01, abs=TOL) and out[1].ttft_s == pytest.approx(0.01, abs=TOL)
    # A decodes 100 tokens in 100 steps; B arrives inside the run: it waits for the step in progress
    # (ends at 0.11), is prefilled in the next (A decodes in it too), and A loses no step.
    out, _, _ = run(flat(seqs=4), [Request(0, 0.0, 10, 100), Request(1, 0.105, 10, 5)])
    assert out[1].ttft_s == pytest.approx(0.12 - 0.105, abs=TOL)
    assert out[0].e2e_s == pytest.approx(1.00, abs=TOL)


def test_shedding_counts() -> None:
    curve = flat(step_s=0.1, seqs=1)
    reqs = [Request(0, 0.0, 10, 10), Request(1, 0.2, 10, 10), Request(2, 0.4, 10, 10),
            Request(3, 1.05, 10, 10), Request(4, 1.1, 10, 10)]
    out, res, cfg = run(curve, reqs, shedding=Shedding(enabled=True, deadline_s=0.5, max_queue=1))
    # A holds the replica until 1.0. B queues (no hold time measured yet: nothing shed on prediction)
    # and expires at 0.7; C finds the queue full. D starts at once on the freed replica; E would
    # wait (0 ahead + 1) / (1 slot / 1.0 s held) = 1 s > 0.5 s: shed on the prediction.
    assert [out[i].status for i in range(5)] == ["served", "expired", "shed_queue_full", "served",
                                                 "shed_predicted_wait"]
    assert figures(res, cfg, True).shed == 3
    out, res, cfg = run(curve, reqs, shedding=Shedding(enabled=False))
    assert all(o.status == "served" for o in out.values())
    assert out[1].ttft_s == pytest.approx(1.0 + 0.1 - 0.2, abs=TOL)  # B starts when A ends
    assert figures(res, cfg, False).shed == 0


def test_replica_hours_integral() -> None:
    _, res, cfg = run(flat(), [Request(0, 10.0, 10, 5)], policy=StaticPolicy("three", 3), end_s=7200.0)
    assert res.replica_seconds == pytest.approx({"ready": 3 * 7200.0})
    f = figures(res, cfg, True)
    assert f.active_replica_h == pytest.approx(6.0) and f.cost_replica_h == pytest.approx(6.0)


@dataclass
class StepUp:
    """1 replica, then 2 from the first tick after `at`."""

    at: float
    warm_pool: int = 0
    name: str = "step_up"

    def initial(self) -> int:
        return 1

    def target(self, view: FleetView) -> int:
        return 2 if view.now_s >= self.at else 1


def test_scale_up_takes_the_cold_start_or_the_wake_time() -> None:
    reqs = [Request(0, 100.0, 10, 5)]
    _, res, _ = run(flat(), reqs, policy=StepUp(15.0), times=FleetTimes(cold_start_s=30.0), end_s=100.0)
    ready = {row["t"]: row["ready"] for row in res.timeline}
    assert ready[15.0] == 1 and ready[30.0] == 1 and ready[45.0] == 2     # asked at 15, ready at 45
    assert res.replica_seconds["starting"] == pytest.approx(30.0)
    # From a warm pool of one: woken at 15, ready at 20; a new pool replica cold starts at 15.
    _, res, cfg = run(flat(), reqs, policy=StepUp(15.0, warm_pool=1), end_s=100.0,
                      times=FleetTimes(cold_start_s=30.0, wake_s=5.0), sleep_cost_share=0.5)
    ready = {row["t"]: row["ready"] for row in res.timeline}
    assert ready[15.0] == 1 and ready[30.0] == 2
    secs = res.replica_seconds
    assert secs["waking"] == pytest.approx(5.0)
    assert secs["asleep"] == pytest.approx(15.0 + (100.0 - 45.0))   # the first until woken, the refill after
    f = figures(res, cfg, True)
    assert f.cost_replica_h == pytest.approx(f.active_replica_h + 0.5 * f.asleep_replica_h)


def test_wake_defaults_to_the_cold_start() -> None:
    assert FleetTimes(cold_start_s=42.0).wake == 42.0
    assert FleetTimes(cold_start_s=42.0, wake_s=1.5).wake == 1.5


def view(**kw: float) -> FleetView:
    base = dict(now_s=0.0, active=2, ready=2, slots=32, running=0, queue_depth=0, kv_usage=0.0,
                predicted_wait_s=0.0, arrival_rate=0.0, service_rate=None, utilisation=0.0)
    base.update(kw)
    return FleetView(**base)  # type: ignore[arg-type]


def test_static_and_reactive_policies_behave_as_named() -> None:
    assert StaticPolicy("s", 5).target(view(utilisation=1.0, queue_depth=100)) == 5
    p = ReactiveUtilisation(target_util=0.5, tolerance=0.1, stabilisation_s=300.0)
    assert p.target(view(now_s=0.0, utilisation=1.0)) == 4            # ceil(2 * 1.0 / 0.5)
    assert p.target(view(now_s=15.0, active=4, utilisation=0.52)) == 4   # within the tolerance
    assert p.target(view(now_s=30.0, active=4, utilisation=0.1)) == 4    # down waits out the window
    assert p.target(view(now_s=400.0, active=4, utilisation=0.1)) == 1


def test_desired_replicas_policy_is_the_gateways_rule() -> None:
    assert fleet_policies.DesiredReplicas is gateway_rule.DesiredReplicas
    assert fleet_policies.ScalingSignals is gateway_rule.ScalingSignals
    cfg = DesiredReplicasConfig(slo_ttft_s=2.0, lead_time_s=60.0)
    p = DesiredReplicasPolicy(cfg)
    assert isinstance(p.tracker, gateway_rule.DesiredReplicas)
    v = view(running=32, queue_depth=40, kv_usage=0.5, predicted_wait_s=3.0, arrival_rate=10.0, service_rate=8.0)
    expect = gateway_rule.needed_replicas(cfg, gateway_rule.ScalingSignals(
        replicas=2, slots=32, running=32, queue_depth=40, kv_usage=0.5, predicted_wait_s=3.0,
        arrival_rate=10.0, service_rate=8.0))
    assert p.target(v) == expect
    assert expect > 2


def test_trace_is_seeded_and_follows_its_rate() -> None:
    cfg = TraceConfig(period_s=3600, night_rps=1, peak_rps=5, spikes=1, spike_s=300, seed=3)
    a, b = make_trace(cfg), make_trace(cfg)
    assert a.requests == b.requests and a.spike_starts == b.spike_starts
    assert make_trace(TraceConfig(period_s=3600, seed=4)).requests != a.requests
    expected = sum(a.rate_at(t + 0.5) for t in range(3600))          # the integral of the rate
    assert abs(len(a.requests) - expected) < 4 * math.sqrt(expected)
    assert a.rate_at(1800.0) == pytest.approx(5.0 * (3 if a.spike_starts[0] <= 1800 < a.spike_starts[0] + 300 else 1))
    with pytest.raises(ValueError, match="output_tokens"):
        TraceConfig(output_tokens=(0, 4))


def test_simulation_is_deterministic_and_capacity_bisects() -> None:
    trace = make_trace(TraceConfig(period_s=600, night_rps=2, peak_rps=6, spikes=1, spike_s=60, seed=1))
    curve = ServiceCurve(base_s=0.003, per_seq_s=0.003, per_ctx_token_s=6e-6, per_prefill_token_s=0.001,
                         prefill_base_s=0.07, max_num_seqs=16)
    cfg = SimConfig(curve=curve, slo=SLO(2.0, 0.25), end_s=600.0)
    pol = lambda: DesiredReplicasPolicy(DesiredReplicasConfig(lead_time_s=11.5), warm_pool=1)  # noqa: E731
    r1, r2 = simulate(cfg, pol(), trace.requests), simulate(cfg, pol(), trace.requests)
    assert [(o.status, o.ttft_s) for o in r1.outcomes] == [(o.status, o.ttft_s) for o in r2.outcomes]
    assert r1.replica_seconds == r2.replica_seconds
    cap = replica_capacity((cfg, TraceConfig(prompt_tokens=(32, 256), output_tokens=(16, 64))))
    assert 0.5 < cap < 20
    assert "desired_replicas" in table([figures(r1, cfg, True)])


def test_fit_recovers_a_known_curve() -> None:
    true = ServiceCurve(base_s=0.002, per_seq_s=0.001, per_ctx_token_s=1e-5, per_prefill_token_s=5e-4,
                        prefill_base_s=0.05)
    shapes = [(b, b * c, 0) for b in (1, 4, 16) for c in (50, 300)] + [(0, 0, n) for n in (32, 256)] + [(4, 400, 128)]
    samples = [StepSample(b, c, p, true.step_s(b, c, p)) for b, c, p in shapes]
    got = fit(samples, 16, 512, "synthetic")
    for name in ("base_s", "per_seq_s", "per_ctx_token_s", "per_prefill_token_s", "prefill_base_s"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6)
    assert got.fit_error["max_rel"] < 1e-6
    with pytest.raises(ValueError, match="per_seq_s"):
        ServiceCurve(base_s=0.1, per_seq_s=-1.0, per_ctx_token_s=0.0, per_prefill_token_s=0.0)


def test_prefill_table_replaces_the_straight_line() -> None:
    from tokenyard.bench.fleet.service_curve import with_prefill_table
    line = ServiceCurve(base_s=0.004, per_seq_s=0.002, per_ctx_token_s=0.0, per_prefill_token_s=0.002,
                        prefill_base_s=0.05)
    # Pure prefill steps as measured: 64 tokens as slow as 128 (a dip at 128 is noise, lifted to 0.30).
    samples = [StepSample(0, 0, 38, 0.14), StepSample(0, 0, 78, 0.31), StepSample(0, 0, 142, 0.30),
               StepSample(0, 0, 462, 0.50), StepSample(0, 0, 462, 0.54), StepSample(4, 400, 0, 0.02)]
    curve = with_prefill_table(line, samples)
    assert curve.prefill_table == [[38.0, 0.14], [78.0, 0.31], [142.0, 0.31], [462.0, 0.52]]
    # A pure prefill step takes the table's time (base_s included); below the first point, the first's.
    assert curve.step_s(0, 0, 38) == pytest.approx(0.14)
    assert curve.step_s(0, 0, 10) == pytest.approx(0.14)
    assert curve.step_s(0, 0, 302) == pytest.approx(0.31 + 0.21 / 2)
    assert curve.step_s(0, 0, 782) == pytest.approx(0.52 + 0.21)            # the last two points' slope
    # Decode rows add to it as before; a step without prompt tokens ignores the table.
    assert curve.step_s(2, 100, 142) == pytest.approx(0.31 + 2 * 0.002)
    assert curve.step_s(2, 100, 0) == line.step_s(2, 100, 0)
    # Round trip through the results file's dict; bad points are refused by name.
    assert ServiceCurve.from_dict(curve.to_dict()).prefill_table == curve.prefill_table
    for bad in ([[0, 0.1]], [[10, -1.0]], [[10, 0.1], [10, 0.2]], [[10]]):
        with pytest.raises(ValueError, match="prefill_table"):
            ServiceCurve.from_dict({**line.to_dict(), "prefill_table": bad})
    # No table: the straight line, unchanged.
    assert line.step_s(0, 0, 100) == pytest.approx(0.004 + 0.05 + 0.2)


def test_validation_labels_decode_gaps_with_the_batch_that_ran() -> None:
    from tokenyard.bench.fleet.validation import decode_samples
    from tokenyard.bench.serving_metrics import RequestRecord

    def rec(gaps: list[float], prompt: int = 10) -> RequestRecord:
        return RequestRecord(ok=True, start=0.0, ttft=0.1, itls=gaps, e2e=0.1 + sum(gaps), prompt_tokens=prompt)
    # Two sequences on one replica: 8 gaps of 20 ms together, then the long one alone at 10 ms.
    samples = decode_samples([rec([0.02] * 8), rec([0.02] * 8 + [0.01] * 8)], n_rep=1)
    by_rows = {s.decode_rows: s.seconds for s in samples}
    assert by_rows[2] == pytest.approx(0.02) and by_rows[1] == pytest.approx(0.01)


def test_validation_reads_decode_steps_from_the_replicas_counters() -> None:
    from tokenyard.bench.fleet.validation import decode_samples_from_stats

    def snap(steps: int, busy: float, prefill: int, out: int) -> dict:
        return {"num_steps": steps, "busy_seconds": busy, "prefill_tokens": prefill, "output_tokens": out}
    # One replica: 5 steps of 2 sequences at 20 ms; a prefill (left out); 4 steps of 1 sequence at 10 ms;
    # 2 steps (fewer than min_steps: left out).
    one = [snap(1, 0.05, 100, 2), snap(6, 0.15, 100, 12), snap(8, 0.40, 200, 14), snap(12, 0.44, 200, 18),
           snap(14, 0.46, 200, 20)]
    samples = decode_samples_from_stats([(float(i), [s]) for i, s in enumerate(one)], prompt_tokens=100,
                                        min_steps=3, min_intervals=1)
    by_rows = {x.decode_rows: x for x in samples}
    assert set(by_rows) == {1, 2}
    assert by_rows[2].seconds == pytest.approx(0.02) and by_rows[1].seconds == pytest.approx(0.01)
    assert by_rows[2].prefill_tokens == 0
    assert by_rows[2].decode_ctx == round(2 * (100 + 2.5))      # 2 sequences, 2.5 steps into the batch
    assert by_rows[1].decode_ctx == round(1 * (100 + 7 + 2))
    # Fewer than min_intervals intervals of a size: no sample for it.
    assert decode_samples_from_stats([(float(i), [s]) for i, s in enumerate(one)], 100, min_steps=3,
                                     min_intervals=2) == []
    # By default one step is enough (the counters move together): the 2-step interval joins the 1-row size.
    ones = [x for x in decode_samples_from_stats([(float(i), [s]) for i, s in enumerate(one)], 100, min_intervals=2)]
    assert [(x.decode_rows, x.seconds) for x in ones] == [(1, pytest.approx(0.01))]


def test_validation_simulates_each_repeat_as_it_was_sent() -> None:
    from tokenyard.bench.fleet.validation import simulated_ttfts
    from tokenyard.bench.serving_metrics import RequestRecord
    # A flat curve: a prompt token costs 1 ms, a step with prompt tokens 10 ms more, a decode step 5 ms.
    curve = ServiceCurve(base_s=0.005, per_seq_s=0.0, per_ctx_token_s=0.0, per_prefill_token_s=0.001,
                         prefill_base_s=0.010, max_num_seqs=16, max_num_batched_tokens=512)
    recs = [RequestRecord(ok=True, start=0.0, ttft=0.2, prompt_tokens=100, cached_tokens=0, output_tokens=4),
            RequestRecord(ok=True, start=5.0, ttft=0.1, prompt_tokens=100, cached_tokens=60, output_tokens=4),
            RequestRecord(ok=False, start=6.0, error="reset")]
    ttfts, figures = simulated_ttfts(curve, 0.003, recs, replicas=1, deadline_s=30.0)
    # Alone on the replica: 100 computed prompt tokens, then 40 (60 were cached); the failed one is left out.
    assert sorted(ttfts) == [pytest.approx(0.003 + 0.005 + 0.010 + 0.040), pytest.approx(0.003 + 0.005 + 0.010 + 0.100)]
    assert figures["shed"] == 0
    assert figures["p99_ttft_s"] == pytest.approx(min(ttfts) + 0.99 * (max(ttfts) - min(ttfts)))   # interpolated


def test_cli_bench_fleet_runs_and_refuses_a_missing_curve(tmp_path, capsys) -> None:
    from tokenyard.bench import serve_cli
    assert serve_cli.main(["fleet", "--period-s", "600", "--spike-s", "30", "--peak-rps", "3", "--no-results"]) == 0
    out = capsys.readouterr().out
    for policy in ("static_peak", "static_average", "reactive_util", "desired_replicas", "desired_replicas+pool"):
        assert f"| {policy} | on |" in out and f"| {policy} | off |" in out
    assert serve_cli.main(["fleet", "--curve", str(tmp_path / "none.json"), "--no-results"]) == 2
    assert "service curve" in capsys.readouterr().err
    assert serve_cli.main(["fleet", "--tick-s", "0", "--no-results"]) == 2
    assert "tick_s" in capsys.readouterr().err


@dataclass
class DownTo:
    """4 replicas, then 1 from `at`, with a warm pool of 1."""

    at: float
    warm_pool: int = 1
    name: str = "down_to"

    def initial(self) -> int:
        return 4

    def target(self, view: FleetView) -> int:
        return 1 if view.now_s >= self.at else 4


def test_scale_down_keeps_the_warm_pool_at_its_size() -> None:
    _, res, _ = run(flat(), [Request(0, 50.0, 10, 5)], policy=DownTo(15.0), end_s=60.0)
    rows = {row["t"]: row for row in res.timeline}
    assert rows[15.0]["ready"] == 4 and rows[30.0]["ready"] == 1 and rows[30.0]["asleep"] == 1
    # 4 ready for 15 s, then 1 for 45 s; one sleeper for the whole minute (the initial, then a drained one).
    assert res.replica_seconds["ready"] == pytest.approx(4 * 15.0 + 45.0)
    assert res.replica_seconds["asleep"] == pytest.approx(60.0)


@dataclass
class Blip:
    """1 replica, 2 during [15, 30), then 1 again; a warm pool of 1."""

    warm_pool: int = 1
    name: str = "blip"

    def initial(self) -> int:
        return 1

    def target(self, view: FleetView) -> int:
        return 2 if 15.0 <= view.now_s < 30.0 else 1


def test_a_refill_that_lands_on_a_full_pool_goes() -> None:
    # At 15 the sleeper wakes (ready at 20) and a refill cold starts (ready at 45); at 30 a replica
    # drains into the empty pool; the refill then finds the pool full and is let go at the next tick.
    _, res, _ = run(flat(), [Request(0, 90.0, 10, 5)], policy=Blip(), end_s=100.0,
                    times=FleetTimes(cold_start_s=30.0, wake_s=5.0))
    assert res.replica_seconds["asleep"] == pytest.approx(15.0 + (100.0 - 30.0))
    assert {row["t"]: row["asleep"] for row in res.timeline}[45.0] == 1


def test_the_pool_and_no_pool_rules_are_told_the_same_lead_time() -> None:
    """The warm pool changes how fast a replica arrives, not the rule: a pool whose rule projected
    the backlog only over the wake time (0.18 s) did worse than no pool (bench/RESULTS.md)."""
    from tokenyard.bench.fleet.fleet_bench import make_policies
    by_name = {p.name: p for p in make_policies(12, 3, 1, 26, lead_time_s=11.5, slo_ttft_s=2.0, warm_pool=2)}
    plain, pool = by_name["desired_replicas"], by_name["desired_replicas+pool"]
    assert plain.config == pool.config and pool.config.lead_time_s == 11.5
    assert (plain.warm_pool, pool.warm_pool) == (0, 2)
    assert pool.tracker is not plain.tracker      # each keeps its own hysteresis state


def test_with_the_same_rule_the_pool_serves_a_spike_sooner() -> None:
    """A quiet minute then a burst: with one replica's worth of traffic before it, the rule asks for
    more at the burst (a replica serves 5/s: 4 slots, 16 steps of 50 ms); from the pool they serve
    after the wake (1 s), not the cold start (60 s)."""
    from tokenyard.bench.fleet.fleet_bench import make_policies
    from tokenyard.bench.serving_metrics import percentile
    reqs = [Request(i, 0.5 * i, 64, 16) for i in range(120)]                 # 2/s for 60 s
    reqs += [Request(1000 + i, 60.0 + 0.05 * i, 64, 16) for i in range(1200)]  # 20/s for 60 s
    p99 = {}
    for policy in make_policies(4, 1, 1, 8, lead_time_s=60.0, slo_ttft_s=2.0, warm_pool=3)[3:]:
        cfg = SimConfig(curve=flat(0.05), times=FleetTimes(cold_start_s=60.0, wake_s=1.0), tick_s=5.0, end_s=130.0,
                        shedding=Shedding(enabled=False))
        res = simulate(cfg, policy, reqs)
        p99[policy.name] = percentile([o.ttft_s for o in res.outcomes if o.ttft_s is not None], 99)
    assert p99["desired_replicas+pool"] < 0.5 * p99["desired_replicas"], p99
