"""KV payloads between hosts over TCP (asyncio streams): one frame (frames.py) each way.

    sender                                   receiver (KVReceiver)
    connect, write frame(payload)  ------>   read frame (timeout), check CRC, parse payload,
                                             await handler(payload) -> reply dict
    read frame(reply JSON)         <------   write frame(reply)

Every read has a timeout: a peer that stops mid-frame (a truncated frame, a hung process) is a
TransferError after timeout_s, never a hang, and a connection closed mid-frame is one at once. A
bad frame or payload gets a reply {"ok": false, "error": ...} when the connection still stands.
The handler runs the import where the engine allows it (its step thread); its reply goes back.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from tokenyard.engines.kv_transfer.block_payload import BlockPayload, PayloadError
from tokenyard.engines.kv_transfer.frames import HEAD, MAX_FRAME_BYTES, FrameError, check_body, encode_frame, parse_head

Handler = Callable[[BlockPayload], Awaitable[dict[str, Any]]]


class TransferError(RuntimeError):
    """A transfer that did not complete: connection refused or lost, timeout, bad frame, refusal."""


async def read_frame(reader: asyncio.StreamReader, timeout_s: float, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    try:
        head = await asyncio.wait_for(reader.readexactly(HEAD.size), timeout_s)
        length, crc = parse_head(head, max_bytes)
        body = await asyncio.wait_for(reader.readexactly(length), timeout_s)
    except asyncio.IncompleteReadError as exc:
        raise FrameError(f"frame truncated: connection closed after {len(exc.partial)} bytes "
                         f"of a part of {exc.expected}") from None
    except asyncio.TimeoutError:
        raise TransferError(f"no complete frame within {timeout_s:g} s") from None
    return check_body(body, length, crc)


async def send_payload(host: str, port: int, payload: BlockPayload | bytes, timeout_s: float = 30.0) -> dict[str, Any]:
    """Send one payload; returns the receiver's reply (TransferError when it failed)."""
    body = payload.to_bytes() if isinstance(payload, BlockPayload) else payload
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        raise TransferError(f"cannot connect to KV receiver {host}:{port}: {exc}") from exc
    try:
        writer.write(encode_frame(body))
        await asyncio.wait_for(writer.drain(), timeout_s)
        reply = json.loads(await read_frame(reader, timeout_s))
    except (OSError, FrameError, TransferError, ValueError, asyncio.TimeoutError) as exc:
        raise TransferError(f"KV transfer to {host}:{port} failed: {exc}") from exc
    finally:
        writer.close()
    if not reply.get("ok"):
        raise TransferError(f"KV receiver {host}:{port} refused the payload: {reply.get('error')}")
    return reply


class KVReceiver:
    """Accepts payloads on host:port (port 0: any free port, see .port) and hands each to handler."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 max_bytes: int = MAX_FRAME_BYTES) -> None:
        self.handler, self.host, self.port = handler, host, port
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self.errors: list[str] = []      # why frames were refused, newest last (for logs and tests)
        self._server: asyncio.Server | None = None

    async def start(self) -> "KVReceiver":
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                payload = BlockPayload.from_bytes(await read_frame(reader, self.timeout_s, self.max_bytes))
                reply = {"ok": True, **(await self.handler(payload))}
            except (FrameError, PayloadError, TransferError, ValueError) as exc:
                self.errors.append(str(exc))
                reply = {"ok": False, "error": str(exc)}
            writer.write(encode_frame(json.dumps(reply).encode()))
            await asyncio.wait_for(writer.drain(), self.timeout_s)
        except (OSError, asyncio.TimeoutError):
            pass    # the sender is gone; it sees its own error
        finally:
            writer.close()
