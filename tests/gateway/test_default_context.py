"""The context a user gets is the model's, and the API says what it is (issue 45.7).

tokenyard/deploy/default.yaml gave SmolLM2-135M-Instruct 128 MiB of fp32 KV: 2,912 tokens, so its 8,192-token
context was cut to 2,912 with only a warning at start-up. Each torch engine of the default
deployment must hold its model's whole context; /v1/models reports each engine's max_model_len.
"""
from __future__ import annotations

import json

import pytest
from gateway_helpers import ROOT, mock_deployment, running_gateway

from tokenyard.engines.core.config import EngineConfig
from tokenyard.engines.model import kv_cache
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.gateway.config.deployment import load_deployment


def _kv_capacity_tokens(model, options: dict) -> tuple[int, int]:
    """(KV capacity in tokens, the model's max_position_embeddings) as Engine.__init__ computes them,
    without loading the weights."""
    cfg = EngineConfig.from_options(dict(options))
    device = cfg.torch_device()
    mcfg = ModelConfig.from_dir(model)
    budget = kv_cache.kv_budget_bytes(device, cfg.kv_cache_fraction, cfg.kv_cache_memory, cfg.kv_cache_cpu_default_bytes)
    blocks = kv_cache.num_blocks_for(mcfg, cfg.block_size, cfg.torch_dtype(device), budget, cfg.kv_cache_dtype)
    return blocks * cfg.block_size, mcfg.max_position_embeddings


@pytest.mark.parametrize("name", ["demo-small", "demo-large", "smollm2-135m"])
def test_default_deployment_holds_each_models_full_context(name):
    dep = load_deployment(ROOT / "tokenyard" / "deploy" / "default.yaml")
    spec = dep.engines[name]
    capacity, context = _kv_capacity_tokens(spec.model, spec.options)
    assert capacity >= context, f"{name}: KV for {capacity} tokens, model context {context}"


def test_models_list_reports_max_model_len():
    with running_gateway(mock_deployment()) as srv:
        status, _, body = srv.request("GET", "/v1/models")
        assert status == 200
        entries = {m["id"]: m for m in json.loads(body)["data"]}
        assert entries["mock"]["max_model_len"] == srv.engine().max_model_len > 0
        status, _, body = srv.request("GET", "/v1/models/mock")
        assert status == 200 and json.loads(body)["max_model_len"] == srv.engine().max_model_len


def test_generate_holds_the_default_models_full_context(monkeypatch):
    """`tokenyard generate` without --model (SmolLM2) had 256 MiB of KV: 5,824 of 8,192 tokens."""
    from tokenyard.cli.main import main
    from tokenyard.engines.core.errors import CheckpointError
    from tokenyard.engines.serving import generate_cli

    built = []

    def engine(model, **options):
        built.append((model, options))
        raise CheckpointError("stop here: the test only needs the engine's options")

    monkeypatch.setattr(generate_cli, "Engine", engine)
    assert main(["generate", "--prompt", "Hi"]) == 2
    model, options = built[0]
    capacity, context = _kv_capacity_tokens(model, {k: v for k, v in options.items() if k != "progress"})
    assert capacity >= context, f"KV for {capacity} tokens, model context {context}"
