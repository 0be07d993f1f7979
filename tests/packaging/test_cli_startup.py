"""`tokenyard --help`, `--version` and the non-engine commands start without torch (issue 47.3).

Each check runs the CLI's main() in a fresh interpreter (this one has torch loaded by conftest) and
reports which heavy modules got imported. Wall time is not asserted (shared CI machines); the measure
is `python -X importtime -m tokenyard.cli.main --help`.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import tokenyard

PROBE = """
import json, sys
from tokenyard.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = ("torch", "triton", "numpy", "sklearn", "matplotlib", "starlette", "uvicorn", "redis", "transformers")
print(json.dumps(sorted(m for m in heavy if m in sys.modules)), file=sys.stderr)
"""


def _imported(*argv: str) -> tuple[list[str], str]:
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    return json.loads(p.stderr.strip().splitlines()[-1]), p.stdout


def test_help_imports_no_engine_or_gateway_module():
    imported, out = _imported("--help")
    assert "serve" in out and "generate" in out and "router" in out    # every command is still listed
    assert imported == []


def test_version_prints_the_installed_version():
    imported, out = _imported("--version")
    assert out.strip() == f"tokenyard {tokenyard.__version__}"
    assert tokenyard.__version__ != "0+unknown"      # make install installs the package (editable)
    assert imported == []


@pytest.mark.parametrize("argv", [("--help",), ("spend", "--help"), ("spend", "report", "--help")])
def test_help_loads_neither_torch_nor_the_gateway_stack(argv):
    """The help of the CLI and of `tokenyard spend` (which loaded redis, starlette and the policies while
    cli/spend.py imported the gateway's spend queries at its top) loads no torch, starlette or redis: the
    timing-free proxy for a quick --help."""
    imported, out = _imported(*argv)
    assert "usage: tokenyard" in out
    assert not {"torch", "starlette", "redis"} & set(imported), imported


@pytest.mark.parametrize("command", ["serve", "keys", "policy"])
def test_non_engine_commands_do_not_import_torch(command):
    imported, out = _imported(command, "--help")
    assert "--config" in out
    assert "torch" not in imported and "triton" not in imported


def test_engine_command_still_gets_its_arguments():
    """Lazy registration must not lose a command's own options."""
    _, out = _imported("generate", "--help")
    assert "--max-tokens" in out and "--prompt" in out
