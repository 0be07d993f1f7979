"""A sequence's KV blocks as one self-describing message: what an export produces and an import
takes, whatever carries it (a shared-memory file, a TCP frame, later NIXL descriptors).

    magic "TYKVPAY1" | u32 header length | header (JSON) | block bytes, one block after another

The header holds the KVLayout (model fingerprint, block size, shapes, storage dtype, whether
scales travel), the cache salt, the prefix's token ids (block_size per block), and per block its
stable digest (prefix_digest.py) and CRC-32. An import recomputes each digest from the tokens and
the chain root and each CRC from the bytes; the first block that fails ends the chain there (the
rest of the prefix is recomputed by the receiving engine, never read from a bad block).
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from tokenyard.engines.kv_transfer.layout import KVLayout

MAGIC = b"TYKVPAY1"
_HEAD = struct.Struct("<8sI")
MAX_HEADER = 64 << 20


class PayloadError(ValueError):
    """A payload that cannot be parsed (truncated, wrong magic, inconsistent sizes)."""


def crc32(data: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


@dataclass(slots=True)
class BlockRecord:
    digest: bytes       # prefix_digest chain digest of this block
    data: Any           # BlockIO's bytes of the block (bytes or a uint8 numpy row)
    crc: int | None     # CRC-32 of data; None until it leaves the process (see checksum)

    @classmethod
    def of(cls, digest: bytes, data: Any) -> "BlockRecord":
        return cls(digest, data, crc32(data))

    def checksum(self) -> int:
        """The CRC-32, computed once. Blocks in the host tier get theirs only when written to disk
        or exported: in RAM they are trusted as the KV pool itself is (saves a pass over them)."""
        if self.crc is None:
            self.crc = crc32(self.data)
        return self.crc

    def intact(self) -> bool:
        return self.crc is None or crc32(self.data) == self.crc


@dataclass(slots=True)
class BlockPayload:
    layout: KVLayout
    cache_salt: str | None
    token_ids: list[int]                 # the prefix the blocks hold: len(blocks) * block_size tokens
    blocks: list[BlockRecord] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.layout.block_size

    def head(self, n: int) -> "BlockPayload":
        """The payload of its first n blocks (the same records, not copies)."""
        return BlockPayload(self.layout, self.cache_salt, self.token_ids[:n * self.layout.block_size], self.blocks[:n])

    def check_crcs(self) -> int | None:
        """Check every block's CRC here (off the engine's step thread) and mark the good ones trusted
        (crc None, as blocks in RAM are); the index of the first bad block, which keeps its CRC so
        the import refuses it there, else None."""
        for i, rec in enumerate(self.blocks):
            if not rec.intact():
                return i
            rec.crc = None
        return None

    def to_bytes(self) -> bytes:
        header = json.dumps({
            "layout": self.layout.to_dict(), "cache_salt": self.cache_salt, "token_ids": self.token_ids,
            "blocks": [{"digest": b.digest.hex(), "crc": b.checksum(), "nbytes": len(b.data)} for b in self.blocks],
        }).encode()
        return b"".join([_HEAD.pack(MAGIC, len(header)), header, *(memoryview(b.data) for b in self.blocks)])

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview) -> "BlockPayload":
        view = memoryview(raw)
        if len(view) < _HEAD.size:
            raise PayloadError(f"KV payload of {len(view)} bytes is shorter than its header")
        magic, hlen = _HEAD.unpack_from(view)
        if magic != MAGIC:
            raise PayloadError(f"not a KV payload (magic {bytes(magic)!r})")
        if hlen > MAX_HEADER or _HEAD.size + hlen > len(view):
            raise PayloadError(f"KV payload header of {hlen} bytes does not fit in {len(view)} bytes")
        try:
            head = json.loads(bytes(view[_HEAD.size:_HEAD.size + hlen]))
            layout = KVLayout.from_dict(head["layout"])
            metas = head["blocks"]
            token_ids = [int(t) for t in head["token_ids"]]
            salt = head["cache_salt"]
        except (ValueError, KeyError, TypeError) as exc:
            raise PayloadError(f"KV payload header is malformed: {exc}") from exc
        if len(token_ids) != len(metas) * layout.block_size:
            raise PayloadError(f"KV payload has {len(token_ids)} tokens for {len(metas)} blocks of "
                               f"{layout.block_size}")
        blocks, off = [], _HEAD.size + hlen
        for i, m in enumerate(metas):
            n = int(m["nbytes"])
            if off + n > len(view):
                raise PayloadError(f"KV payload is truncated in block {i} ({len(view)} bytes)")
            blocks.append(BlockRecord(bytes.fromhex(m["digest"]), bytes(view[off:off + n]), int(m["crc"])))
            off += n
        if off != len(view):
            raise PayloadError(f"KV payload has {len(view) - off} bytes past its last block")
        return cls(layout, salt, token_ids, blocks)
