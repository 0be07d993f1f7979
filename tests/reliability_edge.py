"""The edge scenarios: an unauthenticated flood next to real tenants (1,000 concurrent clients), and
thousands of slow-header connections next to a normal client. Both run against `tokenyard serve` in
a process of its own (reliability_common.serve_process), on loopback only.

unauthenticated flood (run_unauth_flood):
    phase 1, flood: `flooders` clients send made-up keys (half not even key-shaped, half
    well-formed random "ty-" keys) as fast as they can; meanwhile a cached tenant limited to 5
    requests per minute is hammered, and 20 valid keys are used for the first time.
    phase 2, crowd: `clients` concurrent clients: half on one tenant limited to 10 requests per
    minute, half on 50 keys (all used for the first time at once) of an unlimited tenant.
    Promises: a limited tenant never gets more than burst + rate x t; nobody ever gets
    auth_unavailable (Redis is healthy: busy is not down); every refusal other than 401 is a
    429/503 with Retry-After; the first-time keys get in; no Redis error is counted (no fake
    outage), limits never fail open; malformed keys cost no Redis read.

slow connections (run_slow_connections):
    a separate attacker process opens `total` connections (at most `held` at once), each sending a
    partial request line and headers and then nothing; a normal client probes /health and a chat
    completion throughout. Promises: every probe succeeds within its usual latency; the gateway's
    open file descriptors stay bounded by server.max_connections; its stderr stays small; every
    attacking connection is closed by the gateway (408 or evicted), none is left hanging.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway_helpers import KEY, ROOT, SHARED_REDIS, delete_prefix, unique_prefix
from reliability_common import Report, pct, serve_process, stop_process

from tokenyard.gateway.server.connection_guard import BACKLOG, FD_RESERVE

MOCK = {"type": "mock", "model": str(ROOT / "models" / "demo-small"), "ttft_ms": 0, "token_ms": 0, "output_len": 4}
BODY = json.dumps({"model": "mock", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})


def _metrics_sum(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not label or label in line) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _limit_bound(per_minute: int, seconds: float) -> int:
    """GCRA with a burst of one window: at most burst + rate x t over t seconds (+1 for the edge)."""
    return per_minute + int(per_minute * seconds / 60.0) + 1


# --- unauthenticated flood and 1,000 concurrent clients -------------------------------------------
def run_unauth_flood(seconds: float, flooders: int = 400, clients: int = 1000, pool_size: int = 16) -> Report:
    import aiohttp
    import redis

    from tokenyard.gateway.auth.api_keys import KeyStore
    report = Report("unauthenticated flood")
    prefix = unique_prefix("flood")
    client = redis.Redis.from_url(SHARED_REDIS)
    store = KeyStore(client, prefix)
    tight, _ = store.create("tight", rpm=5, tpm=0)
    limited, _ = store.create("limited", rpm=10, tpm=0)
    fresh = [store.create("fresh", rpm=0, tpm=0)[0] for _ in range(20)]
    crowd = [store.create("crowd", rpm=0, tpm=0)[0] for _ in range(50)]
    doc = {"redis_url": SHARED_REDIS, "redis_prefix": prefix, "redis_pool_size": pool_size,
           "admission": {"max_queue": 4096, "max_concurrent_per_tenant": 0},
           "engines": {"mock": dict(MOCK)}}
    tmp = Path(tempfile.mkdtemp(prefix="tyrel-flood-"))
    proc, port = serve_process(doc, KEY, tmp, stderr_file=True)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    statuses: dict[str, dict[str, int]] = {}
    problems: list[str] = []

    def tally(group: str, status: int, headers, body: dict | None) -> None:
        code = ((body or {}).get("error") or {}).get("code") if isinstance(body, dict) else None
        label = f"{status}" + (f" {code}" if code else "")
        statuses.setdefault(group, {}).setdefault(label, 0)
        statuses[group][label] += 1
        if code == "auth_unavailable":
            problems.append(f"{group}: auth_unavailable")
        if status not in (200, 401) and not (status in (429, 503) and "retry-after" in headers):
            problems.append(f"{group}: {label} without Retry-After" if status in (429, 503) else f"{group}: {label}")

    async def post(session, key: str, group: str) -> tuple[int, dict]:
        async with session.post(url, data=BODY, headers={"Authorization": f"Bearer {key}",
                                                         "Content-Type": "application/json"}) as r:
            body = await r.json(content_type=None)
            tally(group, r.status, r.headers, body)
            return r.status, r.headers

    def made_up(i: int) -> str:
        if i % 2:
            return "sk-" + "".join(random.choices(string.ascii_letters, k=20))   # not key-shaped
        return "ty-" + secrets.token_urlsafe(32)                                 # key-shaped, unknown

    async def hammer(session, key: str, group: str, until: float, successes: list[float]) -> None:
        while time.monotonic() < until:
            status, _ = await post(session, key, group)
            if status == 200:
                successes.append(time.monotonic())

    async def flood(session, until: float, sent: list[int]) -> None:
        i = 0
        while time.monotonic() < until:
            i += 1
            sent[i % 2] += 1
            await post(session, made_up(i), "flood")

    async def first_use(session, key: str, until: float, out: list[int]) -> None:
        while True:     # a shed request comes back after its Retry-After, as an SDK does
            status, headers = await post(session, key, "fresh")
            if status != 503 or time.monotonic() > until:
                out.append(status)
                return
            await asyncio.sleep(float(headers.get("retry-after-ms", 1000)) / 1000)

    async def main() -> dict:
        timeout = aiohttp.ClientTimeout(total=60)
        conn = aiohttp.TCPConnector(limit=max(flooders, clients) + 64)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            t_start = time.monotonic()
            tight_ok: list[float] = []
            status, _ = await post(session, tight, "tight")          # now cached in the gateway
            if status == 200:
                tight_ok.append(time.monotonic())
            until = time.monotonic() + seconds
            sent = [0, 0]
            fresh_final: list[int] = []
            tasks = [asyncio.create_task(flood(session, until, sent)) for _ in range(flooders)]
            tasks += [asyncio.create_task(hammer(session, tight, "tight", until, tight_ok)) for _ in range(20)]
            await asyncio.sleep(min(0.5, seconds / 4))
            tasks += [asyncio.create_task(first_use(session, k, until + 10, fresh_final)) for k in fresh]
            await asyncio.gather(*tasks)
            t_flood = time.monotonic() - t_start
            # phase 2: the crowd
            limited_ok: list[float] = []
            t2 = time.monotonic()
            until = t2 + seconds
            tasks = [asyncio.create_task(hammer(session, limited, "limited", until, limited_ok))
                     for _ in range(clients // 2)]
            tasks += [asyncio.create_task(hammer(session, crowd[i % len(crowd)], "crowd", until, []))
                      for i in range(clients - clients // 2)]
            await asyncio.gather(*tasks)
            t_crowd = time.monotonic() - t2
            async with session.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {KEY}"}) as r:
                metrics = await r.text()
        return {"t_flood": t_flood, "t_crowd": t_crowd, "tight_ok": len(tight_ok), "limited_ok": len(limited_ok),
                "fresh_final": fresh_final, "sent": sent, "metrics": metrics}

    try:
        out = asyncio.run(main())
    finally:
        stop_process(proc)
        delete_prefix(SHARED_REDIS, prefix)
        client.close()
    m = out["metrics"]
    f = report.figures
    f.update(flooders=flooders, clients=clients, seconds=seconds, redis_pool_size=pool_size,
             flood_requests=sum(statuses.get("flood", {}).values()),
             flood_malformed=out["sent"][1], flood_key_shaped=out["sent"][0],
             tight_successes=out["tight_ok"], tight_bound=_limit_bound(5, out["t_flood"]),
             limited_successes=out["limited_ok"], limited_bound=_limit_bound(10, out["t_crowd"]),
             fresh_keys_in=sum(s == 200 for s in out["fresh_final"]), fresh_keys=len(fresh),
             crowd_requests=sum(statuses.get("crowd", {}).values()),
             crowd_ok=statuses.get("crowd", {}).get("200", 0),
             redis_key_reads=int(_metrics_sum(m, "tokenyard_redis_latency_seconds_count", 'op="key_lookup"')),
             redis_errors=int(_metrics_sum(m, "tokenyard_redis_errors_total")),
             rate_limit_fail_open=int(_metrics_sum(m, "tokenyard_rate_limit_redis_fallbacks_total")),
             redis_busy=int(_metrics_sum(m, "tokenyard_redis_busy_total")),
             statuses=statuses)
    report.check(not problems, f"{len(problems)} bad answers, e.g. {sorted(set(problems))[:5]}")
    report.check(f["tight_successes"] <= f["tight_bound"],
                 f"tenant limited to 5/min got {f['tight_successes']} > {f['tight_bound']} in {out['t_flood']:.1f} s")
    report.check(f["limited_successes"] <= f["limited_bound"],
                 f"tenant limited to 10/min got {f['limited_successes']} > {f['limited_bound']}")
    report.check(f["fresh_keys_in"] == len(fresh), f"first-time keys refused: {out['fresh_final']}")
    report.check(f["redis_errors"] == 0 and f["rate_limit_fail_open"] == 0,
                 f"a busy gateway was taken for a Redis outage: {f['redis_errors']} errors, "
                 f"{f['rate_limit_fail_open']} fail-open")
    # Malformed keys never reach Redis: reads <= key-shaped made-up keys + the real keys.
    reads_allowed = f["flood_key_shaped"] + len(fresh) + len(crowd) + 3
    report.check(f["redis_key_reads"] <= reads_allowed,
                 f"{f['redis_key_reads']} key reads for {reads_allowed} key-shaped keys: malformed keys reach Redis")
    report.check(f["crowd_ok"] > 0, "the crowd tenant was never served")
    report.check(f["flood_requests"] > 0 and statuses.get("flood", {}).get("200", 0) == 0, "the flood got in")
    return report


# --- slow connections -------------------------------------------------------------------------------
SLOW_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAuthoriz"


async def _attack(port: int, total: int, held: int, max_s: float) -> dict:
    stats = {"opened": 0, "answered_408": 0, "closed_by_gateway": 0, "reset": 0, "connect_errors": 0,
             "still_open_at_end": 0}
    places = asyncio.Semaphore(held)
    end = time.monotonic() + max_s

    async def one() -> None:
        try:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                stats["connect_errors"] += 1
                return
            stats["opened"] += 1
            try:
                writer.write(SLOW_HEAD)
                data = await asyncio.wait_for(reader.read(), max(0.1, end - time.monotonic()))
                stats["closed_by_gateway"] += 1
                stats["answered_408"] += data.startswith(b"HTTP/1.1 408")
            except (TimeoutError, asyncio.TimeoutError):
                stats["still_open_at_end"] += 1
            except OSError:
                stats["reset"] += 1
            finally:
                writer.close()
        finally:
            places.release()

    tasks = []
    for _ in range(total):
        await places.acquire()
        if time.monotonic() > end:
            places.release()
            break
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return stats


def _open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def run_slow_connections(total: int, held: int, max_connections: int = 1024, header_timeout_s: float = 2.0,
                         fd_limit: int | None = 4096, attack_s: float = 60.0) -> Report:
    import http.client
    report = Report("slow connections")
    tmp = Path(tempfile.mkdtemp(prefix="tyrel-slow-"))
    doc = {"engines": {"mock": dict(MOCK)}, "redis_url": None,
           "server": {"max_connections": max_connections, "header_timeout_s": header_timeout_s}}
    proc, port = serve_process(doc, KEY, tmp, access_log=False, stderr_file=True, fd_limit=fd_limit)

    def probe(path: str) -> tuple[int, float]:
        t0 = time.perf_counter()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            if path == "chat":
                conn.request("POST", "/v1/chat/completions", body=BODY,
                             headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
            else:
                conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            conn.close()
            return resp.status, time.perf_counter() - t0
        except OSError as e:
            failures.append(f"{path}: {type(e).__name__}: {e} after {time.perf_counter() - t0:.3f} s")
            return 0, time.perf_counter() - t0

    failures: list[str] = []
    try:
        before = [probe("health" if i % 2 else "chat") for i in range(40)]
        attacker = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "attack", str(port), str(total),
                                     str(held), str(attack_s)], stdout=subprocess.PIPE, cwd=ROOT,
                                    env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
        during: list[tuple[int, float]] = []
        fds: list[int] = []
        i = 0
        while attacker.poll() is None:
            i += 1
            during.append(probe("health" if i % 2 else "chat"))
            fds.append(_open_fds(proc.pid))
            time.sleep(0.05)
        attack = json.loads(attacker.stdout.read() or b"{}")
        after = [probe("chat") for _ in range(5)]
    finally:
        stop_process(proc)
    stderr_bytes = (tmp / "stderr.log").stat().st_size
    base_p99 = pct([t for _, t in before], 0.99)
    f = report.figures
    f.update(total=total, held_at_once=held, max_connections=max_connections, header_timeout_s=header_timeout_s,
             gateway_fd_limit=fd_limit, attack=attack, probes=len(during),
             probes_failed=sum(s != 200 for s, _ in during),
             probe_p50_ms_before=round(pct([t for _, t in before], 0.5) * 1000, 1),
             probe_p99_ms_before=round(base_p99 * 1000, 1),
             probe_p50_ms_during=round(pct([t for _, t in during], 0.5) * 1000, 1),
             probe_p99_ms_during=round(pct([t for _, t in during], 0.99) * 1000, 1),
             probe_max_ms_during=round(max((t for _, t in during), default=0) * 1000, 1),
             gateway_fds_max=max(fds, default=-1), gateway_stderr_bytes=stderr_bytes,
             probe_errors=failures[:5] + [f"a probe answered {s}" for s, _ in during if s not in (0, 200)][:5])
    report.check(attack.get("opened", 0) >= min(total, held), f"the attacker could not open its sockets: {attack}")
    report.check(f["probes_failed"] == 0 and all(s == 200 for s, _ in after),
                 f"{f['probes_failed']} of {len(during)} probes failed during the attack")
    # "Usual latency": the median stays within 5x the quiet one (or 20 ms). The p99 stays within 10x
    # the quiet one or under 1 s, the first SYN retransmit: a probe under it was never dropped from a
    # full accept queue. Less than that is not a bound here: the attacker, the gateway and the probe
    # share two cores, and a probe queued behind an accept burst of ~2,000 sockets waited 200-450 ms
    # on one VM and 580 ms on CI. Before the guard the probes failed outright once the gateway ran
    # out of file descriptors.
    report.check(f["probe_p50_ms_during"] <= max(5 * f["probe_p50_ms_before"], 20)
                 and f["probe_p99_ms_during"] <= max(10 * f["probe_p99_ms_before"], 1000),
                 f"probe p50/p99 {f['probe_p50_ms_during']}/{f['probe_p99_ms_during']} ms during vs "
                 f"{f['probe_p50_ms_before']}/{f['probe_p99_ms_before']} ms before")
    # Bounded by the cap plus one accept burst plus the reserve, and never the whole fd limit.
    bound = max_connections + BACKLOG + FD_RESERVE
    report.check(0 < f["gateway_fds_max"] <= bound and (fd_limit is None or f["gateway_fds_max"] < fd_limit),
                 f"gateway held {f['gateway_fds_max']} fds (max_connections {max_connections}, limit {fd_limit})")
    report.check(attack.get("still_open_at_end", 1) == 0, f"connections left hanging: {attack}")
    report.check(stderr_bytes < 64 << 10, f"gateway wrote {stderr_bytes} bytes to stderr")
    return report


if __name__ == "__main__":
    if sys.argv[1] == "attack":
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        port, total, held, max_s = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
        print(json.dumps(asyncio.run(_attack(port, total, held, max_s))))
