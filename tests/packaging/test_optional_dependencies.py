"""The gateway never needs an extra (issue 47.2): matplotlib lives in `bench`, triton and nvidia-ml-py in `gpu`.

A fresh interpreter refuses those imports, then imports every module of tokenyard.gateway, the router's
runtime and the CLI's serve command; a module that imported an extra at import time would fail here. (The figures' code imports
matplotlib inside the plotting functions; the device gauges import pynvml inside their first call.)
"""
from __future__ import annotations

import subprocess
import sys

from import_refusal import refusing

PROBE = """
import importlib, pkgutil
import tokenyard.cli.serve
import tokenyard.gateway
import tokenyard.router_models.runtime
names = [m.name for pkg in (tokenyard.gateway, tokenyard.router_models.runtime)
         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print("ok", len(names) > 50)
"""


def _run(blocked: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", refusing(blocked) + PROBE], capture_output=True, text=True,
                          timeout=300)


def test_gateway_imports_without_the_bench_and_gpu_extras():
    p = _run(("matplotlib", "triton", "pynvml"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "ok True"


def test_the_probe_can_fail():
    p = _run(("starlette",))
    assert p.returncode != 0 and "blocked for this test: starlette" in p.stderr
