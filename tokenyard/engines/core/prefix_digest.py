"""Stable digests of prefix-cache blocks: the names KV blocks carry outside one engine process.

The block pool keys blocks by Python's hash() of (parent, tokens), which is fast but changes from
process to process (string hashing is salted) and is only 64 bits wide, so it can name a block
only inside the engine that made it, beside a full-key comparison. Blocks that leave the engine
(a hand-over to another engine, the host and disk tiers of evicted blocks, files shared by
replicas) need a name that every process computes alike and that never collides in practice:
a 128-bit BLAKE2b chain over the same ingredients. The root is the repr of the block manager's
chain root (BlockManager.chain_root: the cache salt today, anything folded into it later), so
whatever keeps two prefixes apart in the pool keeps them apart here too.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Sequence

DIGEST_SIZE = 16


def root_digest(root: Hashable) -> bytes:
    """The digest a chain starts from: the chain root's repr (str, int, None and tuples of them
    have a repr that is the same in every process)."""
    return hashlib.blake2b(b"tokenyard-kv-root\0" + repr(root).encode(), digest_size=DIGEST_SIZE).digest()


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's digest: its parent's digest and its token ids (little-endian int64)."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=DIGEST_SIZE).digest()


def chain_digests(root: Hashable, token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[bytes]:
    """The digests of the first num_blocks full blocks of token_ids under root."""
    out: list[bytes] = []
    d = root_digest(root)
    for i in range(num_blocks):
        d = block_digest(d, token_ids[i * block_size:(i + 1) * block_size])
        out.append(d)
    return out
