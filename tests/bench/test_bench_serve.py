"""The serving benchmark (issue 14): metric math, and a smoke run of every scenario, in seconds.

Gateways run the mock engine on a thread (tests/gateway_helpers.py); the static-batch baseline
runs a tiny random Llama with the demo tokenizer. The full runs are commands (tokenyard/bench/serve_cli.py).
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from gateway_helpers import KEY, ROOT, add_key, mock_deployment, running_gateway

from tokenyard.bench import scenarios as sc
from tokenyard.bench.load_generator import UNFINISHED, ChatRequest, LoadConfig, arrival_offsets, held_offsets, run_load
from tokenyard.bench.serve_datasets import TokenSizer, random_lengths, shared_prefix_chat, summarisation_mix, task_suite
from tokenyard.bench.serve_launch import Endpoint, serve_app_in_thread, serving_checkpoint
from tokenyard.bench.serving_metrics import SLO, RequestRecord, percentile, summarize

DEMO_SMALL = ROOT / "models" / "demo-small"


# --- metric math ----------------------------------------------------------------------------------

def rec(ttft: float, e2e: float, out: int, itls=(), ok: bool = True, **kw) -> RequestRecord:
    return RequestRecord(ok=ok, status=200 if ok else 500, ttft=ttft, e2e=e2e, output_tokens=out, itls=list(itls), **kw)


def test_percentile_matches_numpy_linear_interpolation():
    rng = np.random.default_rng(1)
    for n in (1, 2, 5, 100, 101):
        xs = rng.exponential(size=n).tolist()
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tpot_excludes_the_first_token():
    # 1 s to the first token, then 4 more tokens over 2 s: TPOT is 0.5 s, not 3 s / 5.
    assert rec(1.0, 3.0, 5).tpot == pytest.approx(0.5)
    assert rec(1.0, 1.0, 1).tpot is None                 # one token: no TPOT at all
    s = summarize([rec(1.0, 3.0, 5), rec(0.5, 0.5, 1)], duration_s=4.0)
    assert s.tpot.count == 1 and s.tpot.mean == pytest.approx(500.0)
    assert s.ttft.mean == pytest.approx(750.0) and s.ttft.median == pytest.approx(750.0)


def test_summary_throughputs_itl_and_failures():
    records = [rec(0.1, 1.1, 11, itls=[0.1] * 10, prompt_tokens=20, cached_tokens=16),
               rec(0.3, 0.7, 5, itls=[0.1, 0.1, 0.2], prompt_tokens=30),
               RequestRecord(ok=False, status=503, error="draining")]
    s = summarize(records, duration_s=2.0, quantiles=(50, 99))
    assert (s.completed, s.failed) == (2, 1)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(8.0)
    assert s.total_token_throughput == pytest.approx((16 + 50) / 2)
    assert s.total_cached_tokens == 16
    assert s.itl.count == 13 and s.itl.percentiles["p99"] == pytest.approx(np.percentile([100] * 12 + [200], 99))
    assert s.errors == {"503: draining": 1}
    assert s.goodput is None
    with pytest.raises(ValueError):
        summarize(records, 0)


def test_goodput_counts_requests_meeting_every_slo():
    records = [rec(0.1, 1.0, 10),     # TTFT 100 ms, TPOT 100 ms: meets both
               rec(0.5, 1.4, 10),     # TTFT 500 ms: misses TTFT
               rec(0.1, 3.1, 11),     # TPOT 300 ms: misses TPOT
               rec(0.1, 0.1, 1),      # one token: no TPOT, TTFT met -> counts
               rec(0.1, 1.0, 10, ok=False)]
    s = summarize(records, 2.0, SLO(ttft_ms=200, tpot_ms=150))
    assert s.goodput == pytest.approx(2 / 2.0)
    assert summarize(records, 2.0, SLO(ttft_ms=200)).goodput == pytest.approx(3 / 2.0)
    assert summarize(records, 2.0, SLO(e2e_ms=1000)).goodput == pytest.approx(2 / 2.0)
    assert SLO(ttft_ms=200, tpot_ms=150).describe() == "TTFT <= 200 ms and TPOT <= 150 ms"


def test_arrivals_poisson_gamma_and_all_at_once():
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    for burst in (1.0, 0.25, 4.0):
        t = arrival_offsets(4000, 10.0, burst, seed=3)
        gaps = np.diff(t)
        assert t[0] == 0 and gaps.mean() == pytest.approx(0.1, rel=0.1)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burst), rel=0.15)
    assert arrival_offsets(5, 2.0, seed=7) == arrival_offsets(5, 2.0, seed=7)


# --- datasets -------------------------------------------------------------------------------------

def test_datasets_are_token_sized_and_seeded():
    sizer = TokenSizer(DEMO_SMALL)
    reqs = random_lengths(6, sizer, (20, 40), (5, 9), seed=1)
    for r in reqs:
        n_in = int(r.tag.split("-")[0][2:])
        assert abs(sizer.count(r.messages[0]["content"]) - n_in) <= 2
        assert 5 <= r.max_tokens <= 9
    assert [r.messages for r in random_lengths(6, sizer, (20, 40), (5, 9), seed=1)] == [r.messages for r in reqs]
    capped = random_lengths(4, sizer, (400, 500), (200, 256), max_model_len=512)
    assert all(sizer.count(r.messages[0]["content"]) + r.max_tokens <= 512 for r in capped)
    chat = shared_prefix_chat(4, sizer, system_tokens=64, num_prefixes=2)
    assert chat[0].messages[0] == chat[2].messages[0] != chat[1].messages[0]
    mix = summarisation_mix(10, sizer, long_tokens=(100, 120), max_model_len=512)
    assert {r.tag for r in mix} == {"long", "short"}
    tasks = task_suite(4)
    assert all(r.check is not None and r.check.check(r.check.answer) for r in tasks)


# --- servers --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return serving_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", tokenizer_from=DEMO_SMALL, hidden_size=32,
                              intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, max_position_embeddings=512)


def static_launcher(model: Path, batch_size: int = 4):
    from tokenyard.bench.static_batch_server import StaticBatchConfig, create_app

    @contextmanager
    def launch():
        app = create_app(StaticBatchConfig(model, batch_size=batch_size, batch_timeout_ms=20, api_key="static-key"))
        with serve_app_in_thread(app, "static", "static-key", "static-batch") as ep:
            yield ep
    return launch


def gateway_launcher(document: dict, model: str = "mock", batch_key: bool = False):
    @contextmanager
    def launch():
        with running_gateway(document) as srv:
            ep = Endpoint("gateway", srv.base_url, KEY, model)
            if batch_key:
                ep.batch_api_key = add_key(srv, "bench-batch", priority="batch")
            yield ep
    return launch


FAST_MOCK = dict(ttft_ms=5, token_ms=1, output_len=8)


def opts(tmp_path: Path) -> sc.RunOptions:
    return sc.RunOptions(out_dir=tmp_path, progress=False, warmup=1, quiet=True, timeout_s=60)


def test_static_batch_server_speaks_the_chat_api(tiny_llama):
    with static_launcher(tiny_llama)() as ep:
        cfg = LoadConfig(ep.base_url, ep.api_key, "static-batch", progress=False)
        reqs = [ChatRequest([{"role": "user", "content": f"Add {i} and 3."}], 6 + i) for i in range(5)]
        res = run_load(reqs, cfg)
        assert all(r.ok for r in res.records), [r.error for r in res.records]
        for r, q in zip(res.records, reqs):
            assert 1 <= r.output_tokens <= q.max_tokens and r.prompt_tokens > 5
            assert r.ttft is not None and r.e2e >= r.ttft
        # Non-streaming, and auth.
        import urllib.request
        body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                           "temperature": 0}).encode()
        req = urllib.request.Request(ep.base_url + "/v1/chat/completions", body,
                                     {"Authorization": "Bearer static-key", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            data = json.loads(resp.read())
        assert data["usage"]["completion_tokens"] <= 4 and data["choices"][0]["message"]["role"] == "assistant"
        bad = run_load(reqs[:1], LoadConfig(ep.base_url, "wrong", progress=False))
        assert bad.records[0].status == 401 and not bad.records[0].ok


def test_scenario_rate_sweep_smoke(tiny_llama, tmp_path):
    servers = {"tokenyard": gateway_launcher(mock_deployment(**FAST_MOCK)), "static": static_launcher(tiny_llama)}
    sizer = TokenSizer(DEMO_SMALL)
    result = sc.rate_sweep(servers, lambda n: random_lengths(n, sizer, (16, 48), (4, 8), 512),
                           sc.SweepConfig([20.0, math.inf], ttft_slo_ms=30_000, dataset_size=6), opts(tmp_path))
    assert set(result["points"]) == {"tokenyard", "static"}
    assert all(p["summary"]["completed"] == 6 for pts in result["points"].values() for p in pts)
    assert result["highest_sustained_rate"]["tokenyard"] == math.inf and result["throughput_ratio"] > 0
    assert set(result["throughput_ratio_by_rate"]) == {"20", "inf"}
    assert (tmp_path / "serve_rate_sweep.png").stat().st_size > 0
    assert json.loads((tmp_path / "serve_rate_sweep.json").read_text())["scenario"] == "rate_sweep"
    assert "| server |" in result["table"]


def test_held_load_keeps_arriving_for_the_duration_then_cancels_stragglers():
    t = held_offsets(20.0, 3.0, seed=2)
    assert t[0] == 0 and t[-1] < 3.0 and 40 <= len(t) <= 80          # ~60 Poisson arrivals in 3 s
    with pytest.raises(ValueError):
        held_offsets(math.inf, 3.0)
    # 8 req/s for 0.5 s of a 2-token dataset (cycled), against a mock that cannot finish them in
    # time: the drain deadline cuts the rest, which come back as unfinished, not as a hang.
    doc = mock_deployment(ttft_ms=5, token_ms=200, output_len=20)
    with running_gateway(doc) as srv:
        reqs = task_suite(2)
        cfg = LoadConfig(srv.base_url, KEY, "mock", 8.0, progress=False, duration_s=0.5, drain_s=0.3, timeout_s=30)
        res = run_load(reqs, cfg)
    assert len(res.records) == len(held_offsets(8.0, 0.5)) and res.duration_s < 5
    assert all(r.error == UNFINISHED and not r.ok for r in res.records)


def test_scenario_rate_sweep_held_smoke(tmp_path):
    """Held loads: fresh prompts per arrival, ascending ladder, stop at the first miss."""
    servers = {"tokenyard": gateway_launcher(mock_deployment(**FAST_MOCK)),
               "slow": gateway_launcher(mock_deployment(ttft_ms=400, token_ms=1, output_len=4, max_num_seqs=1))}
    sizer = TokenSizer(DEMO_SMALL)
    cfg = sc.SweepConfig([10.0, 5.0], ttft_slo_ms=300, duration_s=0.6, drain_s=5, dataset_size=2,
                         rates_by_server={"slow": [4.0, 8.0]})
    result = sc.rate_sweep(servers, lambda n: random_lengths(n, sizer, (16, 32), (4, 6), 512), cfg, opts(tmp_path))
    assert result["num_requests"] >= len(held_offsets(10.0, 0.6)) > 2
    ours = result["points"]["tokenyard"]
    assert [p["rate"] for p in ours] == [5.0, 10.0] and all(p["arrivals"] > 0 and p["held_s"] == 0.6 for p in ours)
    assert result["highest_sustained_rate"]["tokenyard"] == 10.0
    slow = result["points"]["slow"]
    assert [p["rate"] for p in slow] == [4.0] and not slow[0]["sustained"]      # stopped at its first miss
    assert result["highest_sustained_rate"]["slow"] is None


def test_scenario_priorities_smoke(tmp_path):
    doc = mock_deployment(ttft_ms=5, token_ms=2, output_len=6, max_num_seqs=2)
    result = sc.priorities(gateway_launcher(doc, batch_key=True), task_suite(4), task_suite(6, seed=1),
                           sc.PriorityConfig(interactive_rate=50), opts(tmp_path))
    assert result["status"] == "done"
    for run in result["runs"].values():
        assert run["interactive"]["completed"] == 4 and run["batch"]["completed"] == 6
    assert (tmp_path / "serve_priorities.png").exists()


def test_scenario_priorities_pending_without_batch_keys(tmp_path):
    result = sc.priorities(gateway_launcher(mock_deployment(**FAST_MOCK)), task_suite(2), task_suite(2),
                           sc.PriorityConfig(), opts(tmp_path))
    assert result["status"] == "pending" and "pending" in result["table"]


def test_scenario_router_smoke(tmp_path):
    engine = lambda price: {"type": "mock", "model": str(DEMO_SMALL), **FAST_MOCK,  # noqa: E731
                            "prices": {"input": price, "cached_input": price // 10, "output": 4 * price}}
    doc = {"server": {"access_log": False}, "routing": {"small": "small", "large": "large", "long_prompt_tokens": 30},
           "engines": {"small": engine(100_000), "large": engine(1_000_000)}}
    path = tmp_path / "router.yaml"
    import yaml
    path.write_text(yaml.safe_dump(doc))

    @contextmanager
    def launch():
        with gateway_launcher(doc)() as ep:
            ep.deployment = path
            yield ep
    result = sc.router(launch, task_suite(8), "large", opts(tmp_path), concurrency=4)
    runs = result["runs"]
    routed, pinned = runs["router (auto)"], runs["all-large (large)"]
    assert pinned["served_by"] == {"large": 8} and pinned["cost_micro"] > 0
    assert routed["served_by"].get("small", 0) > 0 and routed["cost_micro"] < pinned["cost_micro"]
    assert 0 <= routed["accuracy"] <= 1
    assert (tmp_path / "serve_router.png").exists()


def test_scenario_prefix_smoke(tmp_path):
    servers = {"on": gateway_launcher(mock_deployment(**FAST_MOCK)), "off": gateway_launcher(mock_deployment(**FAST_MOCK))}
    reqs = shared_prefix_chat(6, TokenSizer(DEMO_SMALL), system_tokens=64)
    result = sc.prefix_chat(servers, reqs, opts(tmp_path), concurrency=3)
    assert all(r["completed"] == 6 and r["total_prompt_tokens"] > 6 * 64 for r in result["runs"].values())
    assert (tmp_path / "serve_prefix.png").exists()


def test_scenario_speculation_smoke(tmp_path):
    servers = {"ngram": gateway_launcher(mock_deployment(**FAST_MOCK)), "none": gateway_launcher(mock_deployment(**FAST_MOCK))}
    result = sc.speculation(servers, task_suite(4), opts(tmp_path), concurrency=2)
    assert result["identical_replies"] == 1.0         # the mock replies the same text either way
    assert all(r["completed"] == 4 and r["tpot"]["count"] == 4 for r in result["runs"].values())
    assert (tmp_path / "serve_speculation.png").exists()


def test_cli_parses_and_runs_one_load(tmp_path):
    from tokenyard.bench import serve_cli
    with running_gateway(mock_deployment(**FAST_MOCK)) as srv:
        code = serve_cli.main(["serve", "--url", srv.base_url, "--api-key", KEY, "--model", "mock",
                               "--dataset", "tasks", "--num-prompts", "3", "--request-rate", "50",
                               "--ttft-slo-ms", "1000", "--no-progress", "--result", str(tmp_path / "r.json")])
    assert code == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["completed"] == 3 and len(data["records"]) == 3


def test_derived_deployments_load_from_another_folder(tmp_path):
    """Scenario deployments are copies of tokenyard/deploy/default.yaml in bench/out: every path in them
    (models, router artifact, policy file) must still resolve, and a copy cut down to one engine
    drops the router and policy, which name both engines."""
    from tokenyard.bench.serve_launch import derive_deployment
    from tokenyard.gateway.config.deployment import load_deployment

    src = Path(__file__).resolve().parents[2] / "tokenyard" / "deploy" / "default.yaml"
    full = load_deployment(derive_deployment(src, tmp_path / "a" / "full.yaml"))
    assert full.router.artifact is not None and full.router.artifact.is_file()
    assert set(full.engines) == {"demo-small", "demo-large", "smollm2-135m"}
    assert full.engines["smollm2-135m"].model.is_file()    # a package: reference is kept, not made a path
    one = load_deployment(derive_deployment(src, tmp_path / "b" / "one.yaml", only_engines=["demo-large"]))
    assert list(one.engines) == ["demo-large"] and one.router.artifact is None
