"""One request on an upstream engine (type: openai): attempts on its deployments, the reply or the
stream read back, and the usage record.

    call = UpstreamCall(...)
    await call.open()          # tries deployments until one answers (non-streamed: the whole reply;
                               # streamed: the response head and its first event), or raises
                               # UpstreamFailure with the last attempt's failure
    call.document              # non-streamed: the upstream's JSON reply
    async for event in call.events(): ...   # streamed: the events, the first included
    call.finish(http_status)   # exactly once: metrics, the usage record, the limits settled

Before anything reaches the client an attempt that fails for a reason another deployment may not
share (connection refused or reset, timeout, 5xx, 429, a malformed or cut reply) is retried on
another deployment after a jittered pause, at most `max_attempts` in all; the failed deployment
cools down (tokenyard/gateway/backends/upstream_engine.py). After the first event of a stream has
been read there is no retry: a failure ends the stream with an error event, so no request is
answered twice. Each attempt is listed in the access log ("attempts") and counted in metrics.

Spend comes from the usage the upstream reports; when it reports none, the counts are the
gateway's estimate (the prompt as counted before the call, the completion from its text) and the
record says `usage_estimated`.
"""
from __future__ import annotations

import asyncio
import email.utils
import json
import math
import random
import time
from typing import Any, AsyncIterator, Callable

import aiohttp

from tokenyard.gateway.backends.estimate_tokenizer import estimate_tokens
from tokenyard.gateway.backends.upstream_engine import Deployment, UpstreamEngine
from tokenyard.gateway.edge.errors import APIError, BadGateway, BadRequest, GatewayTimeout, RateLimited, Unavailable
from tokenyard.gateway.observability.metrics import GatewayMetrics, prompt_bucket
from tokenyard.gateway.spend.usage import RecordContext, UsageRecord, UsageSink

RETRYABLE = {"connect_error", "timeout", "server_error", "rate_limited", "broken_stream"}
MAX_EVENT_BYTES = 8 << 20        # one SSE event (or a non-streamed reply) larger than this is malformed
MAX_ERROR_TEXT = 500


class UpstreamFailure(Exception):
    """Why an attempt (or the last of them) failed. kind: connect_error, timeout, server_error,
    rate_limited, broken_stream (retryable); client_error (the request itself: not retried),
    auth_error (the gateway's credentials), unavailable (no deployment takes requests now)."""

    def __init__(self, kind: str, message: str, retry_after: float | None = None, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after = retry_after
        self.code = code
        self.param = param

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE

    @property
    def fallback_reason(self) -> str:
        """The policy's fallback condition this failure meets: rate_limit, context_length or error."""
        if self.kind == "rate_limited":
            return "rate_limit"
        if self.code == "context_length_exceeded":
            return "context_length"
        return "error"

    def as_http(self) -> APIError:
        retry = {"retry-after": str(max(1, math.ceil(self.retry_after)))} if self.retry_after is not None else {}
        if self.kind == "client_error":
            return BadRequest(self.message, param=self.param, code=self.code or "upstream_rejected")
        if self.kind == "rate_limited":
            return RateLimited(self.message, code="upstream_rate_limited", headers=retry)
        if self.kind == "timeout":
            return GatewayTimeout(self.message, code="upstream_timeout")
        if self.kind == "unavailable":
            return Unavailable(self.message, code="engine_unavailable", headers=retry or {"retry-after": "1"})
        return BadGateway(self.message, code="upstream_error")


def retry_after_s(raw: str | None) -> float | None:
    """Retry-After as seconds: delta-seconds or an HTTP date; None when absent or unreadable."""
    if not raw:
        return None
    raw = raw.strip()
    if raw.isdigit():
        return float(raw)
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when is not None else None


def _error_text(raw: bytes, secret: str | None = None) -> tuple[str, str | None, str | None]:
    """(message, code, param) from an upstream's error body (OpenAI's shape, or plain text), with
    `secret` (the gateway's key: some servers echo the request's Authorization header) masked before
    the message is cut to length."""
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict):
        msg, code, param = err.get("message"), err.get("code"), err.get("param")
    elif isinstance(doc, dict) and isinstance(doc.get("message"), str):   # some servers: {"message": ...}
        msg, code, param = doc["message"], doc.get("code"), doc.get("param")
    else:
        msg, code, param = raw.decode("utf-8", "replace"), None, None
    msg = " ".join(str(msg or "").split())
    if secret:
        msg = msg.replace(secret, "***")
    msg = msg[:MAX_ERROR_TEXT] or "no message"
    low = msg.lower()
    if code is None and ("context length" in low or "maximum context" in low or "context window" in low):
        code = "context_length_exceeded"
    return msg, (str(code) if code is not None else None), (str(param) if param is not None else None)


class UpstreamCall:
    def __init__(self, engine: UpstreamEngine, path: str, body: dict[str, Any], *, request_id: str,
                 requested_model: str, route_reason: str, arrival: float, arrival_wall: float,
                 metrics: GatewayMetrics, sink: UsageSink, prices: Any, context: RecordContext,
                 prompt_tokens: int, max_tokens: int, on_end: Callable[[int | None], None] | None,
                 affinity: list[bytes] | None = None, price_percent: int = 100, expect: str = "choices") -> None:
        self.engine = engine
        self.name = engine.name
        self.path = path
        self.body = body
        self.stream = bool(body.get("stream"))
        self.request_id = request_id
        self.requested_model = requested_model
        self.route_reason = route_reason
        self.arrival = arrival
        self.arrival_wall = arrival_wall
        self.metrics = metrics
        self._sink = sink
        self.prices = prices
        self.context = context
        self.counted_prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self._on_end = on_end
        self.affinity = affinity
        self.price_percent = price_percent
        self.expect = expect                    # the list a non-streamed reply must hold ("data": embeddings)
        self.attempts: list[str] = []           # "host:port outcome" per attempt, for the access log
        self.deployment: Deployment | None = None
        self.document: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self.first_event_at: float | None = None
        self.finish_reason: str | None = None
        self.text_chars: list[str] = []        # the completion's text, for an estimate when usage is missing
        self.aborted: str | None = None
        self.error: str | None = None
        self.record: UsageRecord | None = None
        self._resp: aiohttp.ClientResponse | None = None
        self._events: AsyncIterator[bytes] | None = None
        self._first: bytes | None = None
        self._bucket = prompt_bucket(prompt_tokens)

    # -- attempts -------------------------------------------------------------------------------
    async def open(self) -> None:
        spec, engine = self.engine.spec, self.engine
        exclude: set[str] = set()
        last: UpstreamFailure | None = None
        for attempt in range(spec.max_attempts):
            dep = engine.pick(exclude, self.affinity)
            if dep is None:
                break
            if attempt:
                await asyncio.sleep(spec.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
            engine.begin(dep, self.affinity)
            t0 = time.perf_counter()
            try:
                await self._attempt(dep)
            except UpstreamFailure as e:
                engine.end(dep)
                self._count(dep, e.kind)
                if e.retryable:
                    engine.failed(dep, e.retry_after if e.kind == "rate_limited" else None)
                    exclude.add(dep.url)
                    last = e
                    continue
                if e.kind == "client_error":
                    engine.succeeded(dep)   # the deployment answered; the request was the problem
                raise
            except BaseException:
                engine.end(dep)
                self._close()
                raise
            self._count(dep, "ok")
            engine.succeeded(dep, time.perf_counter() - t0)
            self.deployment = dep
            self.metrics.in_flight.inc()
            return
        if last is None:
            waits = [d.until - time.monotonic() for d in engine.deployments if d.state == "cooling"]
            last = UpstreamFailure("unavailable", f"Upstream engine {self.name} has no deployment taking requests "
                                   f"now", retry_after=max(1.0, min(waits)) if waits else 1.0)
        raise last

    def give_back(self) -> None:
        """open() failed and the request goes no further here: its reserved limits are refunded."""
        self._close()
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(None)

    def _count(self, dep: Deployment, outcome: str) -> None:
        self.attempts.append(f"{dep.label} {outcome}")
        self.metrics.upstream_attempts.labels(self.name, dep.label, outcome).inc()

    async def _attempt(self, dep: Deployment) -> None:
        t = self.engine.spec.timeouts
        session = self.engine.session
        if session is None:
            raise UpstreamFailure("unavailable", f"Upstream engine {self.name} is not started")
        head_timeout = t.first_token_s if self.stream else t.total_s
        try:
            resp = await asyncio.wait_for(session.post(
                dep.url + self.path, json=self.body, headers=self.engine.headers(),
                timeout=aiohttp.ClientTimeout(total=t.total_s, sock_connect=t.connect_s)), head_timeout)
        except asyncio.TimeoutError:
            raise UpstreamFailure("timeout", f"Upstream engine {self.name} did not answer within "
                                  f"{head_timeout:g} s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise UpstreamFailure("connect_error", f"Upstream engine {self.name} could not be reached "
                                  f"({type(e).__name__})") from None
        self._resp = resp
        try:
            if resp.status != 200:
                raw = await self._read_capped(resp, t.between_tokens_s)
                raise self._status_failure(resp, raw)
            if self.stream:
                self._events = self._sse(resp, t.first_token_s, t.between_tokens_s)
                try:
                    self._first = await self._events.__anext__()
                except StopAsyncIteration:
                    raise UpstreamFailure("broken_stream", f"Upstream engine {self.name} closed the stream "
                                          f"before its first event") from None
                # Nothing has reached the client yet: a first event that is malformed or an error is
                # this attempt's failure (retried elsewhere), not an error event in the client's stream.
                self._parse(self._first)
                self.first_event_at = time.perf_counter()
                return
            raw = await self._read_capped(resp, t.total_s)
            try:
                doc = json.loads(raw)
            except ValueError:
                doc = None
            if not isinstance(doc, dict) or not isinstance(doc.get(self.expect), list):
                raise UpstreamFailure("broken_stream", f"Upstream engine {self.name} sent a reply without "
                                      f"'{self.expect}'")
            self.document = doc
            self.first_event_at = time.perf_counter()
            self._take_usage(doc)
            for ch in doc.get("choices") or []:
                if isinstance(ch, dict):
                    self._take_choice(ch, ch.get("message") or {})
            self._close()
        except UpstreamFailure:
            self._close()
            raise
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            self._close()
            kind = "timeout" if isinstance(e, asyncio.TimeoutError) else "broken_stream"
            raise UpstreamFailure(kind, f"Upstream engine {self.name} broke off its reply "
                                  f"({type(e).__name__})") from None

    def _status_failure(self, resp: aiohttp.ClientResponse, raw: bytes) -> UpstreamFailure:
        msg, code, param = _error_text(raw, self._secret)
        status = resp.status
        where = f"Upstream engine {self.name} answered {status}"
        if status == 429:
            return UpstreamFailure("rate_limited", f"{where}: {msg}", retry_after_s(resp.headers.get("retry-after")))
        if status >= 500 or status == 408:
            return UpstreamFailure("server_error", f"{where}: {msg}")
        if status in (401, 403):
            return UpstreamFailure("auth_error", f"Upstream engine {self.name} refused the gateway's credentials "
                                   f"({status}); the operator must check its api key")
        if status == 404:
            return UpstreamFailure("auth_error", f"Upstream engine {self.name} does not serve the configured model "
                                   f"or path ({status}: {msg})")
        return UpstreamFailure("client_error", f"{where}: {msg}", code=code, param=param)

    async def _read_capped(self, resp: aiohttp.ClientResponse, timeout: float) -> bytes:
        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in resp.content.iter_any():
                size += len(chunk)
                if size > MAX_EVENT_BYTES:
                    raise UpstreamFailure("broken_stream", f"Upstream engine {self.name} sent over "
                                          f"{MAX_EVENT_BYTES} bytes in one reply")
                chunks.append(chunk)
            return b"".join(chunks)
        return await asyncio.wait_for(read(), timeout)

    async def _sse(self, resp: aiohttp.ClientResponse, first_s: float, between_s: float) -> AsyncIterator[bytes]:
        """The data of each server-sent event (multi-line data joined by newlines), comments skipped."""
        buf = b""
        data: list[bytes] = []
        timeout = first_s
        while True:
            chunk = await asyncio.wait_for(resp.content.readany(), timeout)
            timeout = between_s
            if not chunk:
                if data:
                    yield b"\n".join(data)
                return
            buf += chunk
            if len(buf) > MAX_EVENT_BYTES:
                raise UpstreamFailure("broken_stream", f"Upstream engine {self.name} sent an event over "
                                      f"{MAX_EVENT_BYTES} bytes")
            while True:
                line, sep, rest = buf.partition(b"\n")
                if not sep:
                    break
                buf = rest
                line = line.rstrip(b"\r")
                if not line:
                    if data:
                        yield b"\n".join(data)
                        data = []
                elif line.startswith(b"data:"):
                    data.append(line[5:].lstrip(b" "))

    # -- the stream after open() -----------------------------------------------------------------
    async def events(self) -> AsyncIterator[dict[str, Any] | None]:
        """Each upstream chunk as a dict; None for [DONE]. Raises UpstreamFailure for a malformed,
        cut or erroring stream (the caller ends the client's stream with an error event)."""
        assert self._events is not None
        raw: bytes | None = self._first
        self._first = None
        try:
            while True:
                if raw is None:
                    try:
                        raw = await self._events.__anext__()
                    except StopAsyncIteration:
                        raise UpstreamFailure("broken_stream", f"Upstream engine {self.name} ended the stream "
                                              f"without [DONE]") from None
                doc = self._parse(raw)
                if doc is None:
                    yield None
                    return
                self._take_usage(doc)
                for ch in doc.get("choices") or []:
                    if isinstance(ch, dict):
                        self._take_choice(ch, ch.get("delta") or {})
                raw = None
                yield doc
        except asyncio.TimeoutError:
            raise UpstreamFailure("timeout", f"Upstream engine {self.name} went silent for over "
                                  f"{self.engine.spec.timeouts.between_tokens_s:g} s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise UpstreamFailure("broken_stream", f"Upstream engine {self.name} broke off the stream "
                                  f"({type(e).__name__})") from None

    def _parse(self, raw: bytes) -> dict[str, Any] | None:
        """One event's chunk; None for [DONE]. Raises UpstreamFailure for a malformed or error event."""
        if raw.strip() == b"[DONE]":
            return None
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            raise UpstreamFailure("broken_stream", f"Upstream engine {self.name} sent a malformed event")
        if "error" in doc:
            msg, _, _ = _error_text(raw, self._secret)
            raise UpstreamFailure("server_error", f"Upstream engine {self.name} failed mid-stream: {msg}")
        return doc

    @property
    def _secret(self) -> str | None:
        key = self.engine.spec.api_key
        return key.value if key is not None else None

    def _take_usage(self, doc: dict[str, Any]) -> None:
        usage = doc.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            self.usage = usage

    def _take_choice(self, choice: dict[str, Any], part: Any) -> None:
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        if not isinstance(part, dict):
            part = {}
        text = part.get("content") if "content" in part else choice.get("text")
        if isinstance(text, str):
            self.text_chars.append(text)
        for call in part.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                self.text_chars.extend(str(fn.get(k) or "") for k in ("name", "arguments"))

    def abort(self, why: str) -> None:
        if self.record is None and self.aborted is None:
            self.aborted = why
        self._close()

    def _close(self) -> None:
        if self._resp is not None:
            self._resp.close()     # an unfinished upstream response: its connection is dropped, the upstream aborts

    # -- the end ---------------------------------------------------------------------------------
    def counts(self) -> tuple[int, int, int, bool]:
        """(prompt, cached, completion, estimated)."""
        u = self.usage
        if u is not None:
            details = u.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            completion = u.get("completion_tokens")
            return (max(0, int(u["prompt_tokens"])), max(0, int(cached)) if isinstance(cached, int) else 0,
                    max(0, int(completion)) if isinstance(completion, int) else 0, False)
        if self.deployment is None:
            return 0, 0, 0, False           # never reached an upstream: nothing was computed
        return self.counted_prompt_tokens, 0, estimate_tokens("".join(self.text_chars)), True

    def finish(self, http_status: int, status: str | None = None) -> UsageRecord:
        if self.record is not None:
            return self.record
        self._close()
        now = time.perf_counter()
        m, name = self.metrics, self.name
        if self.deployment is not None:
            m.in_flight.dec()
            self.engine.end(self.deployment)
        p, cached, c, estimated = self.counts()
        ttft = None if self.first_event_at is None else self.first_event_at - self.arrival
        if ttft is not None:
            m.ttft.labels(name, self._bucket).observe(ttft)
        m.e2e.labels(name, self._bucket).observe(now - self.arrival)
        m.prompt_tokens.labels(name).inc(p)
        m.cached_tokens.labels(name).inc(cached)
        m.completion_tokens.labels(name).inc(c)
        m.count_request(name, http_status, self.route_reason)
        status = status or ("error" if self.error else self.aborted or "ok")
        ctx, prices = self.context, self.prices
        baseline = ctx.baseline_prices or prices
        self.record = UsageRecord(
            request_id=self.request_id, time=self.arrival_wall, engine=name, requested_model=self.requested_model,
            route_reason=self.route_reason, prompt_tokens=p, cached_tokens=cached, completion_tokens=c,
            cost_micros=prices.cost(p, cached, c, self.price_percent), status=status,
            finish_reason=self.finish_reason, ttft_s=ttft, e2e_s=now - self.arrival, stream=self.stream,
            tenant=ctx.tenant, key_id=ctx.key_id, client_request_id=ctx.client_request_id,
            router_score=ctx.router_score, tags=dict(ctx.tags), user=ctx.user, deadline_ms=ctx.deadline_ms,
            max_tokens=self.max_tokens, prices=[prices.input, prices.cached_input, prices.output],
            baseline_engine=ctx.baseline_engine or name, baseline_cost_micros=baseline.cost(p, cached, c,
                                                                                          self.price_percent),
            key_name=ctx.key_name, requested_max_tokens=ctx.requested_max_tokens, engine_state=ctx.engine_state,
            policy_version=ctx.policy_version, context_dropped_tokens=ctx.context_dropped_tokens,
            routed_prompt_tokens=ctx.routed_prompt_tokens, batch=ctx.batch, price_percent=self.price_percent,
            usage_estimated=estimated, upstream_deployment=self.deployment.label if self.deployment else "",
            upstream_attempts=len(self.attempts), api=ctx.api)
        self._sink(self.record)
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(p + c if self.deployment is not None else None)
        return self.record
