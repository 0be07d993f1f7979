"""The KV connector: export a prefix's blocks from one engine, import them into another.

    conn = KVConnector(engine)
    payload = conn.export_prefix(prompt_ids, cache_salt)      # BlockPayload (block_payload.py)
    ... carry payload.to_bytes() (shm_transport, tcp_transport, ...) ...
    KVConnector(other).import_payload(BlockPayload.from_bytes(raw))

An export holds the prompt's cached full blocks (those a request with this prompt would hit:
every full block before its final token), with their stable digests and CRCs. An import checks
the layout (a model, layout or dtype mismatch raises KVLayoutMismatch naming the fields), then
each block's digest against the tokens and its CRC against its bytes, and puts the good chain
into the pool registered as prefix-cache blocks, so the next request with that prompt is
admitted with them computed. Blocks already cached are kept; the first bad block ends the chain
(what follows is recomputed, never read from it).

Both calls touch the block pool and the cache tensors: call them on the engine's step thread
(between steps: offline, or through AsyncEngine's executor), like step() itself. A single-process
engine only: under tensor or pipeline parallelism the KV lives in other processes.
`install_blocks` is the one way blocks come back into a pool; the second tier uses it too.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from tokenyard.engines.core.block_manager import BlockManager, PrefixHit
from tokenyard.engines.core.prefix_digest import chain_digests
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.core.sequence import Sequence
from tokenyard.engines.kv_transfer.block_io import BlockIO
from tokenyard.engines.kv_transfer.block_payload import BlockPayload, BlockRecord
from tokenyard.engines.kv_transfer.layout import KVLayout, model_identity
from tokenyard.engines.model import kv_cache

# The engine is typed loosely: runtime sits above this package (it builds the tier) and is not imported.
Engine = Any


@dataclass(slots=True)
class ImportResult:
    num_blocks: int          # blocks the payload offered
    num_imported: int        # written into the pool
    num_present: int         # already cached here (kept, not rewritten)
    rejected_at: int | None  # index of the first block refused (digest or CRC), else None
    reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_imported + self.num_present


def engine_layout(engine: Engine) -> KVLayout:
    cfg, mcfg = engine.config, engine.model_config
    store = kv_cache.kv_cache_dtype_name(cfg.kv_cache_dtype, engine.dtype)
    model = model_identity(engine.model_dir, asdict(mcfg), cfg.quantization, cfg.quant_group_size,
                           str(engine.dtype).removeprefix("torch."))
    return KVLayout(model=model, block_size=cfg.block_size, num_layers=mcfg.num_layers,
                    num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim, kv_dtype=store,
                    scales=cfg.kv_cache_dtype != "auto")


def engine_block_io(engine: Engine) -> BlockIO:
    cfg = engine.config
    if cfg.tensor_parallel_size > 1 or cfg.pipeline_parallel_size > 1 or not hasattr(engine.runner, "kv_caches"):
        raise ValueError("KV transfer and the second cache tier need a single-process engine "
                         "(tensor_parallel_size and pipeline_parallel_size 1)")
    if not cfg.enable_prefix_caching:
        raise ValueError("KV transfer and the second cache tier need enable_prefix_caching")
    return BlockIO(engine.runner.kv_caches, cfg.block_size)


def probe_sequence(token_ids: list[int], cache_salt: str | None) -> Sequence:
    """A sequence that is never scheduled, to walk the prefix cache with. One token past the
    prefix makes every full block of token_ids cacheable (match_prefix keeps the last token)."""
    return Sequence("kv-transfer-probe", list(token_ids) + [0], SamplingParams(), 0, 0, 0, frozenset(),
                    cache_salt=cache_salt)


def install_blocks(blocks: BlockManager, io: BlockIO, seq: Sequence, hit: PrefixHit, datas: list[bytes]) -> int:
    """Write datas as the blocks that follow `hit` in seq's chain and register them; extend hit.
    As many as the free list allows (allocating may evict other cached blocks). Returns how many."""
    pool = blocks.pool
    k = len(hit.blocks)
    for b in hit.blocks:       # hold the hit so allocating cannot evict it from under us
        pool.touch(b)
    try:
        m = min(len(datas), pool.num_free)
        if m <= 0:
            return 0
        new = pool.allocate(m)
        try:
            io.write(new, datas[:m])
        except BaseException:
            pool.release(new[::-1])
            raise
        # Register through the block manager itself, so the pool keys are the ones its own
        # requests compute (a copy of seq: every field that names the chain root comes along).
        tmp = replace(seq, block_table=hit.blocks + new, block_hashes=list(hit.hashes),
                      num_computed_tokens=(k + m) * blocks.block_size)
        blocks.cache_full_blocks(tmp)
        hit.blocks.extend(new)
        hit.hashes.extend(tmp.block_hashes[k:])
        return m
    finally:
        pool.release(hit.blocks[::-1])   # deepest first, so the chain's root is evicted last


class KVConnector:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.io = engine_block_io(engine)
        self.layout = engine_layout(engine)

    def export_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> BlockPayload:
        """The cached full blocks that start token_ids (before its last token), possibly none."""
        blocks = self.engine.blocks
        bs = blocks.block_size
        probe = probe_sequence(list(token_ids[:len(token_ids) - 1]), cache_salt)
        hit = blocks.match_prefix(probe)
        for b in hit.blocks:
            blocks.pool.touch(b)
        try:
            datas = self.io.read(hit.blocks)
        finally:
            blocks.pool.release(hit.blocks[::-1])
        k = len(hit.blocks)
        digests = chain_digests(blocks.chain_root(probe)[1], probe.token_ids, bs, k)
        return BlockPayload(self.layout, cache_salt, list(token_ids[:k * bs]),
                            [BlockRecord.of(d, data) for d, data in zip(digests, datas)])

    def import_payload(self, payload: BlockPayload) -> ImportResult:
        """Put a payload's verified blocks into this engine's prefix cache (KVLayoutMismatch when
        they were made by another model or layout)."""
        self.layout.check(payload.layout)
        blocks = self.engine.blocks
        bs = blocks.block_size
        n = len(payload.blocks)
        probe = probe_sequence(payload.token_ids, payload.cache_salt)
        digests = chain_digests(blocks.chain_root(probe)[1], probe.token_ids, bs, n)
        good, reason = n, None
        for i, (rec, want) in enumerate(zip(payload.blocks, digests)):
            if rec.digest != want:
                good, reason = i, f"block {i}: digest does not match its tokens"
                break
            if len(rec.data) != self.io.block_nbytes or not rec.intact():
                good, reason = i, f"block {i}: checksum mismatch (corrupted in transit)"
                break
        saved = blocks.prefix_loader
        blocks.prefix_loader = None     # what is cached here, not what a second tier could add
        try:
            hit = blocks.match_prefix(probe)
        finally:
            blocks.prefix_loader = saved
        present = min(len(hit.blocks), good)
        del hit.blocks[present:], hit.hashes[present:]
        imported = install_blocks(blocks, self.io, probe, hit, [r.data for r in payload.blocks[present:good]])
        return ImportResult(n, imported, present, None if reason is None else good, reason)
