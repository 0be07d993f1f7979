"""The choices of one request (OpenAI's `n`, times the prompts of a text-completion batch), each
one engine sequence, answered as one reply.

    group = GenerationGroup(choices, on_end=admitted.end, sink=gw.usage_sink, leaders=[0, 0, 2, 2])
    group.start()                              # every choice, leaders first
    async for index, delta in group.deltas():  # delta None: that choice has finished
        ...
    group.finish(200)                          # one usage record, one refund

One prefill per prompt: every choice goes to the engine at once, the first choice of each prompt
(its leader) first. The engine's scheduler holds a sequence whose prompt starts like one still
being prefilled (tokenyard.engines.core.scheduler: _prefix_in_flight) until that prefill's first token, then
it finds the prompt's full blocks in the prefix cache and computes only the last, partial block.
The engine decides when the other choices join, not the event loop's timing, so a seeded request's
choices repeat run to run (issue 45.4; they used to be handed over when the leader's first token
reached the gateway, one step later or two as the event loop was busy).

One request, one bill: OpenAI counts each prompt once for n choices, and so does the usage
record (prompt and cached tokens as the leaders computed them, completion tokens summed over the
choices). The rate limiter gets the tokens of all choices back in one refund, once every choice
has ended. With n == 1 the group is a thin wrapper over its one Generation.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator, Callable

from tokenyard.gateway.http.generation import EngineFailed, Generation
from tokenyard.gateway.spend.usage import UsageRecord, UsageSink

_STATUS_ORDER = ("ok", "draining", "slow_client", "client_disconnected", "unfinished", "aborted", "rejected", "error")


class GenerationGroup:
    def __init__(self, choices: list[Generation], on_end: Callable[[int | None], None] | None,
                 sink: UsageSink, leaders: list[int] | None = None) -> None:
        """leaders[i]: the choice whose prefill choice i shares (itself for a leader); default: all
        choices share choice 0's prompt."""
        self.choices = choices
        self.leaders = leaders if leaders is not None else [0] * len(choices)
        self._on_end = on_end
        self._sink = sink
        self._records: list[UsageRecord | None] = [None] * len(choices)
        self._used: list[int | None] = [None] * len(choices)
        self._ended = 0
        self._queue: asyncio.Queue[tuple[int, str | None, BaseException | None]] | None = None
        self._tasks: list[asyncio.Task] = []
        self.record: UsageRecord | None = None
        self._aborted: str | None = None
        for i, gen in enumerate(choices):
            if len(choices) > 1:
                # Each choice reports to the group, which bills and refunds once for all of them.
                gen._sink = lambda rec, i=i: self._collect(i, rec)
                gen._on_end = lambda used, i=i: self._choice_ended(i, used)
                gen._counted = i == 0
            else:
                gen._sink, gen._on_end = sink, on_end

    # -- what the responses read -------------------------------------------------------------
    @property
    def first(self) -> Generation:
        return self.choices[0]

    @property
    def handle(self) -> Any:
        return self.first.handle

    @property
    def model_name(self) -> str:
        return self.first.model_name

    @property
    def params(self) -> Any:
        return self.first.params

    @property
    def request_id(self) -> str:
        return self.first.request_id

    @property
    def aborted(self) -> str | None:
        """Why the request was cut short (the client left, a slow reader, ...), if it was."""
        return self._aborted or next((g.aborted for g in self.choices if g.aborted), None)

    @property
    def error(self) -> str | None:
        return next((g.error for g in self.choices if g.error), None)

    def _leading(self) -> list[Generation]:
        return [g for i, g in enumerate(self.choices) if self.leaders[i] == i]

    def usage(self) -> dict:
        p = sum(g.num_prompt_tokens for g in self._leading())
        cached = sum(g.num_cached_tokens for g in self._leading())
        c = sum(g.num_completion_tokens for g in self.choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # -- running ------------------------------------------------------------------------------
    def start(self) -> None:
        """Every choice goes to the engine now, leaders first, in one go (no await between: the engine
        sees them together). Their errors are the caller's (bad input, engine down); a choice that
        fails takes back those started before it."""
        started = []
        order = self._leading() + [g for i, g in enumerate(self.choices) if self.leaders[i] != i]
        try:
            for g in order:
                g.start()
                started.append(g)
        except BaseException:
            # The request fails as a whole: stop the leaders already running (their tokens count),
            # and end the choices that never ran, so the admission pass is given back once.
            self._aborted = "aborted"
            for g in self.choices:
                if g in started:
                    g.abort("aborted")
                else:
                    g._end(None)
            if started:
                self.finish(400, "aborted")
            raise

    async def deltas(self) -> AsyncIterator[tuple[int, str | None]]:
        """(choice index, text delta) as the text is made; (index, None) once a choice has ended.
        Returns quietly when aborted; raises EngineFailed when any choice fails."""
        if len(self.choices) == 1:
            async for delta in self.first.deltas():
                yield 0, delta
            if self.first.aborted is None:
                yield 0, None
            return
        self._queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(self._pump(i)) for i in range(len(self.choices))]
        pending = len(self.choices)
        try:
            while pending:
                index, delta, error = await self._queue.get()
                if error is not None:
                    self.abort("error")
                    raise error
                if delta is None:
                    pending -= 1
                    if self.choices[index].aborted is not None:
                        self.abort(self._aborted or self.choices[index].aborted)
                        return
                yield index, delta
        finally:
            for task in self._tasks:
                task.cancel()

    async def _pump(self, index: int) -> None:
        gen = self.choices[index]
        try:
            async for delta in gen.deltas():
                self._queue_put((index, delta, None))
            self._queue_put((index, None, None))
        except EngineFailed as e:
            self._queue_put((index, None, e))

    def _queue_put(self, item: tuple[int, str | None, BaseException | None]) -> None:
        if self._queue is not None:
            self._queue.put_nowait(item)

    def abort(self, why: str) -> None:
        """Cut every choice short."""
        if self._aborted is None:
            self._aborted = why
        for gen in self.choices:
            gen.abort(why)

    # -- the end ------------------------------------------------------------------------------
    def finish(self, http_status: int, status: str | None = None) -> UsageRecord:
        if self.record is not None:
            return self.record
        if len(self.choices) == 1:
            self.record = self.first.finish(http_status, status)
            return self.record
        for gen in self.choices:
            gen.finish(http_status, status)
        records = [r for r in self._records if r is not None]
        first = records[0]
        c = sum(r.completion_tokens for r in records)
        prices, baseline = self.first.prices()
        leading = [r for i, r in enumerate(self._records) if r is not None and self.leaders[i] == i]
        p, cached = sum(r.prompt_tokens for r in leading), sum(r.cached_tokens for r in leading)
        worst = max((r.status for r in records), key=lambda s: _STATUS_ORDER.index(s) if s in _STATUS_ORDER else 0)
        self.record = dataclasses.replace(
            first, request_id=first.request_id, prompt_tokens=p, cached_tokens=cached, completion_tokens=c,
            cost_micros=prices.cost(p, cached, c, self.first.price_percent),
            baseline_cost_micros=baseline.cost(p, cached, c, self.first.price_percent), status=worst,
            e2e_s=max(r.e2e_s for r in records), max_tokens=first.max_tokens * len(self.choices),
            choice_completion_tokens=[r.completion_tokens for r in records])
        self._sink(self.record)
        return self.record

    def _collect(self, index: int, record: UsageRecord) -> None:
        self._records[index] = record

    def _choice_ended(self, index: int, used: int | None) -> None:
        self._used[index] = used
        self._ended += 1
        if self._ended < len(self.choices) or self._on_end is None:
            return
        # Each choice reports its prompt + completion (None: never ran); a prompt is charged once.
        ran = [i for i, u in enumerate(self._used) if u is not None]
        total = None if not ran else sum(self._used[i] for i in ran) - sum(
            self.choices[i].num_prompt_tokens for i in ran if self.leaders[i] != i)
        on_end, self._on_end = self._on_end, None
        on_end(total)
