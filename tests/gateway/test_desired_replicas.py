"""The desired-replicas rule (tokenyard/gateway/admission/desired_replicas.py), on a fake clock."""
from __future__ import annotations

import math

import pytest

from tokenyard.gateway.admission.desired_replicas import (
    DesiredReplicas,
    DesiredReplicasConfig,
    ScalingSignals,
    needed_replicas,
)

CFG = DesiredReplicasConfig(target_kv_usage=0.8, target_queue_per_replica=4, slo_ttft_s=2.0, wait_share=0.5,
                            lead_time_s=60.0, scale_down_hold_s=300.0, min_replicas=1, max_replicas=10)


def sig(**kw) -> ScalingSignals:
    """Two replicas of 16 slots each, idle, unless told otherwise."""
    base = dict(replicas=2, slots=32, running=0, queue_depth=0, kv_usage=0.0, predicted_wait_s=0.0)
    return ScalingSignals(**{**base, **kw})


def test_idle_engine_asks_for_the_minimum():
    assert needed_replicas(CFG, sig()) == 1
    assert needed_replicas(DesiredReplicasConfig(min_replicas=3, max_replicas=5), sig()) == 3


def test_queue_pressure_scales_up():
    # one replica holds 16 running + 4 queued = 20 requests: 32 running + 9 queued = 41 need 3
    assert needed_replicas(CFG, sig(running=32, queue_depth=8)) == 2
    assert needed_replicas(CFG, sig(running=32, queue_depth=9)) == 3
    assert needed_replicas(CFG, sig(running=32, queue_depth=200)) == 10      # bounded by max_replicas


def test_lead_time_projects_the_backlog():
    # arrivals outrun service by 0.5/s: 60 s of lead time adds 30 requests to the 40 there now
    now = sig(running=32, queue_depth=8, arrival_rate=10.5, service_rate=10.0)
    assert needed_replicas(CFG, now) == math.ceil((40 + 30) / 20)
    assert needed_replicas(CFG, sig(running=32, queue_depth=8, arrival_rate=10.5, service_rate=None)) == 2
    # service faster than arrivals never shrinks the backlog below what is there
    assert needed_replicas(CFG, sig(running=32, queue_depth=8, arrival_rate=1.0, service_rate=10.0)) == 2


def test_kv_pressure_scales_up():
    assert needed_replicas(CFG, sig(kv_usage=0.8)) == 2          # at target: stay
    assert needed_replicas(CFG, sig(kv_usage=0.81)) == 3         # 2 * 0.81 / 0.8 = 2.03
    assert needed_replicas(CFG, sig(kv_usage=0.3)) == 1          # 2 * 0.3 / 0.8 = 0.75


def test_predicted_wait_against_the_slo_scales_up():
    # the queue may use 1 s of the 2 s SLO
    assert needed_replicas(CFG, sig(predicted_wait_s=1.0)) == 1
    assert needed_replicas(CFG, sig(predicted_wait_s=2.5)) == 5   # 2 * 2.5 / 1.0
    assert needed_replicas(CFG, sig(predicted_wait_s=math.inf)) == 3   # shedding outright: one more


def test_all_replicas_down_sizes_from_one():
    assert needed_replicas(CFG, sig(replicas=0, slots=16, running=0, queue_depth=30)) == 2


def test_up_at_once_down_only_after_the_hold():
    t = DesiredReplicas(CFG)
    assert t.update(sig(kv_usage=0.3), now=0.0) == 1
    assert t.update(sig(running=32, queue_depth=40), now=10.0) == 4          # 72 / 20: up at once
    assert t.update(sig(), now=20.0) == 4                                    # lower since 20 s
    assert t.update(sig(running=32, queue_depth=9), now=200.0) == 4          # asks for 3: still lower
    assert t.update(sig(), now=319.0) == 4                                   # 299 s: not yet
    assert t.update(sig(), now=320.0) == 3       # held 300 s: down to the highest count asked in the window
    assert t.update(sig(), now=321.0) == 3
    assert t.update(sig(), now=620.0) == 3
    assert t.update(sig(), now=621.0) == 1


def test_a_higher_count_resets_the_hold():
    t = DesiredReplicas(CFG)
    assert t.update(sig(running=32, queue_depth=40), now=0.0) == 4
    assert t.update(sig(), now=1.0) == 4
    assert t.update(sig(running=32, queue_depth=40), now=250.0) == 4        # back at 4: the window restarts
    assert t.update(sig(), now=260.0) == 4
    assert t.update(sig(), now=500.0) == 4                                  # 240 s since 260: held
    assert t.update(sig(), now=560.0) == 1


def test_bounded_by_min_and_max_through_the_tracker():
    cfg = DesiredReplicasConfig(min_replicas=2, max_replicas=3, scale_down_hold_s=0.0)
    t = DesiredReplicas(cfg)
    assert t.update(sig(predicted_wait_s=100.0), now=0.0) == 3
    assert t.update(sig(), now=1.0) == 3          # first lower sample opens the window
    assert t.update(sig(), now=1.0) == 2          # hold 0: reported on the next look, never below min


@pytest.mark.parametrize("bad", [dict(target_kv_usage=0.0), dict(target_kv_usage=1.5), dict(min_replicas=5,
                                 max_replicas=2), dict(lead_time_s=-1.0), dict(slo_ttft_s=0.0), dict(max_replicas=0)])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError):
        DesiredReplicasConfig(**bad)


def test_deployment_file_sets_the_rule_and_refuses_bad_values():
    from dataclasses import replace

    from gateway_helpers import mock_deployment

    from tokenyard.gateway.config.deployment import DeploymentError, parse_deployment
    dep = parse_deployment({**mock_deployment(), "autoscaling": {"lead_time_s": 300, "max_replicas": 8,
                                                                 "scale_down_hold_s": 0}})
    assert dep.autoscaling == replace(DesiredReplicasConfig(), lead_time_s=300.0, max_replicas=8,
                                      scale_down_hold_s=0.0)
    assert parse_deployment(mock_deployment()).autoscaling == DesiredReplicasConfig()
    for bad, message in [({"lead_time": 1}, "unknown key(s) autoscaling.lead_time"),
                         ({"slo_ttft_s": 1}, "unknown key(s) autoscaling.slo_ttft_s"),
                         ({"max_replicas": 2.5}, "autoscaling.max_replicas must be an integer"),
                         ({"target_kv_usage": "high"}, "autoscaling.target_kv_usage must be a number"),
                         ({"target_kv_usage": 2}, "target_kv_usage must be in (0, 1]"),
                         ({"min_replicas": 4, "max_replicas": 2}, "min_replicas <= max_replicas")]:
        with pytest.raises(DeploymentError) as err:
            parse_deployment({**mock_deployment(), "autoscaling": bad})
        assert message in str(err.value), (bad, str(err.value))


def test_windowed_rate_counts_per_second_buckets_over_the_window():
    from tokenyard.gateway.admission.shedding import WindowedRate
    r = WindowedRate(max_window_s=60)
    for t in range(100, 130):            # one request a second for 30 s, then a burst of 30 in one second
        r.add(now=t + 0.5)
    for _ in range(30):
        r.add(now=130.2)
    assert r.per_second(1, now=130.9) == 30.0          # the 1 s view sees only the burst
    assert r.per_second(30, now=130.9) == pytest.approx(59 / 30)   # 29 + 30 over the last 30 s
    assert r.per_second(30, now=200.0) == 0.0          # old buckets never count again
    r.add(now=160.0 + 0.5)                             # the ring wraps: bucket 40 held second 100
    assert r.per_second(60, now=160.9) == pytest.approx((29 + 30 + 1) / 60)   # seconds 101-129, 130, 160


def test_growth_counts_only_arrivals_past_full_capacity():
    # 32 slots finishing 10 requests/s when full: 10.5/s arriving grows the backlog by 0.5/s x 60 s
    assert needed_replicas(CFG, sig(running=32, queue_depth=8, arrival_rate=10.5, service_rate=10.0)) == 4
    # half-empty replicas: arrivals below what they finish when full add nothing
    assert needed_replicas(CFG, sig(running=4, queue_depth=0, arrival_rate=3.0, service_rate=10.0)) == 1


def test_gateway_signals_average_arrivals_over_the_configured_window():
    """The gateway's signal: admitted requests averaged over rate_window_s, service at full slots."""
    from tokenyard.gateway.admission.engine_queues import EngineQueue
    from tokenyard.gateway.config.deployment import AdmissionConfig

    class Engine:
        dead = None

        def stats(self):
            from tokenyard.engines.core.outputs import EngineStats
            return EngineStats(num_running=0, num_waiting=0, num_free_blocks=10, num_total_blocks=10, kv_usage=0.0,
                               block_size=16, num_preemptions=0, prefix_cache_hit_rate=0.0, prefix_cache_hit_tokens=0,
                               num_steps=0, last_step_tokens=0, last_step_seconds=0.0, max_num_seqs=16,
                               max_num_batched_tokens=512)

    q = EngineQueue("e", Engine(), AdmissionConfig(), None)
    for _ in range(60):
        q.admitted.add()
    q.rate.observe(2.0)                  # a request holds a slot 2 s: 16 slots finish 8/s when full
    s = q.scaling_signals(rate_window_s=30)
    assert s.arrival_rate == pytest.approx(60 / 30)
    assert s.service_rate == pytest.approx(16 / 2.0)
