"""Engine load and SLO attainment: the engine's busy seconds, prefill and output token counts and
batch-size histogram (real engine on the test checkpoint, and the mock), the SLO counter against the
deployment's targets, and the dashboard's live figures."""
from __future__ import annotations

from gateway_helpers import mock_deployment, running_gateway

from tokenyard.engines.core.outputs import BATCH_BUCKETS
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.runtime.engine import Engine
from tokenyard.gateway.web.dashboard_view import live_stats


def test_engine_counts_its_load(checkpoint_dir):
    eng = Engine(checkpoint_dir("llama"), kv_cache_memory=8 << 20, max_num_seqs=4)
    prompts = [[1, 5, 9, 2, 7], [3, 4, 6], [8, 8, 8, 8]]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    emitted = 0
    while eng.has_unfinished():
        emitted += sum(len(o.new_token_ids) for o in eng.step())
    s = eng.stats()
    assert emitted == 18 and s.output_tokens == 18
    assert s.prefill_tokens == sum(len(p) for p in prompts)
    assert 0 < s.busy_seconds and len(s.batch_size_counts) == len(BATCH_BUCKETS) + 1
    assert sum(s.batch_size_counts) == s.num_steps
    assert s.batch_size_counts[BATCH_BUCKETS.index(4)] > 0      # the 3-sequence steps land in the "<= 4" bucket


def _metric(body: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in body.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{want}}} not in /metrics")


def test_slo_outcomes_follow_the_deployment_targets_and_the_dashboard_shows_load():
    for target, outcome in ((60.0, "met"), (1e-6, "ttft_missed")):
        doc = {**mock_deployment(token_ms=2), "metrics": {"slo_ttft_s": target, "slo_itl_s": 60.0}}
        with running_gateway(doc) as srv:
            for i in range(3):
                status, _, _ = srv.chat({"model": "mock", "messages": [{"role": "user", "content": f"q{i}"}],
                                         "max_tokens": 5})
                assert status == 200
            body = srv.request("GET", "/metrics")[2].decode()
            assert _metric(body, "tokenyard_slo_requests_total", engine="mock", outcome=outcome) == 3
            assert _metric(body, "tokenyard_engine_output_tokens_total", engine="mock") == 15
            assert _metric(body, "tokenyard_engine_busy_seconds_total", engine="mock") > 0
            first = live_stats(srv.gateway)[0]
            srv.chat({"model": "mock", "messages": [{"role": "user", "content": "again"}], "max_tokens": 5})
            second = live_stats(srv.gateway)[0]
            assert first["busy_pct"] == "-" and float(second["tokens_per_s"]) > 0
            assert second["slo_met_pct"] == ("100.0" if outcome == "met" else "0.0")
