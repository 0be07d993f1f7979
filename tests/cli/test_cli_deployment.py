"""Every command that reads the deployment answers a bad one the same way: one line naming the file
and the problem, exit status 2, no traceback (tokenyard/cli/deployment_arg.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenyard.cli.main import main


@pytest.mark.parametrize("argv", [
    ["serve", "--config", "{cfg}"],
    ["keys", "--config", "{cfg}", "list"],
    ["spend", "--config", "{cfg}", "report"],
    ["policy", "--config", "{cfg}", "show"],
    ["engine", "serve", "--config", "{cfg}", "--engine", "x", "--port", "1"],
])
@pytest.mark.parametrize("content, problem", [
    (None, "cannot read the deployment file"),
    ("engines: [1, 2]\n", "engines"),
])
def test_a_bad_deployment_is_one_line_and_exit_2(tmp_path, capsys, argv, content, problem):
    cfg = tmp_path / "d.yaml"
    if content is not None:
        cfg.write_text(content)
    assert main([a.format(cfg=cfg) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tokenyard: {cfg}") and problem in err, err
    assert "Traceback" not in err and err.count("\n") == 1


def test_a_bad_switch_interval_in_the_environment_is_one_line_and_exit_2(capsys, monkeypatch):
    cfg = Path(__file__).resolve().parents[2] / "deploy" / "mock.yaml"
    monkeypatch.setenv("TOKENYARD_GIL_SWITCH_MS", "five")
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenyard: TOKENYARD_GIL_SWITCH_MS must be a number of milliseconds") and "five" in err, err
    assert "Traceback" not in err and err.count("\n") == 1


def test_an_engine_replica_steps_in_a_process_of_its_own_when_asked(monkeypatch):
    import tokenyard.engines.serving.replica_server as replica_server
    from tokenyard.engines.serving.engine_process import EngineProcess

    seen = []
    monkeypatch.setattr(replica_server, "serve", lambda engine, *a, **k: seen.append(engine) or 0)
    monkeypatch.setenv("TOKENYARD_ENGINE_PROCESS", "1")
    cfg = Path(__file__).resolve().parents[2] / "deploy" / "mock.yaml"
    assert main(["engine", "serve", "--config", str(cfg), "--engine", "mock", "--port", "1"]) == 0
    engine, = seen
    assert isinstance(engine, EngineProcess)
    import asyncio
    asyncio.run(engine.stop())          # never started: stop() only ends its process
    assert engine._proc.returncode == 0


def test_an_engine_replica_sets_the_switch_interval_too(monkeypatch):
    import sys

    import tokenyard.engines.serving.replica_server as replica_server

    seen = []
    monkeypatch.setattr(replica_server, "serve", lambda *a, **k: seen.append(sys.getswitchinterval()) or 0)
    monkeypatch.setenv("TOKENYARD_GIL_SWITCH_MS", "2")
    before = sys.getswitchinterval()
    try:
        cfg = Path(__file__).resolve().parents[2] / "deploy" / "mock.yaml"
        assert main(["engine", "serve", "--config", str(cfg), "--engine", "mock", "--port", "1"]) == 0
    finally:
        sys.setswitchinterval(before)
    assert seen == [pytest.approx(0.002)]
