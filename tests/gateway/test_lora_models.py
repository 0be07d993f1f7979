"""LoRA adapters as models of the gateway: `ENGINE:ADAPTER` (issue 53.2), on the mock engine.

The mock engine answers an adapter request with "[NAME] " before its reply, so these tests see which
adapter a request reached: listed in /v1/models, routed to the engine with the adapter, the adapter in
the usage record, a 404 naming the model for an unknown adapter, and the base unchanged.
"""
from __future__ import annotations

import json
import time

from gateway_helpers import mock_deployment, running_gateway

DOC = mock_deployment(lora_modules={"sql": "adapters/sql", "chat": "adapters/chat"})
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}


def test_adapters_are_listed_as_models():
    with running_gateway(DOC) as srv:
        status, _, raw = srv.request("GET", "/v1/models")
        assert status == 200
        ids = [m["id"] for m in json.loads(raw)["data"]]
        assert ids == ["auto", "mock", "mock:chat", "mock:sql"]
        status, _, raw = srv.request("GET", "/v1/models/mock:sql")
        assert status == 200
        entry = json.loads(raw)
        assert entry["id"] == "mock:sql" and entry["parent"] == "mock"
        status, _, raw = srv.request("GET", "/v1/models/mock:nope")
        assert status == 404 and "mock:sql" in json.loads(raw)["error"]["message"]


def test_a_request_for_an_adapter_reaches_the_engine_with_it_and_is_recorded():
    with running_gateway(DOC) as srv:
        status, _, reply = srv.chat({**BODY, "model": "mock:sql"})
        assert status == 200, reply
        assert reply["choices"][0]["message"]["content"].startswith("[sql] ")
        assert reply["model"] == "mock:sql"        # the reply names the adapter that answered, as it was asked
        status, _, base = srv.chat({**BODY, "model": "mock"})
        assert status == 200 and not base["choices"][0]["message"]["content"].startswith("[")
        deadline = time.monotonic() + 5
        while len(srv.gateway.usage.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        by_model = {r.requested_model: r for r in srv.gateway.usage.records}
        assert by_model["mock:sql"].lora == "sql" and by_model["mock:sql"].engine == "mock"
        assert by_model["mock"].lora == ""
        status, _, raw = srv.request("GET", "/metrics")
        text = raw.decode()
        assert 'tokenyard_lora_requests_total{adapter="sql",engine="mock"} 1.0' in text
        assert f'tokenyard_lora_completion_tokens_total{{adapter="sql",engine="mock"}} ' \
               f'{float(by_model["mock:sql"].completion_tokens)}' in text


def test_an_unknown_adapter_is_a_404_naming_the_model():
    with running_gateway(DOC) as srv:
        status, _, err = srv.chat({**BODY, "model": "mock:nope"})
        assert status == 404
        assert err["error"]["code"] == "model_not_found" and err["error"]["param"] == "model"
        assert "mock:chat" in err["error"]["message"]


def test_adapter_names_with_a_colon_are_refused_in_the_deployment():
    import pytest

    from tokenyard.gateway.config.deployment import DeploymentError, parse_deployment
    with pytest.raises(DeploymentError, match="without ':'"):
        parse_deployment(mock_deployment(lora_modules={"a:b": "x"}))
