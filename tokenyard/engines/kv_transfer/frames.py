"""Length-prefixed, checksummed frames: how a KV payload crosses a process or host boundary.

    magic "TYKF" | u64 body length | u32 CRC-32 of the body | body

A frame whose length or CRC does not match its body is refused (FrameError), never handed on: a
truncated transfer is an error for the sender to retry, not a half-written block.
"""
from __future__ import annotations

import struct

from tokenyard.engines.kv_transfer.block_payload import crc32

MAGIC = b"TYKF"
HEAD = struct.Struct("<4sQI")
MAX_FRAME_BYTES = 8 << 30


class FrameError(ValueError):
    """A frame that is truncated, oversized, not a frame, or whose checksum does not match."""


def encode_frame(body: bytes) -> bytes:
    return HEAD.pack(MAGIC, len(body), crc32(body)) + body


def parse_head(head: bytes, max_bytes: int = MAX_FRAME_BYTES) -> tuple[int, int]:
    """(body length, CRC) from a frame's first HEAD.size bytes."""
    if len(head) < HEAD.size:
        raise FrameError(f"frame truncated in its header ({len(head)} of {HEAD.size} bytes)")
    magic, length, crc = HEAD.unpack_from(head)
    if magic != MAGIC:
        raise FrameError(f"not a KV frame (magic {magic!r})")
    if length > max_bytes:
        raise FrameError(f"frame of {length} bytes is over the limit of {max_bytes}")
    return length, crc


def check_body(body: bytes, length: int, crc: int) -> bytes:
    if len(body) != length:
        raise FrameError(f"frame truncated: {len(body)} of {length} body bytes")
    if crc32(body) != crc:
        raise FrameError("frame checksum mismatch (corrupted in transit)")
    return body


def decode_frame(raw: bytes, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    length, crc = parse_head(raw[:HEAD.size], max_bytes)
    return check_body(raw[HEAD.size:], length, crc)
