"""The README's and the docs site's examples run as written (issues 45.7 and 47.5).

Code blocks preceded by `<!-- readme-test: KIND -->` are taken from README.md and docs/*.md and run:
- gateway: curl commands and Python against a gateway built from tokenyard/deploy/default.yaml (the demo
  pair as torch engines with their settings, the router and the policy; smollm2-135m a mock engine
  of that name, so its name is checked without loading it), page by page in page order, one namespace
  per page, with $KEY / os.environ["KEY"] set and the base URL pointed at the test gateway;
- cli: the `tokenyard` commands of a bash block (spend reports, policy show/simulate/apply) through
  bash, against that gateway's Redis after the gateway examples left usage records there; each
  command must succeed, and the comment lines none of whose fields is a number (table and CSV headers)
  must be lines of the real output;
- offline: the LLM example in-process, from the repository root;
- generate: `tokenyard generate` without --model must load the model the docs name as default.
So a model name the gateway does not serve, a token id outside the vocabulary, a bare KEY, or a
default the code does not have fails here. Outputs with numbers are not compared (greedy text can
differ between CPUs); token-id lists must be the tokenizer's encoding of the text they stand for.
Every other Python block of the pages is checked statically: the models it names are served.
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
import sys
from pathlib import Path

import pytest
import yaml
from gateway_helpers import KEY, ROOT, SHARED_REDIS, delete_prefix, running_gateway, unique_prefix, wait_ledger

from tokenyard.engines.text.tokenizer import Tokenizer
from tokenyard.gateway.config.deployment import DEFAULT_FILE

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_URL = "http://127.0.0.1:8000"
BLOCK = re.compile(r"<!-- readme-test: (\w+) -->\n```(\w+)\n(.*?)\n```", re.S)
ANY_BLOCK = re.compile(r"```(\w+)\n(.*?)\n```", re.S)


def _where(page: Path, line: int) -> str:
    return f"{page.relative_to(ROOT)}:{line}"


def _blocks(kind: str) -> list[tuple[Path, str, str, int]]:
    """(page, language, code, line number) of every block marked with this kind, README first."""
    found = []
    for page in PAGES:
        text = page.read_text()
        found += [(page, m.group(2), m.group(3), text.count("\n", 0, m.start(3)) + 1)
                  for m in BLOCK.finditer(text) if m.group(1) == kind]
    assert found, f"no README or docs block marked readme-test: {kind}"
    return found


def _int_lists(code: str) -> list[list[int]]:
    """Every list literal of integers in a Python block (token-id prompts)."""
    return [[e.value for e in node.elts] for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.List) and node.elts
            and all(isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts)]


def _run_python(code: str, where: str, ns: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, where, "exec"), ns)   # noqa: S102 - the docs' own example
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


def _curl(cmd: str, srv, where: str) -> str:
    """The body a README curl command gets: through curl itself, or where the machine has no curl,
    the same method, path, headers and body sent by the test client."""
    if shutil.which("curl"):
        proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                              env={"KEY": KEY, "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        assert proc.returncode == 0, f"{where}: {cmd}\n{proc.stderr}"
        return proc.stdout.strip()
    args = shlex.split(cmd.replace("$KEY", KEY))
    url = next(a for a in args if a.startswith("http"))
    headers = dict(h.split(": ", 1) for h in (args[i + 1] for i, a in enumerate(args) if a == "-H"))
    data = next((args[i + 1] for i, a in enumerate(args) if a == "-d"), None)
    _, _, body = srv.request("POST" if data else "GET", url[len(srv.base_url):], data, headers)
    return body.decode().strip()


def _test_deployment() -> dict:
    """The packaged default deployment's engines, router and policy; smollm2-135m as a mock. Redis:
    the shared test server under a prefix of this module's own (the cli examples read it)."""
    deploy = DEFAULT_FILE.parent
    doc = yaml.safe_load(DEFAULT_FILE.read_text())
    engines = {}
    for name, spec in doc["engines"].items():
        if str(spec["model"]).startswith("package:"):   # SmolLM2: its name, served by the mock engine
            engines[name] = {"type": "mock", "model": str(_model_dir("demo-small"))}
        else:
            engines[name] = {**spec, "model": str((deploy / spec["model"]).resolve())}
            if spec.get("lora_modules"):   # adapter folders are relative to the file too
                engines[name]["lora_modules"] = {k: str((deploy / v).resolve()) for k, v in spec["lora_modules"].items()}
    return {"server": {"access_log": False}, "engines": engines, "routing": doc["routing"],
            "router": {**doc["router"], "artifact": str((deploy / doc["router"]["artifact"]).resolve())},
            "policy": str((deploy / doc["policy"]).resolve())}


def _model_dir(name: str) -> Path:
    """Where the default deployment finds a demo model."""
    spec = yaml.safe_load(DEFAULT_FILE.read_text())["engines"][name]
    return (DEFAULT_FILE.parent / spec["model"]).resolve()


def _served_models() -> set[str]:
    return {"auto", *yaml.safe_load(DEFAULT_FILE.read_text())["engines"]}


@pytest.fixture(scope="module")
def gateway_srv():
    prefix = unique_prefix("docs")
    document = {**_test_deployment(), "redis_url": SHARED_REDIS, "redis_prefix": prefix}
    try:
        with running_gateway(document) as srv:
            srv.document = document
            yield srv
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def test_gateway_examples_run_against_the_default_deployment(gateway_srv, monkeypatch):
    monkeypatch.setenv("KEY", KEY)
    namespaces: dict[Path, dict] = {}
    ran = 0
    for page, lang, code, line in _blocks("gateway"):
        where = _where(page, line)
        ns = namespaces.setdefault(page, {})
        assert "api_key=KEY" not in code, f"{where}: read the key from os.environ"
        code = code.replace(DOC_URL, gateway_srv.base_url)
        if lang == "bash":
            for cmd in _curl_commands(code):
                body = _curl(cmd, gateway_srv, where)
                if body.startswith("data: "):
                    events = [e[len("data: "):] for e in body.split("\n\n")]
                    assert events[-1] == "[DONE]", f"{where}: {body[-500:]}"
                    replies = [json.loads(e) for e in events[:-1]]
                else:
                    replies = [json.loads(body)]
                assert all("error" not in r and "choices" in r for r in replies), f"{where}: {body[:500]}"
                ran += 1
        else:
            out = _run_python(code, where, ns)
            assert out.strip(), f"{where}: printed nothing"
            ran += 1
    assert ran >= 6


def test_cli_examples_run_against_the_gateways_redis(gateway_srv, tmp_path):
    """The README's spend report and policy commands, after the gateway examples' traffic."""
    wait_ledger(gateway_srv)
    config = tmp_path / "deployment.yaml"
    config.write_text(yaml.safe_dump(gateway_srv.document))
    cli = Path(sys.executable).parent / "tokenyard"
    # `tokenyard SUB ...` runs with this test's deployment file (--config right after SUB).
    prelude = f'set -e\ntokenyard() {{ sub=$1; shift; "{cli}" "$sub" --config "{config}" "$@"; }}\n'
    ran = 0
    for page, _, code, line in _blocks("cli"):
        where = _where(page, line)
        expected, script = [], ""
        for raw in code.splitlines():
            stripped = raw.strip()
            if stripped.startswith("#"):
                text = stripped[1:].strip()
                # Compared: lines without a number, a sign or a bullet in any field (headers); figures vary.
                if text and text != "..." and not any(re.match(r"[\d+*-]", f) for f in re.split(r"[\s,]+", text) if f):
                    expected.append(" ".join(text.split()))
            elif stripped:
                script += raw.split("  #")[0] + "\n"
        proc = subprocess.run(["bash", "-c", prelude + script], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path, env={**os.environ, "KEY": KEY})
        assert proc.returncode == 0, f"{where}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        got = {" ".join(out_line.split()) for out_line in proc.stdout.splitlines()}
        for want in expected:
            assert want in got, f"{where}: the output has no line {want!r}:\n{proc.stdout[-3000:]}"
        ran += 1
    assert ran >= 2


def test_every_python_example_names_a_served_model():
    """Any Python block of the pages (marked or not): a model= or "model": literal is one the default
    deployment serves (or a placeholder the text explains)."""
    served = _served_models()
    named = re.compile(r'(?:\bmodel=|"model":\s*)"([^"]+)"')
    for page in PAGES:
        text = page.read_text()
        for m in ANY_BLOCK.finditer(text):
            if m.group(1) not in ("python", "bash", "json"):
                continue
            for name in named.findall(m.group(2)):
                line = text.count("\n", 0, m.start(2)) + 1
                assert name in served or name in ("...", "MODEL"), (
                    f"{_where(page, line)}: model {name!r} is not served by the default deployment ({sorted(served)})")


def test_token_id_examples_are_the_tokenizers_encoding():
    """Every token-id list in a gateway or offline example is inside the demo vocabulary and is
    the encoding of the chat-format prompt next to it."""
    for kind, model in (("gateway", "demo-small"), ("offline", "demo-large")):
        tok = Tokenizer.from_dir(_model_dir(model))
        vocab = json.loads((_model_dir(model) / "config.json").read_text())["vocab_size"]
        for page, lang, code, line in _blocks(kind):
            where = _where(page, line)
            if lang != "python":
                continue
            for ids in _int_lists(code):
                assert max(ids) < vocab and min(ids) >= 0, f"{where}: {ids} outside {model}'s {vocab} ids"
                texts = re.findall(r'"(<\|user\|>[^"]*)"', code)
                assert texts, f"{where}: token ids without the prompt they encode"
                assert ids in [tok.encode(t) for t in texts], f"{where}: {ids} is not {texts}"


def test_offline_example_runs(monkeypatch):
    monkeypatch.chdir(ROOT)
    ((page, lang, code, line),) = _blocks("offline")
    ns: dict = {}
    out = _run_python(code, _where(page, line), ns)
    assert len(out.strip().splitlines()) == 2
    # The text prompt and its token ids are one prompt: the same greedy completion.
    outs = ns["outs"]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[1].outputs[0].finish_reason in ("stop", "length")


def test_generate_default_is_the_one_the_readme_names(monkeypatch):
    from tokenyard.cli.main import main
    from tokenyard.engines.core.errors import CheckpointError
    from tokenyard.engines.serving import generate_cli

    ((page, _, code, line),) = _blocks("generate")
    first = next(c for c in code.splitlines() if c.startswith("tokenyard generate") and "--model" not in c)
    command, _, comment = first.partition("#")
    claimed = re.search(r"default model: (\S+)", comment)
    assert claimed, f"{_where(page, line)}: the default model is not named"
    loaded = []

    def engine(model, **options):
        loaded.append(str(model))
        raise CheckpointError("stop here: the test only needs the model path")

    monkeypatch.setattr(generate_cli, "Engine", engine)
    assert main(shlex.split(command)[1:]) == 2
    assert claimed.group(1) in Path(loaded[0]).name, (
        f"{_where(page, line)} says the default is {claimed.group(1)}; the code loads {loaded[0]}")
