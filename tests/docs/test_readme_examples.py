"""The README's examples run as written (issue 45.7).

Code blocks preceded by `<!-- readme-test: KIND -->` are taken from README.md and run:
- gateway: curl commands and Python against a gateway built from tokenyard/deploy/default.yaml (the demo
  pair as torch engines with their settings, the router and the policy; smollm2-135m a mock engine
  of that name, so its name is checked without loading it), in README order and one namespace,
  with $KEY / os.environ["KEY"] set and the base URL pointed at the test gateway;
- offline: the LLM example in-process, from the repository root;
- generate: `tokenyard generate` without --model must load the model the README names as default.
So a model name the gateway does not serve, a token id outside the vocabulary, a bare KEY, or a
default the code does not have fails here. The outputs shown in comments are not compared (greedy
text can differ between CPUs); token-id lists must be the tokenizer's encoding of the text they
stand for.
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from gateway_helpers import KEY, ROOT, running_gateway

from tokenyard.engines.text.tokenizer import Tokenizer

README = ROOT / "README.md"
DOC_URL = "http://127.0.0.1:8000"
BLOCK = re.compile(r"<!-- readme-test: (\w+) -->\n```(\w+)\n(.*?)\n```", re.S)


def _blocks(kind: str) -> list[tuple[str, str, int]]:
    """(language, code, line number) of every README block marked with this kind."""
    text = README.read_text()
    found = [(m.group(2), m.group(3), text.count("\n", 0, m.start(3)) + 1)
             for m in BLOCK.finditer(text) if m.group(1) == kind]
    assert found, f"no README block marked readme-test: {kind}"
    return found


def _int_lists(code: str) -> list[list[int]]:
    """Every list literal of integers in a Python block (token-id prompts)."""
    return [[e.value for e in node.elts] for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.List) and node.elts
            and all(isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts)]


def _run_python(code: str, line: int, ns: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README.md:{line}", "exec"), ns)   # noqa: S102 - the README's own example
    return out.getvalue()


def _curl_commands(code: str) -> list[str]:
    """The curl commands of a bash block, continuation lines joined, comments dropped."""
    commands, current = [], ""
    for raw in code.splitlines():
        line = raw if current else raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += line.rstrip("\\") + (" " if line.endswith("\\") else "\n")
        if not line.endswith("\\") and current.count("'") % 2 == 0:
            if current.lstrip().startswith("curl "):
                commands.append(current.strip())
            current = ""
    return commands


def _curl(cmd: str, srv, line: int) -> str:
    """The body a README curl command gets: through curl itself, or where the machine has no curl,
    the same method, path, headers and body sent by the test client."""
    if shutil.which("curl"):
        proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                              env={"KEY": KEY, "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        assert proc.returncode == 0, f"README.md:{line}: {cmd}\n{proc.stderr}"
        return proc.stdout.strip()
    args = shlex.split(cmd.replace("$KEY", KEY))
    url = next(a for a in args if a.startswith("http"))
    headers = dict(h.split(": ", 1) for h in (args[i + 1] for i, a in enumerate(args) if a == "-H"))
    data = next((args[i + 1] for i, a in enumerate(args) if a == "-d"), None)
    _, _, body = srv.request("POST" if data else "GET", url[len(srv.base_url):], data, headers)
    return body.decode().strip()


def _test_deployment() -> dict:
    """tokenyard/deploy/default.yaml's engines, router and policy, without Redis; smollm2-135m as a mock."""
    deploy = ROOT / "tokenyard" / "deploy"
    doc = yaml.safe_load((deploy / "default.yaml").read_text())
    engines = {}
    for name, spec in doc["engines"].items():
        if str(spec["model"]).startswith("package:"):   # SmolLM2: its name, served by the mock engine
            engines[name] = {"type": "mock", "model": str(ROOT / "models" / "demo-small")}
        else:
            engines[name] = {**spec, "model": str((deploy / spec["model"]).resolve())}
    return {"server": {"access_log": False}, "engines": engines, "routing": doc["routing"],
            "router": {**doc["router"], "artifact": str((deploy / doc["router"]["artifact"]).resolve())},
            "policy": str((deploy / doc["policy"]).resolve())}


@pytest.fixture(scope="module")
def gateway_srv():
    with running_gateway(_test_deployment()) as srv:
        yield srv


def test_gateway_examples_run_against_the_default_deployment(gateway_srv, monkeypatch):
    monkeypatch.setenv("KEY", KEY)
    ns: dict = {}
    ran = 0
    for lang, code, line in _blocks("gateway"):
        assert "api_key=KEY" not in code, f"README.md:{line}: read the key from os.environ"
        code = code.replace(DOC_URL, gateway_srv.base_url)
        if lang == "bash":
            for cmd in _curl_commands(code):
                body = _curl(cmd, gateway_srv, line)
                if body.startswith("data: "):
                    events = [e[len("data: "):] for e in body.split("\n\n")]
                    assert events[-1] == "[DONE]", f"README.md:{line}: {body[-500:]}"
                    replies = [json.loads(e) for e in events[:-1]]
                else:
                    replies = [json.loads(body)]
                assert all("error" not in r and "choices" in r for r in replies), f"README.md:{line}: {body[:500]}"
                ran += 1
        else:
            out = _run_python(code, line, ns)
            assert out.strip(), f"README.md:{line}: printed nothing"
            ran += 1
    assert ran >= 6


def test_token_id_examples_are_the_tokenizers_encoding():
    """Every token-id list in a gateway or offline example is inside the demo vocabulary and is
    the encoding of the chat-format prompt next to it."""
    for kind, model in (("gateway", "demo-small"), ("offline", "demo-large")):
        tok = Tokenizer.from_dir(ROOT / "models" / model)
        vocab = json.loads((ROOT / "models" / model / "config.json").read_text())["vocab_size"]
        for lang, code, line in _blocks(kind):
            if lang != "python":
                continue
            for ids in _int_lists(code):
                assert max(ids) < vocab and min(ids) >= 0, f"README.md:{line}: {ids} outside {model}'s {vocab} ids"
                texts = re.findall(r'"(<\|user\|>[^"]*)"', code)
                assert texts, f"README.md:{line}: token ids without the prompt they encode"
                assert ids in [tok.encode(t) for t in texts], f"README.md:{line}: {ids} is not {texts}"


def test_offline_example_runs(monkeypatch):
    monkeypatch.chdir(ROOT)
    ((lang, code, line),) = _blocks("offline")
    ns: dict = {}
    out = _run_python(code, line, ns)
    assert len(out.strip().splitlines()) == 2
    # The text prompt and its token ids are one prompt: the same greedy completion.
    outs = ns["outs"]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[1].outputs[0].finish_reason in ("stop", "length")


def test_generate_default_is_the_one_the_readme_names(monkeypatch):
    from tokenyard.cli.main import main
    from tokenyard.engines.core.errors import CheckpointError
    from tokenyard.engines.serving import generate_cli

    ((_, code, line),) = _blocks("generate")
    first = next(c for c in code.splitlines() if c.startswith("tokenyard generate") and "--model" not in c)
    command, _, comment = first.partition("#")
    claimed = re.search(r"default model: (\S+)", comment)
    assert claimed, f"README.md:{line}: the default model is not named"
    loaded = []

    def engine(model, **options):
        loaded.append(str(model))
        raise CheckpointError("stop here: the test only needs the model path")

    monkeypatch.setattr(generate_cli, "Engine", engine)
    assert main(shlex.split(command)[1:]) == 2
    assert claimed.group(1) in Path(loaded[0]).name, (
        f"README.md:{line} says the default is {claimed.group(1)}; the code loads {loaded[0]}")
