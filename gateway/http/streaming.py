"""Server-sent events for a streamed completion: OpenAI's chat.completion.chunk objects
(SSEResponse) or text_completion objects (TextSSEResponse: no role chunk, `text` for `delta`).

    data: {... "delta": {"role": "assistant", "content": ""} ...}     first: the role
    data: {... "delta": {"content": "Hel"} ...}                        text as it is made
    data: {... "delta": {}, "finish_reason": "stop"}                  last choice chunk
    data: {... "choices": [], "usage": {...}}                          with include_usage
    data: [DONE]

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
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway.http.errors import ServerError
from gateway.http.generation import EngineFailed, Generation

log = logging.getLogger(__name__)


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse:
    def __init__(self, gen: Generation, completion_id: str, created: int, include_usage: bool,
                 headers: dict[str, str], buffer_bytes: int, write_timeout_s: float) -> None:
        self.gen = gen
        self.include_usage = include_usage
        self.headers = headers
        self.buffer_bytes = buffer_bytes
        self.write_timeout_s = write_timeout_s
        # Every chunk shares this head; only "choices" (and "usage") change.
        self._head = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                      "model": gen.handle.name, "system_fingerprint": None}
        self._buf: list[bytes] = []
        self._buffered = 0
        self._ready = asyncio.Event()
        self._produced_all = False
        self._logprobs_sent = 0   # completion tokens whose logprobs a chunk has carried
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

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None, with_logprobs: bool = False
               ) -> dict[str, Any]:
        chunk = dict(self._head)
        logprobs = None
        if with_logprobs and self.gen.params.logprobs is not None and self._logprobs_sent < len(self.gen.logprobs):
            # The tokens since the last chunk: a token whose text is held back (part of a UTF-8
            # character, maybe a stop string) is reported with the chunk that releases it, or the last.
            logprobs = self.gen.logprobs_field(self._logprobs_sent)
            self._logprobs_sent = len(self.gen.logprobs)
        chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        return chunk

    def _opening(self) -> dict[str, Any] | None:
        return self._chunk({"role": "assistant", "content": "", "refusal": None})

    def _delta_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text}, with_logprobs=True)

    def _final_chunk(self) -> dict[str, Any]:
        return self._chunk({}, self.gen.finish_reason, with_logprobs=True)

    async def _produce(self) -> None:
        gen = self.gen
        try:
            opening = self._opening()
            if opening is not None:
                self._push(opening)
            async for delta in gen.deltas():
                self._push(self._delta_chunk(delta))
            if gen.aborted is None:
                self._push(self._final_chunk())
                if self.include_usage:
                    self._push({**self._head, "choices": [], "usage": gen.usage()})
                gen.finish(200)  # the usage record exists before the client can see [DONE]
                self._push(b"data: [DONE]\n\n")
        except EngineFailed:
            gen.finish(500)
            self._push({"error": ServerError("The engine failed while generating this response",
                                             code="engine_error").body()["error"]})
        except Exception:  # noqa: BLE001 - the stream is already open: report in-band, never a trace
            log.exception("stream %s failed", gen.request_id)
            gen.error = gen.error or "internal error"
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
                      "model": self.gen.handle.name, "system_fingerprint": None}

    def _opening(self) -> dict[str, Any] | None:
        return None

    def _delta_chunk(self, text: str) -> dict[str, Any]:
        return self._text_chunk(text, None)

    def _final_chunk(self) -> dict[str, Any]:
        return self._text_chunk("", self.gen.finish_reason)

    def _text_chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        chunk = dict(self._head)
        logprobs = None
        if self.gen.params.logprobs is not None and self._logprobs_sent < len(self.gen.logprobs):
            logprobs = self.gen.legacy_logprobs_field(self._logprobs_sent)
            self._logprobs_sent = len(self.gen.logprobs)
        chunk["choices"] = [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}]
        if self.include_usage:
            chunk["usage"] = None
        return chunk
