"""What the reliability scenarios (issue 15) share: the `Report` each returns, the checks they
end with (engine and gateway idle, spend ledger), error-log capture, metric text, and a gateway in
a process of its own.

The scenarios (tests/reliability_{disconnects,overload,failures,redis,fuzz}.py) are sized by their
arguments: the fast tests in tests/test_reliability_*.py run them small, `python -m tokenyard.bench.reliability`
runs them full size.

Each scenario returns a `Report`: the figures it measured and a list of `problems` (broken
promises, in words). A test asserts that `problems` is empty; the benchmark prints both.

Everything is loopback. Redis: the shared one on 127.0.0.1:6379 under a unique prefix (deleted
afterwards), or a PrivateRedis the outage scenario starts and stops; the shared one is never stopped.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway_helpers import ROOT

MODEL = ROOT / "models" / "demo-small"


@dataclass
class Report:
    name: str
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.problems.append(message)


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


class ErrorLogs:
    """Collects ERROR log records (root, uvicorn) while active: a client leaving is not an error."""

    def __init__(self) -> None:
        import logging
        self.records: list[str] = []
        outer = self

        class _H(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                outer.records.append(f"{record.name}: {record.getMessage()[:200]}")

        self.handler = _H(level=logging.ERROR)
        self.loggers = [logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error")]

    def __enter__(self) -> "ErrorLogs":
        for lg in self.loggers:
            lg.addHandler(self.handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for lg in self.loggers:
            lg.removeHandler(self.handler)


def check_idle(srv, report: Report, engine: str, timeout: float = 10.0) -> None:
    """No leaked KV block, nothing in flight anywhere (engine, admission, gateway)."""
    stats = srv.wait_idle(engine, timeout)
    report.figures["kv_blocks_free_after"] = f"{stats.num_free_blocks}/{stats.num_total_blocks}"
    report.check(stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
                 and stats.num_waiting == 0, f"engine not idle afterwards: {stats}")
    gw = srv.gateway
    deadline = time.monotonic() + timeout
    while (gw.in_progress or srv.engine(engine).num_in_flight) and time.monotonic() < deadline:
        time.sleep(0.02)
    q = gw.admission.queues[engine]
    report.check(srv.engine(engine).num_in_flight == 0, "engine streams left in flight")
    report.check(gw.in_progress == 0, f"{gw.in_progress} HTTP requests still in progress")
    report.check(q.running == 0 and len(q.queue) == 0, f"admission: running={q.running} queued={len(q.queue)}")
    report.check(gw.admission.tenants == {}, f"admission tenants left: {gw.admission.tenants}")
    report.check(gw.metrics.in_flight._value.get() == 0, "in-flight gauge is not 0")


def check_ledger(client, prefix: str, tenants: list[str], reached: list[str], seen: dict[str, dict],
                 report: Report) -> None:
    """One record per request that reached the engine, usage equal to what complete clients saw,
    rollups equal to the sum of the records."""
    from tests.gateway.test_spend_ledger import read_records, read_rollups, sum_records
    records = read_records(client, prefix, tenants)
    by_rid = {r["client_request_id"]: r for r in records}
    report.figures["records"] = len(records)
    lost = set(reached) - set(by_rid)
    report.figures["records_lost"] = len(lost)
    report.check(len(records) == len(by_rid), f"{len(records) - len(by_rid)} duplicate records")
    report.check(not lost, f"{len(lost)} requests reached the engine but have no record, e.g. {sorted(lost)[:3]}")
    extra = set(by_rid) - set(reached)
    report.check(not extra, f"{len(extra)} records for requests that never reached the engine")
    mismatched = 0
    for rid, s in seen.items():
        if s.get("usage") is None:
            continue
        rec = by_rid.get(rid)
        u = s["usage"]
        if rec is None or (rec["prompt_tokens"], rec["completion_tokens"]) != (u["prompt_tokens"],
                                                                                u["completion_tokens"]):
            mismatched += 1
    report.figures["usage_mismatches"] = mismatched
    report.check(mismatched == 0, f"{mismatched} records differ from the usage the client saw")
    rollups, sums = read_rollups(client, prefix, tenants), sum_records(records)
    report.check(rollups == sums, "hourly rollups differ from the sum of the records")
    report.figures["cost_micros"] = sum(v["cost_micros"] for v in rollups.values())


def serve_process(document: dict, dev_key: str, tmp: Path, access_log: bool = False, stderr_file: bool = False,
                  fd_limit: int | None = None) -> tuple[subprocess.Popen, int]:
    """`tokenyard serve` in a process of its own (client and gateway do not share a GIL); with
    access_log (or stderr_file), its stderr (the JSON access log) goes to tmp/stderr.log. The
    document's own `server:` keys are kept (host, port and access_log are set here). fd_limit: the
    process's open-file limit, soft and hard (a small one shows fd exhaustion without 20,000 sockets)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp / "gateway.yaml"
    server = {**document.get("server", {}), "host": "127.0.0.1", "port": port, "access_log": access_log}
    cfg.write_text(json.dumps({**document, "server": server, "spend": {"spool_dir": str(tmp / "spool")}}))
    env = {**os.environ, "TOKENYARD_DEV_KEY": dev_key, "PYTHONPATH": str(ROOT)}
    stderr = open(tmp / "stderr.log", "wb") if access_log or stderr_file else subprocess.DEVNULL

    def limit_fds() -> None:
        if fd_limit is not None:
            import resource
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    proc = subprocess.Popen([sys.executable, "-m", "tokenyard.cli.main", "serve", "--config", str(cfg)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=stderr, preexec_fn=limit_fds)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if b" 200 " in s.recv(1024):
                    return proc, port
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("gateway process did not start")


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def _counter(text: str, name: str) -> float:
    """A labelled Prometheus counter's value; 0 when its line is absent (a labelled child is only
    exposed once it has been incremented, e.g. no record was spooled)."""
    value = _metric(text, name)
    return 0.0 if value != value else value


def full_run_selected(config) -> bool:
    """The full-size tests run only when asked for by marker (`pytest -m reliability`)."""
    expr = config.getoption("markexpr") or ""
    return "reliability" in expr and "not reliability" not in expr


def explain(report: Report) -> str:
    return f"{report.name}: {report.problems}\nfigures: {json.dumps(report.figures, default=str)}"


def openai_error_shape(body: Any) -> bool:
    # The four OpenAI fields with their types; an extra detail field (the policy endpoints'
    # "problems" list) is allowed, as OpenAI clients ignore unknown keys.
    return (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
            and {"message", "type", "param", "code"} <= set(body["error"])
            and isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str)
            and (body["error"]["param"] is None or isinstance(body["error"]["param"], str))
            and (body["error"]["code"] is None or isinstance(body["error"]["code"], str)))


def anthropic_error_shape(body: Any) -> bool:
    """Anthropic's {"type": "error", "error": {"type", "message"}} (the Messages API routes)."""
    return (isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict)
            and isinstance(body["error"].get("type"), str) and isinstance(body["error"].get("message"), str))


def stop_process(proc: subprocess.Popen, grace_s: float = 40.0) -> None:
    """SIGTERM, then the gateway's drain (server.drain_grace_s, 30 s by default) plus a margin;
    a gateway still up after that is killed, so a scenario's figures never wait on its shutdown."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
