"""Start-up phases: the engine's own (Engine.startup_phases), `tokenyard engine serve`'s from process
start to ready, and tokenyard_engine_startup_seconds in the replica's and the gateway's /metrics."""
from __future__ import annotations

import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tokenyard.engines.core.startup_phases import PHASES, StartupPhases, process_age_s
from tokenyard.engines.runtime.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gateway_helpers import running_gateway  # noqa: E402
from replica_helpers import ReplicaProcess, get_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo-small"
TOL_S = 0.05     # timer reads between phases that no phase covers


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_nested_phases_are_not_counted_twice_and_other_takes_the_rest():
    clock = FakeClock()
    p = StartupPhases(clock)
    with p.phase("weights_read"):
        clock.t += 2.0
        with p.phase("quantise_pack"):
            clock.t += 0.5
        clock.t += 1.0
    with p.phase("kv_allocation"):
        clock.t += 0.25
    p.add("imports", 1.5)
    assert p.finish(6.0) == {"imports": 1.5, "weights_read": 3.0, "quantise_pack": 0.5, "kv_allocation": 0.25,
                             "other": 0.75}
    assert list(p.as_dict()) == [n for n in PHASES if n in p.seconds]     # in the order they happen
    assert "6.00 s" in p.describe()
    with pytest.raises(ValueError, match="unknown start-up phase 'weights'"):
        with p.phase("weights"):
            pass


def test_process_age_is_the_time_since_this_process_started():
    age = process_age_s()
    assert age is not None and 0 < age < time.time()     # Linux: /proc
    time.sleep(0.05)
    assert process_age_s() >= age + 0.04


@pytest.mark.parametrize("quantization, expect", [("none", set()), ("int8", {"quantise_pack"})])
def test_engine_records_its_phases(quantization, expect):
    t0 = time.perf_counter()
    eng = Engine(DEMO, quantization=quantization, kv_cache_memory=16 << 20, progress=False, cpu_compile="off")
    measured = time.perf_counter() - t0
    phases = eng.startup_phases.as_dict()
    eng.close()
    assert {"weights_read", "kv_allocation", "compile", "other"} | expect <= set(phases)
    assert ("quantise_pack" in phases) == bool(expect)
    assert all(s >= 0 for s in phases.values()), phases
    assert eng.startup_phases.total_s == pytest.approx(sum(phases.values()), abs=1e-9)
    # the engine's total is its __init__: within the time measured around it
    assert measured - TOL_S <= sum(phases.values()) <= measured, (measured, phases)
    assert phases["weights_read"] > 0 and phases["kv_allocation"] > 0


def test_engine_serve_reports_phases_from_process_start_to_ready(tmp_path):
    t0 = time.monotonic()
    rep = ReplicaProcess(tmp_path, {"type": "torch", "model": str(DEMO), "quantization": "int8",
                                    "kv_cache_memory": 16 << 20, "cpu_compile": "off"}, name="demo-small")
    try:
        rep.wait_ready(120)
        waited = time.monotonic() - t0
        assert get_json(rep.url + "/ready")[0] == 200
        text = urllib.request.urlopen(rep.url + "/metrics", timeout=5).read().decode()
        phases = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^tokenyard_engine_startup_seconds{engine="demo-small",phase="([a-z_]+)"} (\S+)$', text, re.M)}
        assert {"imports", "weights_read", "quantise_pack", "kv_allocation", "compile", "warm_up", "other"} \
            <= set(phases), phases
        assert all(s >= 0 for s in phases.values()), phases
        assert phases["imports"] > 0.1        # an interpreter and torch do not import in 100 ms
        total = sum(phases.values())
        # process start to ready: after Popen, before the test saw /ready answer 200 (10 ms: /proc's tick)
        assert total <= waited + 0.01, (total, waited)
        assert total >= waited - 1.0, (total, waited)   # the poll sees ready within its 50 ms + a request
        log = rep.log.read_text()
        assert re.search(r"replica demo-small ready in [\d.]+ s: imports [\d.]+, weights_read", log), log[-2000:]
    finally:
        rep.stop()


def test_gateway_metrics_show_each_in_process_engines_phases():
    doc = {"server": {"access_log": False}, "routing": {"small": "demo-small", "large": "demo-small"},
           "engines": {"demo-small": {"type": "torch", "model": str(DEMO), "kv_cache_memory": 16 << 20,
                                      "cpu_compile": "off"},
                       "mock": {"type": "mock", "model": str(DEMO)}}}
    with running_gateway(doc) as srv:
        text = srv.request("GET", "/metrics", headers={"Authorization": ""})[2].decode()
        built = srv.engine("demo-small").startup_phases
    shown = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^tokenyard_engine_startup_seconds{engine="demo-small",phase="([a-z_]+)"} (\S+)$', text, re.M)}
    assert shown == pytest.approx(built, abs=1e-9) and {"weights_read", "kv_allocation", "compile"} <= set(shown)
    assert 'tokenyard_engine_startup_seconds{engine="mock"' not in text      # a mock keeps no phases


# The parent of a replica whose engine steps in a core process (the default for a torch engine) runs
# HTTP and a socket: if it imported torch too, the replica's start would pay torch's import twice, one
# after the other (1.2-1.5 s each on a 2-core VM; the ready time went from 1.5 s to 2.9-7.5 s). Nor
# numpy: the parent reads the deployment before it starts its core, so every import on that path
# delays the core's own (the deployment's router section pulled numpy in through the learned router:
# 0.14 s of the 2 s ready budget on a 2-core Xeon VM). Nor the HTTP server's stack: `tokenyard engine serve`
# imports it on a thread while its core starts (its errors module pulled starlette in on the way).
_PARENT_ONLY = """
import sys
from tokenyard.cli.deployment_arg import load_or_exit
from tokenyard.gateway.config.deployment import apply_env
import tokenyard.cli.engine, tokenyard.engines.serving.replica_server, tokenyard.engines.serving.engine_process
import tokenyard.engines.core.startup_phases, tokenyard.engines.runtime.async_engine
from tokenyard.gateway.backends.engine_pool import _recipe, tokenizer_fingerprint
dep = apply_env(load_or_exit(None))
spec = dep.engines["smollm2-135m"]
assert spec.type == "torch", spec.type
_recipe(spec), tokenizer_fingerprint(spec.model)
heavy = sorted(m for m in ("torch", "triton", "transformers", "numpy", "sklearn", "starlette", "uvicorn")
               if m in sys.modules)
print("HEAVY", heavy)
"""


def test_a_replica_parent_imports_neither_torch_nor_numpy_before_its_core():
    import subprocess
    out = subprocess.run([sys.executable, "-c", _PARENT_ONLY], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr[-2000:]


def test_engines_package_names_load_on_first_use():
    import subprocess
    code = ("import sys, tokenyard.engines as e\n"
            "assert 'torch' not in sys.modules\n"
            "from tokenyard.engines import LLM, SamplingParams\n"
            "from tokenyard.engines.runtime.llm import LLM as L2\n"
            "assert LLM is L2 and 'torch' in sys.modules and 'LLM' in dir(e)\n"
            "try:\n    e.NoSuchName\nexcept AttributeError as x:\n    print('NAMED', 'NoSuchName' in str(x))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NAMED True" in out.stdout


def test_a_core_reports_its_own_interpreter_and_imports():
    from tokenyard.engines.serving.engine_core import EngineRecipe, reap, spawn_core
    recipe = EngineRecipe("torch", DEMO, {"kv_cache_memory": 16 << 20, "cpu_compile": "off"})
    t0 = time.monotonic()
    proc, sock, hello = spawn_core(recipe, "demo-small")
    waited = time.monotonic() - t0
    try:
        phases = hello[5]
        # the core's interpreter and torch's import, which the engine's own phases do not see
        assert phases["imports"] > 0.1, phases
        assert {"weights_read", "kv_allocation"} <= set(phases), phases
        assert sum(phases.values()) <= waited + 0.05, (phases, waited)
    finally:
        sock.close()
        reap(proc)
