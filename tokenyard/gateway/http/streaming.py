"""Server-sent events for a streamed completion: OpenAI's chat.completion.chunk objects
(SSEResponse) or text_completion objects (TextSSEResponse: no role chunk, `text` for `delta`).

    data: {... "delta": {"role": "assistant", "content": ""} ...}     first: the role
    data: {... "delta": {"content": "Hel"} ...}                        text as it is made
    data: {... "delta": {"tool_calls": [{"index": 0, "id", "function": {"name", "arguments": ""}}]}}
    data: {... "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"ci"}}]}}
    data: {... "delta": {}, "finish_reason": "stop"}                  last choice chunk
    data: {... "choices": [], "usage": {...}}                          with include_usage
    data: [DONE]

With n > 1 choices each chunk carries one choice, told apart by its `index`, in the order the
text is made. With tools, a per-choice `ToolCallStream` turns text into content and tool-call
deltas (tokenyard/gateway/http/tool_calls.py).

An error after the stream began is one `data: {"error": {...}}` event, then the stream closes.

Three small tasks per stream keep a slow reader from holding anything for long: a producer
turns engine output into SSE bytes in a buffer; the writer sends what is buffered in one write
(so a reader that falls behind gets bigger, fewer writes); a watcher notices the client leaving.
The request is aborted in the engine (and its usage so far recorded) when the client leaves,
when the buffer holds more than `buffer_bytes` unsent bytes, or when one write is blocked
longer than `write_timeout_s` (the peer stopped reading and its TCP window is full).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

from starlette.types import Receive, Scope, Send

from tokenyard.gateway.edge.errors import ServerError
from tokenyard.gateway.http.generation import EngineFailed, Generation, RequestRejected
from tokenyard.gateway.http.generation_group import GenerationGroup
from tokenyard.gateway.http.tool_calls import ToolCallStream

log = logging.getLogger(__name__)


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _ChoiceState:
    """One choice's place in the stream: its logprobs sent so far and its tool-call parser."""

    __slots__ = ("index", "gen", "logprobs_sent", "tools")

    def __init__(self, index: int, gen: Generation, tools: ToolCallStream | None) -> None:
        self.index = index
        self.gen = gen
        self.logprobs_sent = 0    # completion tokens whose logprobs a chunk has carried
        self.tools = tools


class SSEResponse:
    def __init__(self, gen: GenerationGroup, completion_id: str, created: int, include_usage: bool,
                 headers: dict[str, str], buffer_bytes: int, write_timeout_s: float,
                 tool_stream: Callable[[], ToolCallStream | None] | None = None) -> None:
        self.gen = gen
        self.include_usage = include_usage
        self.headers = headers
        self.buffer_bytes = buffer_bytes
        self.write_timeout_s = write_timeout_s
        # Every chunk shares this head; only "choices" (and "usage") change.
        self._head = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                      "model": gen.model_name, "system_fingerprint": None}
        self._buf: list[bytes] = []
        self._buffered = 0
        self._ready = asyncio.Event()
        self._produced_all = False
        self._choices = [_ChoiceState(i, g, tool_stream() if tool_stream else None) for i, g in enumerate(gen.choices)]
        self.status = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        loop = asyncio.get_running_loop()
        watcher = loop.create_task(self._watch(receive))
        producer = loop.create_task(self._produce())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await self._write(send)
        finally:
            watcher.cancel()
            producer.cancel()
            status = self.gen.aborted if self.gen.aborted in ("client_disconnected", "slow_client") else None
            self.gen.finish(499 if status else (500 if self.gen.error else 200), status)

    async def _watch(self, receive: Receive) -> None:
        await wait_disconnect(receive)
        self.gen.abort("client_disconnected")
        self._ready.set()

    async def _write(self, send: Send) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self.gen.aborted in ("client_disconnected", "slow_client"):
                return
            if self._buf:
                data = b"".join(self._buf)
                self._buf.clear()
                self._buffered = 0
                try:
                    await asyncio.wait_for(send({"type": "http.response.body", "body": data, "more_body": True}),
                                           self.write_timeout_s)
                except (asyncio.TimeoutError, OSError):
                    self.gen.abort("slow_client")
                    return
            if self._produced_all and not self._buf:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return

    def _push(self, obj: Any) -> None:
        data = obj if isinstance(obj, bytes) else b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
        self._buf.append(data)
        self._buffered += len(data)
        self._ready.set()
        if self._buffered > self.buffer_bytes:
            self.gen.abort("slow_client")

    def _new_logprobs(self, st: _ChoiceState, legacy: bool = False) -> dict | None:
        """The logprobs of the tokens since the choice's last chunk: a token whose text is held
        back (part of a UTF-8 character, maybe a stop string) goes with the chunk that releases it."""
        gen = st.gen
        if gen.params.logprobs is None or st.logprobs_sent >= len(gen.logprobs):
            return None
        out = gen.legacy_logprobs_field(st.logprobs_sent) if legacy else gen.logprobs_field(st.logprobs_sent)
        st.logprobs_sent = len(gen.logprobs)
        return out

    def _chunk(self, st: _ChoiceState, delta: dict[str, Any], finish_reason: str | None = None,
               with_logprobs: bool = False) -> dict[str, Any]:
        chunk = dict(self._head)
        logprobs = self._new_logprobs(st) if with_logprobs else None
        chunk["choices"] = [{"index": st.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        return chunk

    def _opening(self, st: _ChoiceState) -> dict[str, Any] | None:
        return self._chunk(st, {"role": "assistant", "content": "", "refusal": None})

    def _delta_chunks(self, st: _ChoiceState, text: str) -> list[dict[str, Any]]:
        deltas = st.tools.feed(text) if st.tools is not None else [{"content": text}]
        return [self._chunk(st, d, with_logprobs=True) for d in deltas]

    def _final_chunks(self, st: _ChoiceState) -> list[dict[str, Any]]:
        finish = st.gen.finish_reason
        deltas: list[dict[str, Any]] = []
        if st.tools is not None:
            deltas, finish = st.tools.close(finish)
        return [self._chunk(st, d, with_logprobs=True) for d in deltas] + [
            self._chunk(st, {}, finish, with_logprobs=True)]

    async def _produce(self) -> None:
        gen = self.gen
        try:
            for st in self._choices:
                opening = self._opening(st)
                if opening is not None:
                    self._push(opening)
            async for index, delta in gen.deltas():
                st = self._choices[index]
                for chunk in (self._final_chunks(st) if delta is None else self._delta_chunks(st, delta)):
                    self._push(chunk)
            if gen.aborted is None:
                if self.include_usage:
                    self._push({**self._head, "choices": [], "usage": gen.usage()})
                gen.finish(200)  # the usage record exists before the client can see [DONE]
                self._push(b"data: [DONE]\n\n")
        except RequestRejected as e:    # a remote replica refused the input after the stream began
            gen.finish(400, "rejected")
            self._push({"error": e.as_http().body()["error"]})
        except EngineFailed:
            gen.finish(500)
            self._push({"error": ServerError("The engine failed while generating this response",
                                             code="engine_error").body()["error"]})
        except Exception:  # noqa: BLE001 - the stream is already open: report in-band, never a trace
            log.exception("stream %s failed", gen.request_id)
            gen.first.error = gen.first.error or "internal error"
            self._push({"error": ServerError("Internal error while streaming").body()["error"]})
        finally:
            self._produced_all = True
            self._ready.set()


class TextSSEResponse(SSEResponse):
    """A streamed text completion: text_completion objects whose choice carries `text` (and the
    legacy logprobs shape), no opening role chunk; usage and [DONE] as for chat."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head = {"id": self._head["id"], "object": "text_completion", "created": self._head["created"],
                      "model": self.gen.model_name, "system_fingerprint": None}

    def _opening(self, st: _ChoiceState) -> dict[str, Any] | None:
        return None

    def _delta_chunks(self, st: _ChoiceState, text: str) -> list[dict[str, Any]]:
        return [self._text_chunk(st, text, None)]

    def _final_chunks(self, st: _ChoiceState) -> list[dict[str, Any]]:
        return [self._text_chunk(st, "", st.gen.finish_reason)]

    def _text_chunk(self, st: _ChoiceState, text: str, finish_reason: str | None) -> dict[str, Any]:
        chunk = dict(self._head)
        chunk["choices"] = [{"text": text, "index": st.index, "logprobs": self._new_logprobs(st, legacy=True),
                             "finish_reason": finish_reason}]
        if self.include_usage:
            chunk["usage"] = None
        return chunk
