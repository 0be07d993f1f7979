"""LoRA adapters at run time through the gateway (issue 53.2), on the mock engine: the admin API loads an
adapter from the engine's lora_roots (a path outside is a 400), it becomes a model at once, an unload is
refused with 409 while a request uses the adapter and works after, and per-key / per-tenant allow lists
refuse other adapters with a 403 naming them. The mock reads a run-time adapter's adapter_config.json
(not its tensors: tests/engines/test_lora_runtime.py checks those on a real engine)."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from gateway_helpers import mock_deployment, running_gateway

from tokenyard.gateway.auth.api_keys import new_record

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
USER = "user-key"


def adapter_dir(root: Path, name: str, **config) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                       "target_modules": ["q_proj", "v_proj"], **config}))
    return d


def doc(root: Path, **extra) -> dict:
    d = mock_deployment(lora_modules={"sql": "adapters/sql"}, **extra)
    d["engines"]["mock"]["lora_roots"] = [str(root)]
    return d


def admin(srv, method: str, path: str, body=None):
    status, _, raw = srv.request(method, path, body)
    return status, json.loads(raw) if raw else None


def test_load_from_a_root_makes_a_model_and_unload_removes_it(tmp_path):
    adapter_dir(tmp_path, "extra")
    with running_gateway(doc(tmp_path)) as srv:
        status, info = admin(srv, "POST", "/admin/engines/mock/adapters", {"name": "extra", "path": "extra"})
        assert status == 200, info
        assert info["model"] == "mock:extra" and info["rank"] == 8 and info["path"] == str(tmp_path / "extra")
        _, _, raw = srv.request("GET", "/v1/models")
        assert "mock:extra" in [m["id"] for m in json.loads(raw)["data"]]
        status, _, reply = srv.chat({**BODY, "model": "mock:extra"})
        assert status == 200 and reply["choices"][0]["message"]["content"].startswith("[extra] ")
        status, listing = admin(srv, "GET", "/admin/engines/mock/adapters")
        assert status == 200
        assert {a["name"]: a["source"] for a in listing["adapters"]} == {"extra": "runtime", "sql": "deployment"}
        assert listing["replicas"][0]["adapters"] == ["extra", "sql"]
        status, err = admin(srv, "POST", "/admin/engines/mock/adapters", {"name": "extra", "path": "extra"})
        assert status == 409 and err["error"]["code"] == "adapter_conflict"
        status, out = admin(srv, "DELETE", "/admin/engines/mock/adapters/extra")
        assert status == 200 and out["unloaded"] is True
        status, _, err = srv.chat({**BODY, "model": "mock:extra"})
        assert status == 404 and err["error"]["code"] == "model_not_found"
        status, err = admin(srv, "DELETE", "/admin/engines/mock/adapters/extra")
        assert status == 404 and err["error"]["code"] == "adapter_not_found"


@pytest.mark.parametrize("path, code", [("/etc", "path_not_allowed"), ("../outside", "path_not_allowed"),
                                        ("missing", "invalid_adapter"), ("bad", "invalid_adapter")])
def test_paths_outside_the_roots_and_bad_adapters_are_400s(tmp_path, path, code):
    root = tmp_path / "root"
    adapter_dir(root, "bad", r=300)                       # over max_lora_rank: the message names r
    adapter_dir(tmp_path, "outside")
    with running_gateway(doc(root)) as srv:
        status, err = admin(srv, "POST", "/admin/engines/mock/adapters", {"name": "x", "path": path})
        assert status == 400, err
        assert err["error"]["code"] == code and err["error"]["param"] == "path"
        if path == "bad":
            assert "r must be an integer rank" in err["error"]["message"]
        assert "x" not in srv.gateway.router.adapters_of("mock")


def test_bad_calls_name_what_is_wrong(tmp_path):
    with running_gateway(mock_deployment(lora_modules={"sql": "adapters/sql"})) as srv:   # no lora_roots
        status, err = admin(srv, "POST", "/admin/engines/mock/adapters", {"name": "x", "path": str(tmp_path)})
        assert status == 400 and err["error"]["code"] == "path_not_allowed" and "lora_roots" in err["error"]["message"]
        status, err = admin(srv, "POST", "/admin/engines/mock/adapters", {"name": "a:b", "path": "x"})
        assert status == 400 and err["error"]["code"] == "invalid_adapter_name"
        status, err = admin(srv, "POST", "/admin/engines/nope/adapters", {"name": "a", "path": "x"})
        assert status == 404 and err["error"]["code"] == "engine_not_found"
        status, _, raw = srv.request("POST", "/admin/engines/mock/adapters", b"[1")
        assert status == 400 and json.loads(raw)["error"]["code"] == "invalid_json"
        srv.gateway.keys.preload(new_record(USER, "t1"))
        status, _, raw = srv.request("POST", "/admin/engines/mock/adapters", {"name": "a", "path": "x"},
                                     headers={"Authorization": f"Bearer {USER}"})
        assert status == 403 and json.loads(raw)["error"]["code"] == "admin_required"


def test_an_unload_is_refused_while_a_request_uses_the_adapter(tmp_path):
    with running_gateway(doc(tmp_path, token_ms=20.0, output_len=40)) as srv:
        results = {}
        t = threading.Thread(target=lambda: results.update(r=srv.chat({**BODY, "model": "mock:sql",
                                                                          "max_tokens": 40})))
        t.start()
        deadline = time.monotonic() + 5
        while srv.engine().stats().num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        status, err = admin(srv, "DELETE", "/admin/engines/mock/adapters/sql")
        assert status == 409 and err["error"]["code"] == "adapter_conflict" and "in flight" in err["error"]["message"]
        t.join(10)
        status, _, reply = results["r"]
        assert status == 200 and reply["usage"]["completion_tokens"] == 40     # the request was not cut
        srv.wait_idle()
        status, _ = admin(srv, "DELETE", "/admin/engines/mock/adapters/sql")
        assert status == 200
        assert "sql" not in srv.gateway.router.adapters_of("mock")


def test_key_and_tenant_allow_lists(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nengines: {small: mock, large: mock2}\n"
                      "prices: {mock: {input: 1, cached_input: 1, output: 1}, mock2: {input: 1, cached_input: 1, "
                      "output: 1}}\ntenants:\n  t2: {adapters: ['mock:chat']}\n")
    d = mock_deployment(lora_modules={"sql": "adapters/sql", "chat": "adapters/chat"})
    d["engines"]["mock2"] = dict(d["engines"]["mock"])
    d["policy"] = str(policy)
    with running_gateway(d) as srv:
        keys = srv.gateway.keys
        keys.preload(new_record("k-sql", "t1", name="sql-only", adapters=["mock:sql"]))
        keys.preload(new_record("k-none", "t1", adapters=[]))
        keys.preload(new_record("k-any", "t2", adapters=["*"]))

        def chat(key: str, model: str):
            return srv.chat({**BODY, "model": model}, headers={"Authorization": f"Bearer {key}"})

        assert chat("k-sql", "mock:sql")[0] == 200
        status, _, err = chat("k-sql", "mock:chat")
        assert status == 403 and err["error"]["code"] == "adapter_not_allowed"
        assert "'mock:chat'" in err["error"]["message"] and "sql-only" in err["error"]["message"]
        assert chat("k-sql", "mock")[0] == 200                   # the base is not the list's business
        assert chat("k-none", "mock:sql")[0] == 403
        assert chat("k-sql", "mock:nope")[0] == 404               # unknown: a 404 like an unknown model
        assert chat("k-any", "mock:chat")[0] == 200               # the tenant's list allows chat
        status, _, err = chat("k-any", "mock:sql")                # ... and not sql
        assert status == 403 and "tenant t2" in err["error"]["message"]


def test_policies_match_and_pin_adapters(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nengines: {small: mock, large: mock2}\n"
                      "prices: {mock: {input: 1, cached_input: 1, output: 1}, mock2: {input: 1, cached_input: 1, "
                      "output: 1}}\nrules:\n"
                      "  - {name: no-sql, match: {models: 'mock:sql', tenants: t9}, action: {deny: no sql for t9}}\n"
                      "  - {name: to-chat, match: {tenants: t3}, action: {pin: 'mock:chat'}}\n")
    d = mock_deployment(lora_modules={"sql": "adapters/sql", "chat": "adapters/chat"})
    d["engines"]["mock2"] = dict(d["engines"]["mock"])
    d["policy"] = str(policy)
    with running_gateway(d) as srv:
        srv.gateway.keys.preload(new_record("k3", "t3"))
        srv.gateway.keys.preload(new_record("k9", "t9"))

        def chat(key: str, model: str):
            return srv.chat({**BODY, "model": model}, headers={"Authorization": f"Bearer {key}"})

        status, _, reply = chat("k3", "auto")                      # the rule pins the chat adapter
        assert status == 200 and reply["choices"][0]["message"]["content"].startswith("[chat]")
        status, _, reply = chat("k9", "mock:chat")                 # requested under a policy: honoured
        assert status == 200 and reply["choices"][0]["message"]["content"].startswith("[chat]")
        status, _, err = chat("k9", "mock:sql")                    # a rule matching the adapter's model
        assert status == 403 and err["error"]["code"] == "policy_denied"


def test_the_cli_lists_loads_and_unloads_through_the_admin_api(tmp_path, capsys):
    from gateway_helpers import KEY

    from tokenyard.cli.main import main

    adapter_dir(tmp_path, "extra")
    with running_gateway(doc(tmp_path)) as srv:
        common = ["engine", "adapters", "--gateway", srv.base_url, "--engine", "mock", "--key", KEY]
        assert main([*common[:2], "load", *common[2:], "--name", "extra", "--path", "extra"]) == 0
        assert json.loads(capsys.readouterr().out)["model"] == "mock:extra"
        assert main([*common[:2], "list", *common[2:]]) == 0
        assert [a["name"] for a in json.loads(capsys.readouterr().out)["adapters"]] == ["extra", "sql"]
        assert main([*common[:2], "load", *common[2:], "--name", "x", "--path", "/etc"]) == 1
        assert "path_not_allowed" in capsys.readouterr().err
        assert main([*common[:2], "unload", *common[2:], "--name", "extra"]) == 0
        assert "mock:extra" not in [f"mock:{a}" for a in srv.gateway.router.adapters_of("mock")]
        assert main([*common[:2], "unload", *common[2:]]) == 2          # no --name
