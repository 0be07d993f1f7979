"""GET /favicon.ico: a small icon, without auth, so a browser's automatic request on every page
(the dashboard, the operator page) is not a 404 in the access log and the console.

The icon is a 16x16 PNG inside an ICO container, built once from code (no binary file in the
repository): a filled square in the dashboard's first chart colour. Cached by browsers for a day.
"""
from __future__ import annotations

import struct
import zlib

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

SIZE = 16
COLOUR = (0x4E, 0x79, 0xA7)        # PALETTE[0] of tokenyard/gateway/web/dashboard_view.py


def _png(size: int, rgb: tuple[int, int, int]) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    row = b"\x00" + bytes(rgb) * size                   # filter byte 0, then RGB pixels
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)   # 8-bit RGB, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(row * size))
            + chunk(b"IEND", b""))


def _ico(png: bytes, size: int) -> bytes:
    """ICONDIR (reserved 0, type 1 = icon, 1 image) + one ICONDIRENTRY pointing at the PNG."""
    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", size, size, 0, 0, 1, 32, len(png), 22) + png


ICON = _ico(_png(SIZE, COLOUR), SIZE)


async def favicon(request: Request) -> Response:
    return Response(ICON, media_type="image/x-icon", headers={"cache-control": "public, max-age=86400"})


def routes() -> list[Route]:
    return [Route("/favicon.ico", favicon, methods=["GET"])]
