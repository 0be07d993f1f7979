"""A gateway that stops, and the process around it that exits, print nothing alarming (issue 45.8).

The gateway freezes the GC after start-up (tokenyard/gateway/server/app.py). Frozen objects are never collected,
not even when the interpreter exits, so Triton's nanobind module (imported by torch._dynamo when a
torch engine loads) found its objects alive at exit and printed ~30 lines of "nanobind: leaked ..."
after every stop of the gateway and at the end of `make test`, which reads like a crash. The child
below does what a user does: a gateway over a torch engine, one constrained (response_format)
request, stop, exit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import json, sys
    # Since the cold-start cuts the engine no longer imports torch._dynamo (and so Triton) to build its
    # model; an engine that compiles still does: import it here, as such an engine would.
    import torch._dynamo  # noqa: F401
    sys.path.insert(0, "tests")
    from gateway_helpers import ROOT, running_gateway
    doc = {"server": {"access_log": False},
           "engines": {"demo": {"type": "torch", "model": str(ROOT / "models" / "demo-small"),
                                "dtype": "float32", "kv_cache_memory": 8 << 20}}}
    with running_gateway(doc) as s:
        status, _, body = s.chat({"model": "demo", "max_tokens": 8, "temperature": 0,
                                  "messages": [{"role": "user", "content": "Add 2 and 3."}],
                                  "response_format": {"type": "json_object"}})
    print(json.dumps({"status": status, "finish_reason": body["choices"][0]["finish_reason"],
                      "triton_loaded": "triton._C.libtriton" in sys.modules}))
""")


def test_gateway_stop_and_exit_print_no_nanobind_leaks():
    env = {**os.environ, "TOKENYARD_CPU_COMPILE": "off", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"] == 200 and out["finish_reason"] in ("stop", "length")
    # Triton's nanobind module was loaded at exit (else this would pass for the wrong reason).
    assert out["triton_loaded"]
    assert "nanobind: leaked" not in proc.stderr, proc.stderr[-3000:]

