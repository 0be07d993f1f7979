"""The reliability scenarios (issue 15), sized by their arguments: the fast tests in
tests/test_reliability_*.py run them small, `python -m bench.reliability` runs them full size.

Each scenario returns a `Report`: the figures it measured and a list of `problems` (broken
promises, in words). A test asserts that `problems` is empty; the benchmark prints both.

Everything is loopback. Redis: the shared one on 127.0.0.1:6379 under a unique prefix (deleted
afterwards), or a PrivateRedis this module starts and stops (the outage scenario); the shared
one is never stopped.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway_helpers import (KEY, ROOT, SHARED_REDIS, PrivateRedis, delete_prefix, mock_deployment,
                             running_gateway, wait_ledger)

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


# --- a small HTTP/1.1 client on asyncio streams that can leave at any point ----------------------
class Cut(Exception):
    """The client left on purpose."""


async def _close(writer: asyncio.StreamWriter, rst: bool) -> None:
    if rst:   # an abrupt reset instead of a polite FIN
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
    writer.close()
    try:
        await writer.wait_closed()
    except (OSError, ConnectionError):
        pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]):
    if "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
        return
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    while chunk := await reader.read(65536):
        yield chunk


async def chat_raw(port: int, body: dict, headers: dict[str, str], *, mode: str = "complete",
                   cut_s: float = 0.0, cut_events: int = 0, rst: bool = False, timeout: float = 60.0) -> dict:
    """One chat request. mode: complete | partial_body | cut_early (send, wait cut_s, leave before
    reading anything) | mid_stream (leave after cut_events SSE events) | cut_nonstream (wait cut_s).
    Returns {"status", "usage" (what the client saw, when it read the whole answer), "cut"}."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
    out: dict[str, Any] = {"status": None, "usage": None, "cut": mode != "complete", "events": 0}
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if mode == "partial_body":
            writer.write(head + data[: len(data) // 2])
            await writer.drain()
            await asyncio.sleep(cut_s)
            return out
        writer.write(head + data)
        await writer.drain()
        if mode in ("cut_early", "cut_nonstream"):
            await asyncio.sleep(cut_s)
            return out
        status, resp_headers = await asyncio.wait_for(_read_head(reader), timeout)
        out["status"] = status
        buf = b""
        async for chunk in _body_chunks(reader, resp_headers):
            buf += chunk
            if mode == "mid_stream":
                out["events"] = buf.count(b"\n\n")
                if out["events"] >= cut_events:
                    return out
        if mode == "mid_stream":
            out["cut"] = False        # the stream ended before the cut point: it completed
        if status == 200 and body.get("stream"):
            for block in buf.decode().split("\n\n"):
                if block.startswith("data: {") and '"usage": {' in block:
                    out["usage"] = json.loads(block[6:])["usage"]
        elif status == 200:
            out["usage"] = json.loads(buf)["usage"]
        else:
            out["error"] = json.loads(buf)["error"]
        return out
    finally:
        await _close(writer, rst)


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


def record_engine_requests(inner_engine) -> list[str]:
    """Wrap an engine's add_request: the client request id of every request that reached it."""
    seen: list[str] = []
    original = inner_engine.add_request

    def add_request(request_id, *args, **kwargs):
        original(request_id, *args, **kwargs)
        seen.append(request_id.rsplit("-", 1)[0])

    inner_engine.add_request = add_request
    return seen


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
    from test_spend_ledger import read_records, read_rollups, sum_records
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


# --- disconnects ----------------------------------------------------------------------------------
MODES = ("complete", "complete_stream", "partial_body", "cut_early", "mid_stream", "cut_nonstream")


async def _disconnect_load(port: int, keys: list[str], n: int, model: str, concurrency: int, max_cut_s: float,
                           max_tokens: tuple[int, int], seed: int) -> dict[str, dict]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    seen: dict[str, dict] = {}

    async def one(i: int) -> None:
        mode = rng.choice(MODES)
        rid = f"dc{seed}-{i}"
        stream = mode in ("complete_stream", "mid_stream") or (mode in ("cut_early", "partial_body")
                                                                and rng.random() < 0.5)
        body = {"model": model, "messages": [{"role": "user", "content": f"disconnect {i} " * rng.randint(1, 6)}],
                "max_tokens": rng.randint(*max_tokens), "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"Authorization": f"Bearer {keys[i % len(keys)]}", "x-request-id": rid}
        async with sem:
            try:
                r = await chat_raw(port, body, headers, mode="complete" if mode.startswith("complete") else mode,
                                   cut_s=rng.uniform(0, max_cut_s), cut_events=rng.randint(1, 12),
                                   rst=rng.random() < 0.3)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                r = {"status": None, "usage": None, "cut": True, "error": repr(e)}
        r["mode"] = mode
        seen[rid] = r

    await asyncio.gather(*(one(i) for i in range(n)))
    return seen


def run_disconnects(n: int, engine: str = "mock", concurrency: int = 32, seed: int = 1) -> Report:
    """n requests, each completing or leaving at a random point; mock engine or demo-small."""
    import redis

    from gateway.api_keys import KeyStore
    report = Report(f"disconnects ({engine})")
    prefix = f"tytest:rel:dc:{secrets.token_hex(4)}:"
    client = redis.Redis.from_url(SHARED_REDIS)
    store = KeyStore(client, prefix)
    tenants = ["acme", "globex"]
    keys = [store.create(t, rpm=0, tpm=0, max_concurrent=0)[0] for t in tenants]
    if engine == "mock":
        doc = mock_deployment(ttft_ms=3, token_ms=2, output_len=40, max_sleep_ms=2)
        doc["engines"]["mock"]["prices"] = {"input": 123_457, "cached_input": 61_729, "output": 987_653}
        max_cut, max_tokens = 0.1, (8, 64)
    else:
        doc = {"server": {"access_log": False},
               "engines": {"demo-small": {"type": "torch", "model": str(MODEL), "kv_cache_memory": 16 << 20,
                                          "prices": {"input": 50_000, "cached_input": 10_000, "output": 200_000}}}}
        max_cut, max_tokens = 0.3, (4, 24)
    doc.update(redis_url=SHARED_REDIS, redis_prefix=prefix,
               admission={"max_concurrent_per_tenant": 0, "max_queue": 4096})
    t0 = time.perf_counter()
    try:
        with running_gateway(doc) as srv:
            reached = record_engine_requests(srv.engine(engine).engine)
            with ErrorLogs() as errors:
                seen = asyncio.run(_disconnect_load(srv.port, keys, n, engine, concurrency, max_cut, max_tokens,
                                                    seed))
            wall = time.perf_counter() - t0
            report.figures["error_logs"] = len(set(errors.records))
            report.check(not errors.records, f"errors logged: {sorted(set(errors.records))[:3]}")
            check_idle(srv, report, engine)
            wait_ledger(srv, timeout=60)
            check_ledger(client, prefix, tenants, reached, seen, report)
            statuses: dict[str, int] = {}
            for r in seen.values():
                statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
            bad = {s: c for s, c in statuses.items() if s not in ("200", "None")}
            report.check(not bad, f"unexpected statuses {bad}")
            report.figures.update(requests=n, seconds=round(wall, 1), reached_engine=len(reached),
                                  completed=sum(1 for r in seen.values() if r["usage"] is not None),
                                  cut=sum(1 for r in seen.values() if r["cut"]),
                                  by_mode={m: sum(1 for r in seen.values() if r["mode"] == m) for m in MODES})
            report.check(report.figures["completed"] > 0 and report.figures["cut"] > 0, "no mix of cut and complete")
    finally:
        client.close()
        delete_prefix(SHARED_REDIS, prefix)
    return report


# --- overload -------------------------------------------------------------------------------------
def serve_process(document: dict, dev_key: str, tmp: Path, access_log: bool = False) -> tuple[subprocess.Popen, int]:
    """`tokenyard serve` in a process of its own (client and gateway do not share a GIL); with
    access_log, its JSON access log goes to tmp/stderr.log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp / "gateway.yaml"
    cfg.write_text(json.dumps({**document, "server": {"host": "127.0.0.1", "port": port, "access_log": access_log},
                               "spend": {"spool_dir": str(tmp / "spool")}}))
    env = {**os.environ, "TOKENYARD_DEV_KEY": dev_key, "PYTHONPATH": str(ROOT)}
    stderr = open(tmp / "stderr.log", "wb") if access_log else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=stderr)
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


async def _overload_client(url: str, keys: list[str], rate: float, seconds: float, deadline_ms: int,
                           bound_s: float) -> list[dict]:
    import aiohttp

    async def one(session, i: int) -> dict:
        t0 = time.perf_counter()
        body = {"model": "mock", "messages": [{"role": "user", "content": f"overload {i}"}], "stream": True}
        headers = {"Authorization": f"Bearer {keys[i % len(keys)]}", "x-request-deadline-ms": str(deadline_ms)}
        try:
            async with session.post(url, json=body, headers=headers) as resp:
                if resp.status != 200:
                    data = await resp.read()
                    latency = time.perf_counter() - t0
                    try:
                        code = json.loads(data)["error"]["code"]
                    except (ValueError, KeyError, TypeError):
                        code = "?"
                    return {"status": resp.status, "latency": latency, "code": code,
                            "retry_after": "retry-after" in resp.headers and "retry-after-ms" in resp.headers}
                ttft = None
                ok = False
                async for line in resp.content:
                    if ttft is None and line.startswith(b"data: ") and b'"content": "' in line \
                            and b'"content": ""' not in line:
                        ttft = time.perf_counter() - t0
                    ok = ok or line.startswith(b"data: [DONE]")
                return {"status": 200, "latency": time.perf_counter() - t0, "ttft": ttft, "done": ok}
        except asyncio.TimeoutError:
            return {"status": "hung", "latency": time.perf_counter() - t0}
        except aiohttp.ClientError as e:
            return {"status": "client_error", "latency": time.perf_counter() - t0, "error": repr(e)}

    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=bound_s + 5)) as session:
        t0 = time.perf_counter()
        i = 0
        while (now := time.perf_counter() - t0) < seconds:
            due = i / rate
            if due > now:
                await asyncio.sleep(due - now)
            tasks.append(asyncio.ensure_future(one(session, i)))
            i += 1
        return list(await asyncio.gather(*tasks))


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def run_overload(seconds: float, overload: float = 3.0, slots: int = 8, output_len: int = 16,
                 token_ms: float = 10.0, deadline_ms: int = 1000, shed_p99_ms: float = 5.0,
                 server_shed_p99_ms: float = 5.0) -> Report:
    """overload x the mock engine's capacity (slots / (output_len x token_ms)) for `seconds`.

    Shed latency is checked twice: as the client saw it (send to the whole reply read; p99 <=
    shed_p99_ms) and as the gateway spent it (access log duration_ms; p99 <= server_shed_p99_ms).
    A short run's p99 is its 4th-worst reply, so the fast test gives the client-side figure more
    room for a busy 2-core machine; the full run holds both to 5 ms."""
    import urllib.request

    import redis

    from gateway.api_keys import KeyStore
    report = Report("overload")
    capacity = slots / (output_len * token_ms / 1000)
    prefix = f"tytest:rel:ovl:{secrets.token_hex(4)}:"
    client = redis.Redis.from_url(SHARED_REDIS)
    store = KeyStore(client, prefix)
    keys = [store.create("interactive-tenant", rpm=0, tpm=0, max_concurrent=0)[0],
            store.create("batch-tenant", priority="batch", rpm=0, tpm=0, max_concurrent=0)[0]]
    dev_key = "rel-admin-" + secrets.token_hex(8)
    doc = {"redis_url": SHARED_REDIS, "redis_prefix": prefix,
           "rate_limits": {"requests": 1_000_000, "tokens": 1_000_000_000},
           "admission": {"max_running": slots, "max_queue": 1024, "max_concurrent_per_tenant": 0},
           "engines": {"mock": {"type": "mock", "model": str(MODEL), "token_ms": token_ms, "output_len": output_len,
                                "max_num_seqs": slots, "max_sleep_ms": 2}}}
    # A request is "hung" if it neither finished nor was shed within its deadline + its own service time + 1 s.
    bound_s = deadline_ms / 1000 + output_len * token_ms / 1000 + 1.0
    tmp = Path(tempfile.mkdtemp(prefix="tyrel-ovl-"))
    proc, port = serve_process(doc, dev_key, tmp, access_log=True)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        asyncio.run(_overload_client(url, keys, capacity / 2, 1.5, deadline_ms, bound_s))   # warm-up: service rate
        t0 = time.perf_counter()
        results = asyncio.run(_overload_client(url, keys, capacity * overload, seconds, deadline_ms, bound_s))
        wall = time.perf_counter() - t0
        metrics = ""
        for _ in range(100):   # the engine drains and frees every block
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
            if _metric(metrics, "tokenyard_in_flight_requests ") == 0 and \
                    _metric(metrics, 'tokenyard_engine_kv_usage_ratio{engine="mock"}') == 0:
                break
            time.sleep(0.05)
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())
        # The gateway's own TTFT histogram (arrival to first token, no client delay): share within the deadline.
        le = f"{deadline_ms / 1000:.1f}" if deadline_ms % 100 == 0 else str(deadline_ms / 1000)
        within = sum(_metric(metrics, f'tokenyard_time_to_first_token_seconds_bucket{{engine="mock",le="{le}",'
                                      f'prompt_bucket="{b}"}}') for b in ("0-128",))
        total = _metric(metrics, 'tokenyard_time_to_first_token_seconds_count{engine="mock",prompt_bucket="0-128"}')
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        client.close()
        delete_prefix(SHARED_REDIS, prefix)
    server_shed = []   # the gateway's own time for shed replies (access log duration_ms)
    for line in (tmp / "stderr.log").read_text(errors="replace").splitlines():
        if line.startswith("{") and '"status": 503' in line:
            entry = json.loads(line)
            if entry.get("error_code") in ("engine_overloaded", "queue_full"):
                server_shed.append(entry["duration_ms"])
    ok = [r for r in results if r["status"] == 200]
    shed = [r for r in results if r["status"] in (429, 503)]
    at_once = [r["latency"] * 1000 for r in shed if r["code"] != "deadline_exceeded"]
    expired = [r["latency"] * 1000 for r in shed if r["code"] == "deadline_exceeded"]
    ttft = [r["ttft"] * 1000 for r in ok if r["ttft"] is not None]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    other = {s: c for s, c in statuses.items() if s not in ("200", "503")}
    hung = [r for r in results if r["status"] == "hung" or r["latency"] > bound_s]
    report.figures.update(
        seconds=seconds, capacity_rps=round(capacity, 1), offered_rps=round(capacity * overload, 1),
        requests=len(results), statuses=statuses, served_rps=round(len(ok) / wall, 1), shed=len(shed),
        shed_at_once_p50_ms=round(pct(at_once, 0.5), 2), shed_at_once_p99_ms=round(pct(at_once, 0.99), 2),
        shed_server_p99_ms=round(pct(server_shed, 0.99), 2), shed_server_max_ms=round(max(server_shed, default=0), 2),
        expired_in_queue=len(expired), expired_max_ms=round(max(expired, default=0), 1),
        admitted_ttft_p50_ms=round(pct(ttft, 0.5), 1), admitted_ttft_p99_ms=round(pct(ttft, 0.99), 1),
        deadline_ms=deadline_ms, hung=len(hung),
        gateway_ttft_within_deadline=round(within / total, 4) if total else None,
        kv_usage_after=_metric(metrics, 'tokenyard_engine_kv_usage_ratio{engine="mock"}'))
    report.check(not other, f"statuses other than 200 and the intended 503 sheds: {other}")
    report.check(not hung, f"{len(hung)} requests neither finished nor were shed within {bound_s:.1f} s")
    report.check(all(r["retry_after"] for r in shed), "a shed reply without retry-after / retry-after-ms")
    report.check(len(shed) > len(results) // 3, f"only {len(shed)} of {len(results)} shed at {overload}x capacity")
    report.check(pct(at_once, 0.99) <= shed_p99_ms, f"shed p99 {pct(at_once, 0.99):.2f} ms > {shed_p99_ms} ms")
    report.check(pct(server_shed, 0.99) <= server_shed_p99_ms,
                 f"gateway-side shed p99 {pct(server_shed, 0.99):.2f} ms > {server_shed_p99_ms} ms")
    report.check(len(server_shed) == len(at_once), f"{len(server_shed)} shed access-log lines, {len(at_once)} sheds")
    report.check(pct(ttft, 0.99) <= deadline_ms, f"admitted TTFT p99 {pct(ttft, 0.99):.0f} ms > SLO {deadline_ms} ms")
    share = report.figures["gateway_ttft_within_deadline"]
    report.check(share is not None and share >= 0.99, f"gateway-side TTFT: only {share} of admitted within the deadline")
    report.check(all(r["done"] for r in ok), "an admitted stream ended without [DONE]")
    report.check(len(ok) / wall >= 0.7 * capacity, f"served {len(ok) / wall:.1f} rps of {capacity:.1f} capacity")
    report.check(expired == [] or max(expired) <= deadline_ms + 250, "an expired request was answered late")
    report.check(report.figures["kv_usage_after"] == 0, "KV blocks still in use after the load")
    report.check(health.get("status") == "ok" and health["engines"] == {"mock": "ok"}, f"health: {health}")
    return report


# --- engine failure -------------------------------------------------------------------------------
def _metrics_text(srv) -> str:
    return srv.request("GET", "/metrics")[2].decode()


async def _in_flight_then(port: int, model: str, n_stream: int, n_plain: int, max_tokens: int, trigger,
                          after_events: int = 3) -> list[dict]:
    """Start streams and plain requests, wait until every stream has shown `after_events` events,
    call trigger() (in a thread), then collect what each client got."""
    started = asyncio.Event()
    counts = [0] * n_stream

    async def stream(i: int) -> dict:
        body = {"model": model, "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"fail stream {i}"}]}
        data = json.dumps(body).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                      ).encode() + data)
        status, headers = await _read_head(reader)
        buf = b""
        async for chunk in _body_chunks(reader, headers):
            buf += chunk
            counts[i] = buf.count(b"\n\n")
            if all(c >= after_events for c in counts):
                started.set()
        writer.close()
        events = [json.loads(b[6:]) if b.startswith("data: {") else b[6:]
                  for b in buf.decode().split("\n\n") if b.startswith("data: ")]
        return {"kind": "stream", "status": status, "events": events}

    async def plain(i: int) -> dict:
        r = await chat_raw(port, {"model": model, "max_tokens": max_tokens,
                                  "messages": [{"role": "user", "content": f"fail plain {i}"}]},
                           {"Authorization": f"Bearer {KEY}"})
        return {"kind": "plain", **r}

    tasks = [asyncio.ensure_future(stream(i)) for i in range(n_stream)]
    tasks += [asyncio.ensure_future(plain(i)) for i in range(n_plain)]
    await asyncio.wait_for(started.wait(), 60)
    await asyncio.to_thread(trigger)
    return list(await asyncio.wait_for(asyncio.gather(*tasks), 60))


def _clean_errors(results: list[dict], report: Report) -> int:
    """Every in-flight request ended with a clean error: an SSE error event, or a 500/503 JSON error."""
    clean = 0
    for r in results:
        if r["kind"] == "stream":
            last = r["events"][-1] if r["events"] else None
            ok = (r["status"] == 200 and isinstance(last, dict) and last.get("error", {}).get("code") == "engine_error"
                  and "[DONE]" not in r["events"] and "Traceback" not in json.dumps(last))
        else:
            ok = r["status"] in (500, 503) and set(r.get("error", {})) == {"message", "type", "param", "code"}
        clean += ok
        report.check(ok, f"in-flight request did not end with a clean error: {str(r)[:300]}")
    return clean


def _wait_restarts(srv, engine: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while srv.engine(engine).num_restarts < n or srv.engine(engine).dead:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine {engine} did not restart ({srv.engine(engine).num_restarts} restarts, "
                                 f"dead={srv.engine(engine).dead})")
        time.sleep(0.02)


def run_step_exceptions(rounds: int) -> Report:
    """An exception inside the step loop (mock engine), `rounds` times."""
    report = Report("engine step exception")
    doc = mock_deployment(ttft_ms=2, token_ms=5, output_len=400, max_sleep_ms=2)
    clean = total = 0
    with running_gateway(doc) as srv:
        for k in range(rounds):
            inner = srv.engine().engine

            def boom(inner=inner):
                inner.step = lambda: (_ for _ in ()).throw(RuntimeError("injected step failure"))

            results = asyncio.run(_in_flight_then(srv.port, "mock", 2, 2, 300, boom))
            total += len(results)
            clean += _clean_errors(results, report)
            _wait_restarts(srv, "mock", k + 1, 10)
            report.check(srv.engine().engine is not inner, "the failed engine object is still in use")
            status, _, body = srv.chat({"model": "mock", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
            report.check(status == 200 and body["usage"]["completion_tokens"] == 5, f"after restart: {status} {body}")
        text = _metrics_text(srv)
        report.check(f'tokenyard_engine_restarts_total{{engine="mock"}} {float(rounds)}' in text,
                     "restarts metric does not count every restart")
        report.check(f'tokenyard_engine_failed_steps_total{{engine="mock"}} {float(rounds)}' in text,
                     "failed steps metric does not count every failure")
        report.check('tokenyard_requests_total{engine="mock",route_reason="pinned",status="500"}' in text,
                     "failed requests not counted as 500")
        errors = [r for r in srv.gateway.usage.records if r.status == "error"]
        report.check(len(errors) == total, f"{len(errors)} error usage records for {total} failed requests")
        check_idle(srv, report, "mock")
    report.figures.update(faults=rounds, in_flight_failed_cleanly=f"{clean}/{total}", restarts=rounds)
    return report


def tp_checkpoint(root: Path) -> Path:
    """A tiny random Llama with demo-small's tokenizer (vocabulary and special ids), for tensor parallelism."""
    import shutil

    from bench.random_checkpoint import build_random_checkpoint
    cfg = json.loads((MODEL / "config.json").read_text())
    path = build_random_checkpoint(root / "tp-llama", "llama", vocab_size=cfg["vocab_size"], hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"])
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(MODEL / name, path / name)
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def run_tp_worker_kills(rounds: int, checkpoint: Path) -> Report:
    """A torch engine with tensor_parallel_size=2; kill its worker mid-stream, `rounds` times."""
    report = Report("tensor-parallel worker killed")
    doc = {"server": {"access_log": False},
           "engines": {"tp": {"type": "torch", "model": str(checkpoint), "tensor_parallel_size": 2,
                              "dtype": "float32", "kv_cache_memory": 4 << 20, "max_num_batched_tokens": 64,
                              "tp_timeout_s": 30.0}}}
    clean = total = 0
    restart_s = []
    with running_gateway(doc) as srv:
        for k in range(rounds):
            inner = srv.engine("tp").engine
            worker = inner.runner.group.procs[0]

            def kill(worker=worker):
                os.kill(worker.pid, signal.SIGKILL)

            results = asyncio.run(_in_flight_then(srv.port, "tp", 2, 1, 400, kill, after_events=2))
            t0 = time.monotonic()
            total += len(results)
            clean += _clean_errors(results, report)
            _wait_restarts(srv, "tp", k + 1, 90)
            restart_s.append(time.monotonic() - t0)
            report.check(not worker.is_alive(), "the killed worker is alive")
            status, _, body = srv.chat({"model": "tp", "max_tokens": 6, "temperature": 0,
                                        "messages": [{"role": "user", "content": "after the restart"}]})
            report.check(status == 200 and body["usage"]["completion_tokens"] >= 1, f"after restart: {status} {body}")
        text = _metrics_text(srv)
        report.check(f'tokenyard_engine_restarts_total{{engine="tp"}} {float(rounds)}' in text,
                     "restarts metric does not count every restart")
        report.check(json.loads(srv.request("GET", "/health")[2])["engines"] == {"tp": "ok"}, "health not ok")
        check_idle(srv, report, "tp")
    report.figures.update(faults=rounds, in_flight_failed_cleanly=f"{clean}/{total}", restarts=rounds,
                          restart_s_max=round(max(restart_s), 1))
    return report


# --- Redis outage ---------------------------------------------------------------------------------
def run_redis_outage(outage_s: float, gap_s: float = 0.02) -> Report:
    """A private redis-server stopped for outage_s under traffic, then started again (same data)."""
    import redis

    from gateway.api_keys import KeyStore
    report = Report("redis outage")
    tmp = Path(tempfile.mkdtemp(prefix="tyrel-redis-"))
    private = PrivateRedis(tmp / "redis")
    prefix = "rel:"
    seen: dict[str, dict] = {}
    try:
        client = redis.Redis(port=private.port)
        store = KeyStore(client, prefix)
        acme, _ = store.create("acme", rpm=1_000_000, tpm=1_000_000_000)     # limited, but never reached
        globex, _ = store.create("globex", rpm=1_000_000, tpm=1_000_000_000)
        tight, _ = store.create("tight", rpm=2, tpm=1_000_000)   # 2 requests per minute
        unseen, _ = store.create("acme")                        # valid, never used before the outage

        def doc(mode: str, ttl: float) -> dict:
            engine = mock_deployment(ttft_ms=2, token_ms=2, output_len=10, max_sleep_ms=2)
            engine["engines"]["mock"]["prices"] = {"input": 123_457, "cached_input": 61_729, "output": 987_653}
            return {**engine,
                    "redis_url": private.url, "redis_prefix": prefix, "redis_timeout_ms": 200,
                    "auth": {"key_cache_ttl_s": ttl},
                    "rate_limits": {"on_redis_error": mode, "redis_retry_s": 0.2},
                    "spend": {"spool_dir": str(tmp / f"spool-{mode}"), "replay_interval_s": 0.2}}

        with running_gateway(doc("open", 0.5)) as fopen, running_gateway(doc("closed", 0.5)) as fclosed:
            counter = [0]

            def chat(srv, key: str, tag: str) -> tuple[int, dict, dict]:
                counter[0] += 1
                rid = f"{tag}-{counter[0]}"
                status, headers, body = srv.chat({"model": "mock", "max_tokens": 6,
                                                  "messages": [{"role": "user", "content": f"outage {rid}"}]},
                                                 {"Authorization": f"Bearer {key}", "x-request-id": rid})
                if status == 200:
                    seen[rid] = {"usage": body["usage"]}
                return status, headers, body

            for srv in (fopen, fclosed):
                for key in (acme, globex):
                    status, headers, _ = chat(srv, key, "before")
                    report.check(status == 200 and "x-ratelimit-remaining-tokens" in headers, "before the outage")
            report.check([chat(fopen, tight, "tight")[0] for _ in range(3)] == [200, 200, 429],
                         "the tight key is not limited before the outage")
            private.stop()
            t_stop = time.monotonic()
            during = {"open_ok": 0, "open_other": 0, "closed_503": 0, "closed_other": 0, "unknown_key_503": 0,
                      "bad_key_refused": 0, "tight_open_ok": 0}
            latencies = []
            rounds = 0
            while time.monotonic() - t_stop < outage_s:
                rounds += 1
                t0 = time.perf_counter()
                status, headers, body = chat(fopen, acme if rounds % 2 else globex, "open")
                latencies.append(time.perf_counter() - t0)
                during["open_ok" if status == 200 and "x-ratelimit-remaining-tokens" not in headers
                       else "open_other"] += 1
                status, headers, body = chat(fclosed, acme, "closed")
                closed_ok = status == 503 and body["error"]["code"] == "rate_limiter_unavailable" and \
                    int(headers.get("retry-after-ms", 0)) > 0
                during["closed_503" if closed_ok else "closed_other"] += 1
                if rounds % 10 == 1:
                    s1 = chat(fopen, unseen, "unseen")[2]
                    during["unknown_key_503"] += s1.get("error", {}).get("code") == "auth_unavailable"
                    during["bad_key_refused"] += chat(fclosed, "ty-not-a-key", "bad")[0] in (401, 503)
                    during["tight_open_ok"] += chat(fopen, tight, "tight")[0] == 200
                time.sleep(gap_s)
            report.check(during["open_other"] == 0, f"fail-open gateway refused cached keys: {during}")
            report.check(during["closed_other"] == 0, f"fail-closed gateway did not answer 503: {during}")
            report.check(during["unknown_key_503"] >= 1 and during["bad_key_refused"] >= 1, f"auth: {during}")
            report.check(during["tight_open_ok"] >= 1, "fail-open gateway still limits without Redis")
            private = private.restart()
            client.close()
            client = redis.Redis(port=private.port)
            t_back = time.monotonic()
            for srv in (fopen, fclosed):
                deadline = time.monotonic() + 30
                while True:   # limits come back once the guard retries Redis
                    status, headers, _ = chat(srv, acme, "after")
                    if status == 200 and "x-ratelimit-remaining-tokens" in headers:
                        break
                    report.check(status in (200, 503), f"after the outage: {status}")
                    if time.monotonic() > deadline:
                        report.problems.append("limits did not come back after Redis returned")
                        break
                    time.sleep(0.1)
            recovery_s = time.monotonic() - t_back
            # Limits apply again: 3 requests of a 2-per-minute key cannot all pass (GCRA has refilled
            # part of its bucket during a long outage, so not necessarily the very first one is refused).
            after = [chat(fopen, tight, "tight")[0] for _ in range(3)]
            report.check(429 in after and set(after) <= {200, 429}, f"the tight key is not limited after the outage: {after}")
            status, _, _ = chat(fopen, unseen, "unseen-after")
            report.check(status == 200, f"a valid key unknown to the cache is refused after the outage: {status}")
            for srv in (fopen, fclosed):
                wait_ledger(srv, timeout=60)
            spooled = sum(_metric(s.request("GET", "/metrics")[2].decode(), "tokenyard_spend_records_total"
                                  '{outcome="spooled"}') for s in (fopen, fclosed))
            reached = list(seen)   # every 200 reached the engine; refusals never do
            check_ledger(client, prefix, ["acme", "globex", "tight"], reached, seen, report)
            report.figures.update(outage_s=outage_s, requests_during_outage=sum(during.values()),
                                  served_from_key_cache=during["open_ok"], closed_503=during["closed_503"],
                                  unknown_key_503=during["unknown_key_503"], records_spooled=int(spooled),
                                  open_p99_ms=round(pct(latencies, 0.99) * 1000, 1),
                                  limits_back_after_s=round(recovery_s, 2))
        client.close()
    finally:
        private.stop()
    return report


def full_run_selected(config) -> bool:
    """The full-size tests run only when asked for by marker (`pytest -m reliability`)."""
    expr = config.getoption("markexpr") or ""
    return "reliability" in expr and "not reliability" not in expr


def explain(report: Report) -> str:
    return f"{report.name}: {report.problems}\nfigures: {json.dumps(report.figures, default=str)}"


# --- fuzzing ----------------------------------------------------------------------------------------
def _signed_in_cookie(srv) -> str:
    """A dashboard session signed in with the admin key (so signed-in pages are fuzzed too)."""
    import re
    from urllib.parse import urlencode

    from gateway.sessions import COOKIE
    status, headers, body = srv.request("GET", "/dashboard/login", headers={"Authorization": ""})
    sid = re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)
    token = re.search(rb'name="csrf_token" value="([^"]+)"', body).group(1).decode()
    status, headers, _ = srv.request("POST", "/dashboard/login", urlencode({"api_key": KEY, "csrf_token": token}),
                                     headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}",
                                              "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 303, status
    return re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)


def openai_error_shape(body: Any) -> bool:
    # The four OpenAI fields with their types; an extra detail field (the policy endpoints'
    # "problems" list) is allowed, as OpenAI clients ignore unknown keys.
    return (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
            and {"message", "type", "param", "code"} <= set(body["error"])
            and isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str)
            and (body["error"]["param"] is None or isinstance(body["error"]["param"], str))
            and (body["error"]["code"] is None or isinstance(body["error"]["code"], str)))


def run_fuzz(examples_per_mode: int, seed: int = 0) -> Report:
    """schemathesis cases from the live /openapi.json: every operation, positive and negative
    generation, chat requests also with a real model name, dashboard pages also signed in."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    from gateway.sessions import COOKIE
    report = Report("fuzz /openapi.json")
    prefix = f"tytest:rel:fuzz:{secrets.token_hex(4)}:"
    doc = {**mock_deployment(output_len=6, max_sleep_ms=2), "redis_url": SHARED_REDIS, "redis_prefix": prefix,
           "rate_limits": {"requests": 10_000_000, "tokens": 1_000_000_000},
           "admission": {"max_concurrent_per_tenant": 0}}
    cases = 0
    by_status: dict[int, int] = {}
    failures: list[str] = []
    t0 = time.perf_counter()
    try:
        with running_gateway(doc) as srv, ErrorLogs() as errors:
            spec = requests.get(srv.base_url + "/openapi.json", timeout=10).json()
            schema = schemathesis.openapi.from_dict(spec)
            session = requests.Session()
            signed_in = {COOKIE: _signed_in_cookie(srv)}
            operations = [r.ok() for r in schema.get_all_operations()]
            report.figures["operations"] = len(operations)

            def check(case, resp) -> None:
                nonlocal cases
                cases += 1
                by_status[resp.status_code] = by_status.get(resp.status_code, 0) + 1
                where = f"{case.method} {case.path} -> {resp.status_code}"
                deadline = (case.headers or {}).get("x-request-deadline-ms")
                if resp.status_code == 503 and deadline is not None:
                    # The case asked for a deadline (down to 1 ms) and missed it: the documented shed.
                    body = resp.json()
                    hdrs = {k.lower() for k in resp.headers}
                    if not (openai_error_shape(body) and body["error"]["code"] in ("deadline_exceeded",
                                                                                  "engine_overloaded")
                            and "retry-after" in hdrs):
                        failures.append(f"{where}: {resp.text[:200]}")
                elif resp.status_code >= 500:
                    failures.append(f"{where}: {resp.text[:200]} (body {str(case.body)[:200]})")
                elif resp.status_code >= 400:
                    ctype = {k.lower(): v for k, v in resp.headers.items()}.get("content-type", "")
                    ctype = ctype[0] if isinstance(ctype, list) else ctype
                    if case.path == "/dashboard/login" and resp.status_code == 401 and ctype.startswith("text/html"):
                        return   # documented: a refused sign-in shows the form again
                    try:
                        body = resp.json()
                    except ValueError:
                        body = None
                    if not ctype.startswith("application/json") or not openai_error_shape(body):
                        failures.append(f"{where}: not OpenAI-shaped ({ctype}): {resp.text[:200]}")

            for op in operations:
                variants: list[tuple[str, dict]] = [("", {})]
                if op.path.startswith("/dashboard") and op.path not in ("/dashboard/login", "/dashboard/logout"):
                    variants.append(("signed-in", signed_in))
                for label, cookies in variants:
                    for mode in GenerationMode:
                        strategy = op.as_strategy(generation_mode=mode)
                        if op.path == "/v1/chat/completions" and mode.is_positive:
                            def real_model(pair):   # half the cases name the real engine: reach the engine
                                case, use = pair
                                if use and isinstance(case.body, dict):
                                    case.body["model"] = "mock"
                                return case
                            strategy = st.tuples(strategy, st.booleans()).map(real_model)

                        @hseed(seed)
                        @settings(max_examples=examples_per_mode, deadline=None, database=None,
                                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
                        @given(case=strategy)
                        def run(case):
                            resp = case.call(base_url=srv.base_url, session=session,
                                             headers={"Authorization": f"Bearer {KEY}"}, cookies=cookies, timeout=30)
                            check(case, resp)

                        try:
                            run()
                        except Unsatisfiable:
                            pass    # an operation without parameters has no invalid (negative) cases
            report.figures["error_logs"] = len(errors.records)
            report.check(not errors.records, f"errors logged while fuzzing: {sorted(set(errors.records))[:3]}")
            check_idle(srv, report, "mock")
    finally:
        delete_prefix(SHARED_REDIS, prefix)
    report.figures.update(cases=cases, seconds=round(time.perf_counter() - t0, 1),
                          statuses=dict(sorted(by_status.items())), failures=len(failures))
    report.check(not failures, f"{len(failures)} bad responses, e.g. {failures[:5]}")
    return report
