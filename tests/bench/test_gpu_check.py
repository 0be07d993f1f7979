"""tokenyard/bench/gpu_check.sh --dry-run: the whole GPU check, run the way the GPU machine runs it (a fresh
process, PYTHONPATH=., kernels interpreted on the CPU at toy sizes), so the script cannot rot
between GPU sessions. The figures prove the plumbing only; the GPU run proves the kernels."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenyard.bench.gpu_check import Check
from tokenyard.bench.gpu_check_summary import summary_rows

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("triton", reason="triton is not installed: the GPU check's kernels cannot run")


def test_dry_run_passes_and_reports_every_row(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env["PYTHON"] = sys.executable
    proc = subprocess.run([str(ROOT / "tokenyard" / "bench" / "gpu_check.sh"), "--dry-run", "--out", str(out)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["section"], r["name"]): r for r in report["summary"]}
    assert report["dry_run"] and report["failed"] == []
    for kind in ("attention", "int8", "int4"):
        for dtype in ("float32", "float16"):
            assert rows[("kernel parity", f"{kind} {dtype}")]["status"] == "ok"
        assert rows[("kernel parity", f"{kind} bfloat16")]["status"] == "skip"   # the tests cover it on CPU
    assert rows[("kernel parity", "write_kv bfloat16")]["status"] == "ok"
    assert sum(s == "kernel timing" for s, _ in rows) == 6
    decode = [r for (s, _), r in rows.items() if s == "decode"]
    assert len(decode) == 2 and all(r["status"] == "ok" and "same tokens True" in r["detail"] for r in decode)
    assert rows[("tensor parallel", "tp2 vs tp1 greedy (gloo)")]["status"] == "ok"
    w2 = rows[("throughput", "W2 engine vs transformers")]
    assert w2["status"] == "ok" or (w2["status"] == "skip" and "transformers" in w2["detail"])
    assert rows[("layering", "engines/ and kernels/ without gateway/")]["status"] == "ok"
    table = proc.stdout[proc.stdout.rindex("section "):]        # the one summary table, last
    assert all(r["name"] in table for r in report["summary"])


def test_a_failed_check_makes_a_fail_row():
    checks = [Check("int8 m=1 float16", True, 1e-4, 5e-3), Check("int8 m=16 float16", False, 9e-3, 5e-3)]
    rows = summary_rows(checks, [], [], dry_run=False)
    assert [(r.name, r.status) for r in rows] == [("int8 float16", "FAIL")]
    assert "9.0e-03" in rows[0].detail
