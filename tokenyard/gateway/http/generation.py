"""One chat request running on one engine: text deltas out; timings, usage and metrics kept.

The engine speaks token ids; `tokenyard.engines.text.text_stream.TextStream` (the incremental detokeniser
with stop strings) turns them into deltas that never split a UTF-8 character and never show
part of a stop string. When a stop string ends the text, the engine request is aborted at once
so at most one extra step runs.

`finish()` runs exactly once however the request ends (done, client gone, slow reader, engine
error, server shutdown): it aborts the engine request if it is still running, counts the
tokens the engine had already produced, records metrics and hands a UsageRecord to the sink.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from tokenyard.engines.core.outputs import StepOutput
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.runtime.async_engine import RequestStream
from tokenyard.engines.text.text_stream import TextStream
from tokenyard.gateway.backends.engine_pool import EngineHandle
from tokenyard.gateway.edge.errors import BadRequest
from tokenyard.gateway.observability.metrics import GatewayMetrics, prompt_bucket
from tokenyard.gateway.spend.usage import RecordContext, UsageRecord, UsageSink


class EngineFailed(Exception):
    """The engine failed while serving this request (the step raised)."""


class RequestRejected(EngineFailed):
    """The engine (a remote replica, which checks parameters only when the request reaches it)
    refused the request's own input: answered as a 400 naming `param`."""

    def __init__(self, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def as_http(self) -> BadRequest:
        """The 400 a local engine would have given before the reply started."""
        code = self.code or {"response_format": "invalid_response_format",
                             "tools": "invalid_tools"}.get(self.param or "")
        return BadRequest(str(self), param=self.param, code=code)


@dataclass(slots=True)
class GenerationSetup:
    """What every choice of one request shares: where it runs, how it was routed, what it is billed."""

    handle: EngineHandle
    requested_model: str
    route_reason: str
    stream: bool
    arrival: float                          # perf_counter seconds
    arrival_wall: float                     # unix seconds
    metrics: GatewayMetrics
    sink: UsageSink
    priority: int = 0                       # engine priority: 0 interactive, 1 batch
    tenant: str = ""
    context: RecordContext | None = None
    price_percent: int = 100                # share of the prices charged: 100, or the policy's batch price
    grammar_param: str = "response_format"  # the parameter a grammar refusal is blamed on ("tools")


class Generation:
    """One choice: `request_id` in the engine, its prompt ids and sampling parameters. on_end gets the
    tokens used (None: never ran); on_first_token is called once, when the prefill is done; counted:
    False when another choice of the same request counts it in the request metrics."""

    @property
    def model_name(self) -> str:
        """The `model` of the reply: the engine, or ENGINE:ADAPTER when a LoRA adapter answered."""
        lora = self.context.lora
        return f"{self.handle.name}:{lora}" if lora else self.handle.name

    def __init__(self, setup: GenerationSetup, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 on_end: Callable[[int | None], None] | None = None,
                 on_first_token: Callable[[], None] | None = None, counted: bool = True) -> None:
        self.handle = handle = setup.handle
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.requested_model = setup.requested_model
        self.route_reason = setup.route_reason
        self.stream = setup.stream
        self.arrival = setup.arrival           # perf_counter seconds
        self.arrival_wall = setup.arrival_wall  # unix seconds
        self._metrics = setup.metrics
        self._sink = setup.sink
        self.priority = setup.priority         # engine priority: 0 interactive, 1 batch
        self.tenant = setup.tenant
        self.context = setup.context or RecordContext(tenant=setup.tenant)
        self._on_end = on_end                  # gets the tokens used (None: never ran): refund, free the slot
        self._on_first_token = on_first_token  # called once, when the prompt's prefill is done
        self._counted = counted                # False: another choice of the same request counts it
        self.price_percent = setup.price_percent  # share of the prices charged: 100, or the policy's batch price
        self._bucket = prompt_bucket(len(prompt_ids))
        self._text = TextStream(handle.tokenizer, params, prompt_ids)
        self._engine_stream: RequestStream | None = None
        self.num_cached_tokens = 0
        self.first_token_at: float | None = None
        self.max_itl = 0.0                     # the longest gap between two output tokens (the SLO's ITL)
        self.last_token_at: float | None = None
        self.aborted: str | None = None        # why the request was cut short, if it was
        self.error: str | None = None
        self.record: UsageRecord | None = None
        # [token id, logprob, [[id, logprob], ...]] per completion token, when params.logprobs is set.
        self.logprobs: list = []
        self.rejected = False                  # the engine refused the request's input (a 400)
        self.grammar_param = setup.grammar_param

    # -- running ------------------------------------------------------------------------------
    def start(self) -> None:
        """Hand the prompt to the engine (RequestError: bad input; EngineDeadError: engine down)."""
        self._metrics.queue.labels(self.handle.name, self._bucket).observe(time.perf_counter() - self.arrival)
        try:
            self._engine_stream = self.handle.engine.add_request(self.request_id, self.prompt_ids, self.params,
                                                                 priority=self.priority, cache_salt=self.tenant or None)
        except BaseException:
            self._end(None)
            raise
        self._metrics.in_flight.inc()

    @property
    def done(self) -> bool:
        return self._text.finished or self.aborted is not None or self.error is not None

    @property
    def finish_reason(self) -> str | None:
        return self._text.finish_reason

    @property
    def text(self) -> str:
        return self._text.text

    @property
    def stop_string(self) -> str | None:
        return self._text.stop_string

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self._text.token_ids)

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas until the request ends; returns quietly when aborted, raises EngineFailed."""
        while not self.done:
            out = await self._engine_stream.get()
            if out.finish_reason == "abort" and not out.new_token_ids:
                self.aborted = self.aborted or "aborted"
                return
            if out.finish_reason == "error":
                self.error = out.error or "engine error"
                if out.bad_request:
                    self.rejected = True
                    raise RequestRejected(self.error, self.grammar_param if out.error_param == "grammar"
                                          else out.error_param, out.error_code)
                raise EngineFailed(self.error)
            delta = self._feed(out)
            if self._text.needs_abort:  # a stop string ended the text; the engine still runs it
                self.handle.engine.abort(self.request_id)
            if delta:
                yield delta

    def abort(self, why: str) -> None:
        """Cut the request short (client gone, slow reader): the reader's deltas() ends promptly."""
        if not self.done:
            self.aborted = why
            self.handle.engine.abort(self.request_id)

    def _feed(self, out: StepOutput) -> str:
        if out.new_token_ids:
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
                if self._on_first_token is not None:
                    self._on_first_token()
            elif self.last_token_at is not None:
                self._metrics.itl.labels(self.handle.name, self._bucket).observe(now - self.last_token_at)
                self.max_itl = max(self.max_itl, now - self.last_token_at)
            self.last_token_at = now
        self.num_cached_tokens = out.num_cached_tokens
        delta = self._text.feed(out)
        if out.logprobs:   # only for tokens the text kept (none past a stop string)
            self.logprobs.extend(out.logprobs[:len(self._text.token_ids) - len(self.logprobs)])
        return delta

    def logprobs_field(self, start: int = 0, end: int | None = None) -> dict | None:
        """OpenAI's choices[].logprobs for completion tokens [start, end), or None when not asked."""
        if self.params.logprobs is None:
            return None
        tok = self.handle.tokenizer

        def entry(token_id: int, logprob: float) -> dict:
            raw = tok.id_to_bytes(token_id)
            # OpenAI's floor for "practically impossible"; JSON has no -Infinity.
            return {"token": raw.decode("utf-8", "replace"), "logprob": max(float(logprob), -9999.0),
                    "bytes": list(raw)}

        content = [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                   for t, lp, top in self.logprobs[start:end]]
        return {"content": content, "refusal": None}

    def legacy_logprobs_field(self, start: int = 0, end: int | None = None) -> dict | None:
        """The text completion's choices[].logprobs (OpenAI's legacy shape: tokens, token_logprobs,
        top_logprobs as {token: logprob}, text_offset in characters of the completion text) for
        completion tokens [start, end), or None when not asked."""
        if self.params.logprobs is None:
            return None
        tok = self.handle.tokenizer

        def text(token_id: int) -> str:
            return tok.id_to_bytes(token_id).decode("utf-8", "replace")

        offset = sum(len(text(t)) for t, _, _ in self.logprobs[:start])
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in self.logprobs[start:end]:
            s = text(t)
            out["tokens"].append(s)
            out["token_logprobs"].append(max(float(lp), -9999.0))   # JSON has no -Infinity
            out["top_logprobs"].append({text(i): max(float(v), -9999.0) for i, v in top})
            out["text_offset"].append(offset)
            offset += len(s)
        return out

    # -- the end ------------------------------------------------------------------------------
    def usage(self) -> dict:
        p, c = self.num_prompt_tokens, self.num_completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    def finish(self, http_status: int, status: str | None = None) -> UsageRecord:
        if self.record is not None:
            return self.record
        if self._engine_stream is not None and not self._text.finished:
            self.abort(self.aborted or "unfinished")
            # Tokens the engine made that nobody read still count: they were computed.
            while (out := self._engine_stream.get_nowait()) is not None:
                if out.new_token_ids and not self._text.finished:
                    self._feed(out)
        now = time.perf_counter()
        name, m = self.handle.name, self._metrics
        if self._engine_stream is not None:
            m.in_flight.dec()
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        if ttft is not None:
            m.ttft.labels(name, self._bucket).observe(ttft)
            m.count_slo(name, ttft, self.max_itl)
            n = self.num_completion_tokens
            if n > 1 and self.last_token_at is not None:
                m.tpot.labels(name, self._bucket).observe((self.last_token_at - self.first_token_at) / (n - 1))
        end = self.last_token_at or now
        m.e2e.labels(name, self._bucket).observe(end - self.arrival)
        m.prompt_tokens.labels(name).inc(self.num_prompt_tokens)
        m.cached_tokens.labels(name).inc(self.num_cached_tokens)
        m.completion_tokens.labels(name).inc(self.num_completion_tokens)
        if self.context.lora:
            m.lora_requests.labels(name, self.context.lora).inc()
            m.lora_completion_tokens.labels(name, self.context.lora).inc(self.num_completion_tokens)
        if self._counted:
            m.count_request(name, http_status, self.route_reason)
        status = status or ("error" if self.error else self.aborted or "ok")
        p, cached, c = self.num_prompt_tokens, self.num_cached_tokens, self.num_completion_tokens
        ctx = self.context
        prices, baseline = self.prices()
        self.record = UsageRecord(
            request_id=self.request_id, time=self.arrival_wall, engine=name, requested_model=self.requested_model,
            route_reason=self.route_reason, prompt_tokens=p, cached_tokens=cached, completion_tokens=c,
            cost_micros=prices.cost(p, cached, c, self.price_percent), status=status, finish_reason=self.finish_reason,
            ttft_s=ttft, e2e_s=now - self.arrival, stream=self.stream, tenant=ctx.tenant or self.tenant,
            key_id=ctx.key_id, client_request_id=ctx.client_request_id, router_score=ctx.router_score,
            tags=dict(ctx.tags), user=ctx.user, deadline_ms=ctx.deadline_ms, max_tokens=self.params.max_tokens,
            prices=[prices.input, prices.cached_input, prices.output],
            baseline_engine=ctx.baseline_engine or name,
            baseline_cost_micros=baseline.cost(p, cached, c, self.price_percent),
            key_name=ctx.key_name, requested_max_tokens=ctx.requested_max_tokens, engine_state=ctx.engine_state,
            policy_version=ctx.policy_version, context_dropped_tokens=ctx.context_dropped_tokens,
            routed_prompt_tokens=ctx.routed_prompt_tokens, batch=ctx.batch, price_percent=self.price_percent,
            api=ctx.api, lora=ctx.lora)
        self._sink(self.record)
        self._end(p + c)
        return self.record

    def prices(self) -> tuple[Any, Any]:
        """(the prices charged, the baseline engine's prices): the policy's prices win over the deployment's."""
        prices = self.context.prices or self.handle.prices
        return prices, self.context.baseline_prices or prices

    def _end(self, used_tokens: int | None) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(used_tokens)
