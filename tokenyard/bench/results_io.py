"""The raw output of a benchmark, as committed under bench/results/<name>.json.

Every figure in bench/RESULTS.md has to be traceable to one of these files, so each one says
what produced it and where: the exact command, the git commit (and whether the tree was dirty),
the machine, and the load average before and after the run. The development machine is shared
with other work, so the load is recorded rather than assumed; a reader can then judge a timing.

Files stay small: summaries, percentiles and per-run values, never per-request dumps (those go
to the ignored scratch folder bench/out/).

    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder("w2_throughput")          # load_avg "before" taken here
    ... run ...
    rec.write(figures={"speedup": 2.1}, runs=[{...}, {...}])
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS_DIR = ROOT / "bench" / "results"

# What every results file must carry (tests/bench/test_bench_results.py checks these).
REQUIRED_KEYS = ("name", "date", "machine", "git_commit", "dirty", "command", "load_avg", "figures", "runs")
MACHINE_KEYS = ("platform", "cpu_model", "cores", "ram_gib", "python", "torch", "torch_threads")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return math.nan


def machine() -> dict[str, Any]:
    """The machine a figure was taken on. torch is optional (the gateway benchmarks need none)."""
    info: dict[str, Any] = {"platform": platform.platform(), "cpu_model": _cpu_model(), "cores": os.cpu_count(),
                            "ram_gib": _ram_gib(), "python": platform.python_version(), "torch": None,
                            "torch_threads": None}
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def git_state() -> tuple[str, list[str]]:
    """(commit, modified tracked files). Untracked files (bench/out/, other work in progress) do
    not change the code that ran, so they do not count."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout
    try:
        commit = git("rev-parse", "HEAD").strip() or "unknown"
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    except (OSError, subprocess.SubprocessError):
        return "unknown", ["(git unavailable)"]
    return commit, changed


def load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null / "inf" so every file parses strictly."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


@dataclass(slots=True)
class RunRecorder:
    """Open at the start of a benchmark (takes the "before" load average and the start time),
    `write` at the end. `command` defaults to this process's argv."""

    name: str
    command: list[str] | None = None
    out_dir: Path = RESULTS_DIR
    started: str = field(init=False)
    load_before: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.load_before = load_avg()
        if self.command is None:
            # orig_argv keeps "-m bench.x" as typed (argv[0] would be the module's file path).
            argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
            self.command = [Path(argv[0]).name, *argv[1:]]

    def document(self, figures: dict[str, Any], runs: list[Any], **extra: Any) -> dict[str, Any]:
        commit, changed = git_state()
        doc = {"name": self.name, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "started": self.started, "machine": machine(), "git_commit": commit, "dirty": bool(changed),
               "dirty_files": changed[:20],
               "command": list(self.command or []),
               "load_avg": {"before": self.load_before, "after": load_avg()},
               "figures": figures, "runs": runs}
        doc.update(extra)
        return _clean(doc)

    def write(self, figures: dict[str, Any], runs: list[Any], **extra: Any) -> Path:
        """Write bench/results/<name>.json (indented, sorted as given) and return its path."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{self.name}.json"
        path.write_text(json.dumps(self.document(figures, runs, **extra), indent=1, allow_nan=False) + "\n")
        print(f"raw results: {path}", file=sys.stderr)
        return path


def validate(doc: dict[str, Any]) -> list[str]:
    """Problems with a results document (empty when it is fine)."""
    problems = [f"missing key {k!r}" for k in REQUIRED_KEYS if k not in doc]
    m = doc.get("machine")
    if isinstance(m, dict):
        problems += [f"machine lacks {k!r}" for k in MACHINE_KEYS if k not in m]
    elif "machine" in doc:
        problems.append("machine is not an object")
    if "command" in doc and not (isinstance(doc["command"], list) and doc["command"]):
        problems.append("command is not a non-empty argv list")
    la = doc.get("load_avg")
    if "load_avg" in doc and not (isinstance(la, dict) and "before" in la and "after" in la):
        problems.append("load_avg needs before and after")
    if "figures" in doc and not isinstance(doc["figures"], dict):
        problems.append("figures is not an object")
    if "runs" in doc and not isinstance(doc["runs"], list):
        problems.append("runs is not a list")
    if "date" in doc:
        try:
            _dt.datetime.fromisoformat(str(doc["date"]))
        except ValueError:
            problems.append(f"date {doc['date']!r} is not ISO 8601")
    return problems
