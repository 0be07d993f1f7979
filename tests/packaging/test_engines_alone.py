"""The engines run without the gateway's dependencies (issue 47.2): a GPU host installs the wheel beside
its own torch and may lack starlette, redis, uvicorn and aiohttp altogether.

A fresh interpreter refuses those imports outright (a meta-path finder raising ImportError), then builds
an LLM on the demo-small checkpoint and generates. The import-linter contract checks the static imports;
this one also catches imports made at run time (inside functions) on the generate path.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from import_refusal import refusing

DEMO_SMALL = Path(__file__).resolve().parents[2] / "tokenyard" / "models" / "demo-small"
BLOCKED = ("starlette", "redis", "uvicorn", "aiohttp", "tokenyard.gateway")

PROBE = """
from tokenyard.engines import LLM, SamplingParams
llm = LLM({model!r})
out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4, out
llm.close()
leaked = [m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED)]
print("ok", leaked)
"""


def _run(blocked: tuple[str, ...]) -> subprocess.CompletedProcess:
    code = refusing(blocked) + PROBE.format(model=str(DEMO_SMALL))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_llm_generates_with_gateway_dependencies_blocked():
    p = _run(BLOCKED)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "ok []"


def test_the_blocker_does_block():
    """The probe is able to fail: blocking something the engine needs (torch) makes it fail."""
    p = _run(("torch",))
    assert p.returncode != 0 and "blocked for this test: torch" in p.stderr
