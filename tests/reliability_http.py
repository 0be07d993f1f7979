"""A raw HTTP/1.1 chat client for the reliability scenarios: it can leave at any point (half a
body, before the answer, mid-stream), politely or with a reset."""
from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any


# --- a small HTTP/1.1 client on asyncio streams that can leave at any point ----------------------
class Cut(Exception):
    """The client left on purpose."""


async def _close(writer: asyncio.StreamWriter, rst: bool) -> None:
    if rst:   # an abrupt reset instead of a polite FIN
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
    writer.close()
    try:
        await writer.wait_closed()
    except (OSError, ConnectionError):
        pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]):
    if "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
        return
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    while chunk := await reader.read(65536):
        yield chunk


async def chat_raw(port: int, body: dict, headers: dict[str, str], *, mode: str = "complete",
                   cut_s: float = 0.0, cut_events: int = 0, rst: bool = False, timeout: float = 60.0) -> dict:
    """One chat request. mode: complete | partial_body | cut_early (send, wait cut_s, leave before
    reading anything) | mid_stream (leave after cut_events SSE events) | cut_nonstream (wait cut_s).
    Returns {"status", "usage" (what the client saw, when it read the whole answer), "cut"}."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
    out: dict[str, Any] = {"status": None, "usage": None, "cut": mode != "complete", "events": 0}
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if mode == "partial_body":
            writer.write(head + data[: len(data) // 2])
            await writer.drain()
            await asyncio.sleep(cut_s)
            return out
        writer.write(head + data)
        await writer.drain()
        if mode in ("cut_early", "cut_nonstream"):
            await asyncio.sleep(cut_s)
            return out
        status, resp_headers = await asyncio.wait_for(_read_head(reader), timeout)
        out["status"] = status
        buf = b""
        async for chunk in _body_chunks(reader, resp_headers):
            buf += chunk
            if mode == "mid_stream":
                out["events"] = buf.count(b"\n\n")
                if out["events"] >= cut_events:
                    return out
        if mode == "mid_stream":
            out["cut"] = False        # the stream ended before the cut point: it completed
        if status == 200 and body.get("stream"):
            for block in buf.decode().split("\n\n"):
                if block.startswith("data: {") and '"usage": {' in block:
                    out["usage"] = json.loads(block[6:])["usage"]
        elif status == 200:
            out["usage"] = json.loads(buf)["usage"]
        else:
            out["error"] = json.loads(buf)["error"]
        return out
    finally:
        await _close(writer, rst)
