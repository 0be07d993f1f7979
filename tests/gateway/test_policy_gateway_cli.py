"""`tokenyard policy` against Redis directly: validate, apply, show, history, rollback, simulate."""
from __future__ import annotations

import yaml
from gateway_helpers import SHARED_REDIS, delete_prefix, running_gateway, unique_prefix, wait_ledger
from policy_gateway_helpers import BASE_POLICY, chat, make_keys, two_engine_deployment, wait_for

from tokenyard.cli.main import main


def test_policy_cli_round_trip(tmp_path, capsys):
    prefix = unique_prefix("polcli")
    keys = make_keys(prefix, "acme")
    doc = two_engine_deployment(prefix)
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump(doc))
    a, b, bad = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "bad.yaml"
    a.write_text(BASE_POLICY)
    b.write_text(BASE_POLICY + "rules:\n  - name: all-small\n    action: {pin: small}\n")
    bad.write_text(BASE_POLICY + "default_priority: urgent\n")

    def run(*args: str) -> tuple[int, str, str]:
        code = main(["policy", "--config", str(config), *args])
        out = capsys.readouterr()
        return code, out.out, out.err

    try:
        code, _, err = run("validate", str(bad))
        assert code == 1 and "line 11, column 19: default_priority" in err and "allowed: interactive, batch" in err
        assert run("validate", str(a))[0] == 0
        with running_gateway(doc) as srv:
            assert run("apply", str(a), "--author", "alice")[1].startswith("applied version 1")
            wait_for(lambda: srv.gateway.policy.number == 1, timeout=1.0)        # pub/sub to the gateway
            for content in ("Add 2 and 2.", "Reverse: x y"):
                assert chat(srv, keys["acme"], content, model="large")[0] == 200
            wait_ledger(srv)
            code, out, _ = run("simulate", str(b), "--since", "1h")
            assert code == 0 and "2 recorded requests" in out and "large_calls" in out
            assert run("apply", str(b))[0] == 0
            wait_for(lambda: srv.gateway.policy.number == 2, timeout=1.0)
            assert chat(srv, keys["acme"], model="large")[1]["x-tokenyard-engine"] == "small"
            code, out, _ = run("rollback", "1", "--author", "bob")
            assert code == 0 and out.startswith("version 3 restores version 1")
            wait_for(lambda: srv.gateway.policy.number == 3, timeout=1.0)
        code, out, _ = run("history")
        lines = out.splitlines()
        assert lines[0].startswith("*    3") and "bob" in lines[0] and "rollback to version 1" in lines[0]
        assert "alice" in lines[2]
        code, out, _ = run("show")
        assert code == 0 and out.split("\n", 1)[1] == BASE_POLICY
        assert run("rollback", "7")[0] == 1
    finally:
        delete_prefix(SHARED_REDIS, prefix)
