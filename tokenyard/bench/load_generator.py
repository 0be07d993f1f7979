"""An HTTP load generator for OpenAI-compatible chat servers (the gateway or the baseline).

Every request is a streaming `POST /v1/chat/completions` with `stream_options.include_usage`,
so the client sees each text chunk when the server sends it (TTFT and ITL) and the server's
token counts at the end (output tokens for TPOT, cached prompt tokens for prefix reuse).

Arrivals, like vLLM's benchmark_serving:
- `request_rate` = inf: every request is sent at once (then only `max_concurrency` paces them);
- otherwise inter-arrival gaps are gamma distributed with shape `burstiness` and mean
  1 / request_rate. burstiness 1 is a Poisson process; below 1 is burstier, above 1 smoother.
- `max_concurrency` caps requests in flight (a closed loop when the rate is inf).
- `duration_s` holds the load: arrivals keep coming at the rate for that long (the dataset is
  cycled if it runs out) instead of stopping after a fixed number of requests. A short burst
  mostly measures how fast a queue drains; a held load shows whether the server keeps up.
  `drain_s` bounds the wait after the last arrival: requests still running then are cancelled
  (the server sees a disconnect) and recorded as unfinished, so an overloaded rate cannot stall
  the benchmark for the length of its backlog.
The schedule is seeded, so every server sees the same arrival times and the same requests.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import aiohttp
import numpy as np

from tokenyard.bench.serving_metrics import RequestRecord


@dataclass(slots=True)
class ChatRequest:
    """One request of a dataset. `check` is kept client-side (e.g. a task item's answer)."""

    messages: list[dict[str, str]]
    max_tokens: int
    tag: str = ""                                  # label carried into the record
    model: str | None = None                       # None: the LoadConfig's model
    api_key: str | None = None                     # None: the LoadConfig's key (priority classes use another)
    check: Any = None                              # anything with .check(text) -> bool, or None


@dataclass(slots=True)
class LoadConfig:
    base_url: str                                  # e.g. http://127.0.0.1:8000 (with or without /v1)
    api_key: str | None = None
    model: str = "auto"
    request_rate: float = math.inf                 # requests per second; inf: all at once
    burstiness: float = 1.0                        # gamma shape; 1.0 = Poisson
    max_concurrency: int | None = None             # requests in flight at most (None: unbounded)
    temperature: float = 0.0
    seed: int = 0                                  # arrival schedule seed
    timeout_s: float = 600.0                       # one request's total time limit
    headers: dict[str, str] = field(default_factory=dict)
    progress: bool = True                          # tqdm progress bar
    duration_s: float | None = None                # hold arrivals this long (None: one per request)
    drain_s: float | None = None                   # cancel what still runs this long after the last arrival

    @property
    def chat_url(self) -> str:
        base = self.base_url.rstrip("/")
        return (base if base.endswith("/v1") else base + "/v1") + "/chat/completions"


@dataclass(slots=True)
class LoadResult:
    records: list[RequestRecord]
    duration_s: float                              # first send to last completion


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of n requests: cumulative gamma gaps with mean
    1/rate and shape `burstiness`; all zero for an infinite rate. The first request goes at 0."""
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate} and {burstiness}")
    rng = np.random.default_rng(seed)
    # Gamma(shape=k, scale=1/(rate*k)) has mean 1/rate for every k; the coefficient of
    # variation is 1/sqrt(k), which is what "burstiness" turns.
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def held_offsets(request_rate: float, duration_s: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times of a load held for `duration_s`: the same gamma gaps as `arrival_offsets`,
    every arrival before `duration_s` (the first at 0)."""
    if math.isinf(request_rate) or request_rate <= 0 or duration_s <= 0:
        raise ValueError(f"a held load needs a finite rate > 0 and a duration > 0, got {request_rate}, {duration_s}")
    n = max(16, int(request_rate * duration_s * 1.5) + 16)
    while True:
        offsets = arrival_offsets(n, request_rate, burstiness, seed)
        if offsets[-1] >= duration_s:
            return [t for t in offsets if t < duration_s]
        n *= 2


UNFINISHED = "unfinished at the drain deadline"


def _body(req: ChatRequest, cfg: LoadConfig) -> dict[str, Any]:
    return {"model": req.model or cfg.model, "messages": req.messages, "max_tokens": req.max_tokens,
            "temperature": cfg.temperature, "stream": True, "stream_options": {"include_usage": True}}


# An idle pooled connection is dropped by the client before the gateway closes it (server.keep_alive_s,
# 5 s by default): with aiohttp's 15 s a request could be sent on a connection the server was closing
# at that moment and fail with "connection reset by peer" (1 of 293 requests in a fleet validation run).
CLIENT_KEEPALIVE_S = 3.0


def client_connector() -> aiohttp.TCPConnector:
    """The benchmarks' connection pool: no cap of aiohttp's own (concurrency is what a benchmark
    controls), idle connections kept for less than the gateway keeps them."""
    return aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)


async def send_chat(session: aiohttp.ClientSession, req: ChatRequest, cfg: LoadConfig, t0: float) -> RequestRecord:
    """Send one streaming request and time its chunks; never raises (failures become records)."""
    rec = RequestRecord(tag=req.tag)
    key = req.api_key or cfg.api_key
    headers = {"Content-Type": "application/json", **cfg.headers}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    start = time.perf_counter()
    rec.start = start - t0
    last: float | None = None
    parts: list[str] = []
    try:
        async with session.post(cfg.chat_url, json=_body(req, cfg), headers=headers) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = _error_text(await resp.text())
                return rec
            buffer = b""
            async for raw in resp.content.iter_any():
                now = time.perf_counter()
                buffer += raw
                # SSE events end with a blank line; a network read may hold several or half of one.
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    data = _sse_data(event)
                    if data is None:
                        continue
                    if data == "[DONE]":
                        rec.ok = rec.error == ""
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        rec.error = _error_text(json.dumps(chunk))
                        continue
                    rec.model = chunk.get("model", rec.model)
                    if chunk.get("usage"):
                        _read_usage(rec, chunk["usage"])
                    for choice in chunk.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            if last is None:
                                rec.ttft = now - start
                            else:
                                rec.itls.append(now - last)
                            last = now
                            parts.append(text)
        rec.e2e = time.perf_counter() - start
        if not rec.ok and not rec.error:
            rec.error = "stream ended without [DONE]"
    except asyncio.TimeoutError:
        rec.error = f"timeout after {cfg.timeout_s:g} s"
    except (aiohttp.ClientError, json.JSONDecodeError, ConnectionError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.text = "".join(parts)
    if rec.ok and rec.ttft is None:
        # No text at all (e.g. an immediate EOS): the response's end is its first token.
        rec.ttft = rec.e2e
    return rec


def _sse_data(event: bytes) -> str | None:
    lines = [ln[5:].lstrip() for ln in event.decode("utf-8").splitlines() if ln.startswith("data:")]
    return "\n".join(lines) if lines else None


def _read_usage(rec: RequestRecord, usage: dict[str, Any]) -> None:
    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    rec.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = int(details.get("cached_tokens") or 0)


def _error_text(body: str) -> str:
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("code") or err.get("type") or "") + ": " + str(err.get("message", ""))[:200]
    except (json.JSONDecodeError, AttributeError):
        return body[:200]


async def run_load_async(requests: Sequence[ChatRequest], cfg: LoadConfig) -> LoadResult:
    if cfg.duration_s is not None:
        offsets = held_offsets(cfg.request_rate, cfg.duration_s, cfg.burstiness, cfg.seed)
        requests = [requests[i % len(requests)] for i in range(len(offsets))]
    else:
        offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = None
    if cfg.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc=f"rate {cfg.request_rate:g}/s", unit="req", leave=False)
    connector = client_connector()
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    records: list[RequestRecord] = [RequestRecord() for _ in requests]

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(i: int, req: ChatRequest) -> None:
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                records[i] = await send_chat(session, req, cfg, t0)
            else:
                async with limit:
                    records[i] = await send_chat(session, req, cfg, t0)
            if bar is not None:
                bar.update(1)

        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(requests)]
        deadline = None if cfg.drain_s is None else (offsets[-1] if offsets else 0.0) + cfg.drain_s
        _, pending = await asyncio.wait(tasks, timeout=deadline)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            for i, task in enumerate(tasks):
                if task in pending:
                    records[i] = RequestRecord(tag=requests[i].tag, start=offsets[i], error=UNFINISHED)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return LoadResult(records, duration)


def run_load(requests: Sequence[ChatRequest], cfg: LoadConfig) -> LoadResult:
    """Run one load to completion (its own event loop)."""
    return asyncio.run(run_load_async(requests, cfg))
