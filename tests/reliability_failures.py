"""The engine-failure scenarios: an exception in the step loop, a killed tensor-parallel worker;
in-flight requests end with clean errors and the engine restarts."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

from gateway_helpers import KEY, mock_deployment, running_gateway
from reliability_common import MODEL, Report, check_idle
from reliability_http import _body_chunks, _read_head, chat_raw


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

    from tokenyard.bench.random_checkpoint import build_random_checkpoint
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
