"""The GPU check's one summary table: a row per check (ok / FAIL / skip) and the figure behind it.

Kernel parity rows group tokenyard/bench/gpu_check.py's checks by kernel and dtype (worst case shown);
timing rows give each kernel's share of the HBM roofline; decode rows compare the graph path
with eager (same tokens, speed); the engine rows (tp2 vs tp1, W2 vs transformers) come from
tokenyard/bench/gpu_engine_checks.py, each guarded so one that raises is a FAIL row, not a lost run.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tokenyard.bench.gpu_engine_checks import Row


@dataclass(slots=True)
class Check:
    name: str
    ok: bool
    rel_err: float
    tol: float


@dataclass(slots=True)
class Timing:
    name: str
    ms: float
    bytes: int
    floor_ms: float
    baseline: str = ""
    baseline_ms: float = float("nan")
    extra: dict = field(default_factory=dict)


__all__ = ["Row", "engine_rows", "print_summary", "summary_rows"]


def summary_rows(checks: list[Check], timings: list[Timing], decode: list, dry_run: bool) -> list:
    rows = []
    families: dict[tuple[str, str], list[Check]] = {}
    for c in checks:
        dtype = c.name.rsplit(" ", 1)[-1]
        families.setdefault((c.name.split(" ", 1)[0], dtype), []).append(c)
    for kind in ("write_kv", "attention", "int8", "int4"):
        for dtype in ("float32", "float16", "bfloat16"):
            group = families.get((kind, dtype))
            if group is None:
                if dry_run and dtype == "bfloat16" and kind != "write_kv":
                    rows.append(Row("kernel parity", f"{kind} {dtype}", "skip",
                                    "dry run: interpreter bf16 (tests/kernels/test_triton_kernels.py checks it)"))
                continue
            worst = max(group, key=lambda c: c.rel_err / c.tol if c.tol else c.rel_err)
            ok = all(c.ok for c in group)
            rows.append(Row("kernel parity", f"{kind} {dtype}", "ok" if ok else "FAIL",
                            f"{len(group)} cases, worst rel err {worst.rel_err:.1e} (tol {worst.tol:.0e})"))
    for t in timings:
        base = f", {t.baseline} {t.baseline_ms:.3f} ms" if t.baseline else ""
        rows.append(Row("kernel timing", t.name, "ok",
                        f"{t.ms:.3f} ms = {100 * t.floor_ms / t.ms:.0f}% of the HBM roofline{base}"))
    for eager, graph in zip(decode[0::2], decode[1::2]):
        ok = graph.same_tokens and graph.max_logit_diff < 5e-2
        rows.append(Row("decode", f"{graph.mode} vs eager, batch {graph.batch}", "ok" if ok else "FAIL",
                        f"same tokens {graph.same_tokens}, |logit diff| {graph.max_logit_diff:.1e}; "
                        f"{graph.tokens_per_s:.0f} vs {eager.tokens_per_s:.0f} tok/s "
                        f"({graph.tokens_per_s / eager.tokens_per_s:.2f}x)"))
    return rows


def engine_rows(dry_run: bool, device: str, tp: dict, w2: dict) -> list:
    from tokenyard.bench import gpu_engine_checks as ec
    from tokenyard.bench.gpu_decode import LLAMA_1B, TINY
    from tokenyard.bench.workloads import W2_MODEL

    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        shapes = {k: v for k, v in (TINY if dry_run else LLAMA_1B).items() if k != "architectures"}
        shapes["num_hidden_layers"] = 2 if dry_run else 4      # tp: a short stack says enough
        tp_dir = ec.write_llama_checkpoint(Path(tmp) / "tp", shapes)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, shapes["vocab_size"], (int(n),), generator=gen).tolist()
                   for n in torch.randint(4, 40, (tp["prompts"],), generator=gen)]
        rows.append(_guarded("tensor parallel", "tp2 vs tp1 greedy",
                             lambda: ec.tp_row(tp_dir, device, prompts, tp["max_tokens"])))
        w2_shapes = dict(TINY if dry_run else W2_MODEL)
        w2_shapes.pop("architectures", None)
        w2_dir = ec.write_llama_checkpoint(Path(tmp) / "w2", w2_shapes)
        rows.append(_guarded("throughput", "W2 engine vs transformers",
                             lambda: ec.w2_row(w2_dir, device, w2["requests"], w2["scale_output"])))
    return rows


def _guarded(section: str, name: str, fn: Callable[[], object]):
    """A row that raised is a FAIL with the error, not the end of the whole check."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported in the table, and the exit status says fail
        return Row(section, name, "FAIL", f"{type(e).__name__}: {str(e)[:160]}")


def print_summary(rows: list) -> None:
    print(f"\n{'section':16} {'check':44} {'status':6}  detail")
    for r in rows:
        print(f"{r.section:16} {r.name:44} {r.status:6}  {r.detail}")
