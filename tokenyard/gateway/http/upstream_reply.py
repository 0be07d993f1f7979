"""The client's reply for a request an upstream engine served: its JSON object, or its stream relayed
chunk by chunk (tokenyard/gateway/http/upstream_call.py reads the upstream; upstream_body.py says
what is rewritten).

A stream is relayed as the upstream sends it, each chunk with the gateway's id and engine name.
The usage chunk the gateway asked for (stream_options.include_usage) reaches the client only if
the client asked for it too. If the upstream fails after the stream began, the client gets one
`data: {"error": ...}` event (the built-in engines' convention) and the stream closes: no retry,
so nothing is answered twice. A client that goes away closes the upstream response, which aborts
the request there. A reader slower than `limits.stream_write_timeout_s` per write is cut.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.types import Receive, Scope, Send

from tokenyard.gateway.edge.errors import ServerError
from tokenyard.gateway.http.streaming import wait_disconnect
from tokenyard.gateway.http.upstream_body import as_ours
from tokenyard.gateway.http.upstream_call import UpstreamCall, UpstreamFailure

log = logging.getLogger(__name__)


def _headers(extra: dict[str, str], content_type: bytes) -> list[tuple[bytes, bytes]]:
    out = [(b"content-type", content_type)]
    out += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    return out


async def send_json(send: Send, call: UpstreamCall, body: dict[str, Any], headers: dict[str, str]) -> None:
    """A whole reply: the usage record written first (call.finish), then the JSON object."""
    data = json.dumps(body, ensure_ascii=False).encode()
    call.finish(200)      # the usage record exists before the client sees the reply
    await send({"type": "http.response.start", "status": 200,
                "headers": _headers(headers, b"application/json") + [(b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def start_stream(send: Send, headers: dict[str, str]) -> None:
    """The head of a server-sent event stream."""
    await send({"type": "http.response.start", "status": 200,
                "headers": _headers(headers, b"text/event-stream; charset=utf-8")
                + [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})


class UpstreamJSONResponse:
    """A non-streamed reply: the upstream's object, already read in full by UpstreamCall.open()."""

    def __init__(self, call: UpstreamCall, completion_id: str, headers: dict[str, str]) -> None:
        self.call = call
        self.completion_id = completion_id
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self.call
        try:
            assert call.document is not None
            await send_json(send, call, as_ours(call.document, self.completion_id, call.name), self.headers)
        finally:
            call.finish(200)


class UpstreamSSEResponse:
    def __init__(self, call: UpstreamCall, completion_id: str, include_usage: bool, headers: dict[str, str],
                 write_timeout_s: float) -> None:
        self.call = call
        self.completion_id = completion_id
        self.include_usage = include_usage
        self.headers = headers
        self.write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self.call
        loop = asyncio.get_running_loop()
        relay = loop.create_task(self._relay(send))
        watcher = loop.create_task(wait_disconnect(receive))
        status = 200
        try:
            done, _ = await asyncio.wait({relay, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if relay not in done:            # the client left first
                relay.cancel()
                await asyncio.gather(relay, return_exceptions=True)
                call.abort("client_disconnected")
            else:
                relay.result()
        except asyncio.CancelledError:
            call.abort("client_disconnected")
            raise
        finally:
            watcher.cancel()
            relay.cancel()
            if call.aborted in ("client_disconnected", "slow_client"):
                status = 499
            elif call.error:
                status = 502
            call.finish(status, call.aborted if status == 499 else None)

    async def _send(self, send: Send, body: bytes) -> None:
        try:
            await asyncio.wait_for(send({"type": "http.response.body", "body": body, "more_body": True}),
                                   self.write_timeout_s)
        except (asyncio.TimeoutError, OSError):
            self.call.abort("slow_client")
            raise asyncio.CancelledError from None

    async def _relay(self, send: Send) -> None:
        call = self.call
        await start_stream(send, self.headers)
        try:
            async for doc in call.events():
                if doc is None:
                    call.finish(200)     # the usage record exists before the client can see [DONE]
                    await self._send(send, b"data: [DONE]\n\n")
                    break
                usage_only = not doc.get("choices") and doc.get("usage") is not None
                if usage_only and not self.include_usage:
                    continue
                if not self.include_usage:
                    doc = {k: v for k, v in doc.items() if k != "usage"}
                chunk = as_ours(doc, self.completion_id, call.name)
                await self._send(send, b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n")
        except UpstreamFailure as e:
            call.error = e.message
            err = e.as_http().body()["error"]
            await self._send(send, b"data: " + json.dumps({"error": err}).encode() + b"\n\n")
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the stream is open: report in-band, never a trace
            log.exception("upstream stream %s failed", call.request_id)
            call.error = "internal error"
            err = ServerError("Internal error while streaming").body()["error"]
            await self._send(send, b"data: " + json.dumps({"error": err}).encode() + b"\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
