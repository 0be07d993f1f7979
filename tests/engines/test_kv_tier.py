"""The second cache tier (tokenyard/engines/kv_transfer/tiered_store.py): evicted prefix blocks go to
host memory (LRU, bounded), then to disk (content-addressed files, bounded, checksummed), and come
back on a prefix hit with the same tokens; the disk tier is read back by a new engine (a restart)
and shared by replicas; a corrupted file is a miss, never used."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.engine_helpers import random_prompts
from tokenyard.engines import LLM, EngineConfig, SamplingParams
from tokenyard.engines.kv_transfer.block_payload import BlockRecord
from tokenyard.engines.kv_transfer.disk_tier import DiskTier
from tokenyard.engines.kv_transfer.host_tier import HostTier

ROOT = Path(__file__).resolve().parents[2]
DEMO_SMALL = ROOT / "tokenyard" / "models" / "demo-small"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, seed=0)
PROMPTS = random_prompts(6, 190, 200, 1962, seed=3)
BLOCK = 32768      # demo-small's fp32 block: 8 layers x K,V x 2 heads x 16 slots x 32 x 4 bytes
BLOCK_BYTES = {"auto": BLOCK, "int8": BLOCK * 36 // 128}    # int8: 32 codes + a 4-byte scale per head


def _rec(i: int, n: int = 100) -> BlockRecord:
    return BlockRecord.of(bytes([i]) * 16, bytes([i]) * n)


def test_host_tier_is_lru_bounded_and_spills_oldest_first():
    spilled: list[bytes] = []
    host = HostTier(300, spill=lambda r: spilled.append(r.digest))
    for i in range(3):
        host.put(_rec(i))
    assert host.get(bytes([0]) * 16) is not None        # 0 is now the most recent
    host.put(_rec(3))
    host.put(_rec(4))
    assert spilled == [bytes([1]) * 16, bytes([2]) * 16]
    assert host.used_bytes == 300 and len(host) == 3
    host.put(_rec(5, 400))                               # larger than the whole tier: straight out
    assert spilled[-1] == bytes([5]) * 16
    rec = host.get(bytes([3]) * 16)
    rec.data = b"x" + rec.data[1:]                       # a checksummed block that changed: a miss, dropped
    assert host.get(bytes([3]) * 16) is None and host.num_corrupt == 1
    dropped = HostTier(100)
    dropped.put(_rec(1))
    dropped.put(_rec(2))
    assert dropped.num_dropped == 1 and dropped.get(bytes([1]) * 16) is None


def test_disk_tier_bound_checksums_and_sharing(tmp_path):
    a = DiskTier(tmp_path, "fp", capacity_bytes=1000)
    b = DiskTier(tmp_path, "fp", capacity_bytes=1000)    # a second replica on the same host
    a.put(_rec(1))
    assert b.get(bytes([1]) * 16).data == bytes([1]) * 100
    assert DiskTier(tmp_path, "other", 1000).get(bytes([1]) * 16) is None    # another model/layout
    for i in range(2, 12):
        os.utime(a.path(bytes([1]) * 16), (0, 0)) if i == 2 else None
        a.put(_rec(i))
    files = list((tmp_path / "fp").glob("*.kvb"))
    assert sum(f.stat().st_size for f in files) <= 1000
    assert a.get(bytes([1]) * 16) is None                 # the least recently used went first
    assert a.get(bytes([11]) * 16) is not None
    path = a.path(bytes([11]) * 16)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert b.get(bytes([11]) * 16) is None and b.num_corrupt == 1 and not path.exists()
    assert not list((tmp_path / "fp").glob(".tmp-*"))     # atomic writes leave no temporary files


def _tier_llm(disk: Path | None, host_bytes: int, **kw) -> LLM:
    opts = dict(kv_offload_host_bytes=host_bytes, kv_offload_disk_bytes=64 << 20)
    if disk is not None:
        opts["kv_offload_disk_path"] = str(disk)
    # 32 blocks of 16 tokens: two 200-token prompts evict the first one's blocks.
    return LLM(DEMO_SMALL, kv_cache_memory=32 * BLOCK_BYTES[kw.get("kv_cache_dtype", "auto")], progress=False,
               **opts, **kw)


def _run(llm: LLM, prompts) -> tuple[list[list[int]], list[int]]:
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(DEMO_SMALL, kv_cache_memory=16 << 20, progress=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_evicted_blocks_come_back_from_host_tier(reference, kv):
    llm = _tier_llm(None, 64 << 20, kv_cache_dtype=kv)
    first, _ = _run(llm, PROMPTS)
    assert llm.engine.kv_tier.num_offloaded > 0
    again, cached = _run(llm, PROMPTS)
    assert cached == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
    assert llm.engine.kv_tier.num_restored > 0
    if kv == "auto":
        assert first == reference and again == reference
    else:
        assert again == first
    without = LLM(DEMO_SMALL, kv_cache_memory=32 * BLOCK_BYTES[kv], progress=False, kv_cache_dtype=kv)
    assert _run(without, PROMPTS)[1] == [0] * len(PROMPTS)      # the same pool alone loses them


def test_disk_tier_survives_a_restart_and_corruption_is_recomputed(tmp_path, reference):
    llm = _tier_llm(tmp_path, 2 * BLOCK)          # a tiny host tier: most blocks spill to disk
    assert _run(llm, PROMPTS)[0] == reference
    llm.close()                                   # drains the host tier to disk
    files = list(tmp_path.glob("*/*.kvb"))
    assert files
    fresh = _tier_llm(tmp_path, 0)                # a new engine instance: a restart
    tokens, cached = _run(fresh, PROMPTS[:2])
    assert tokens == reference[:2] and cached == [(len(p) - 1) // 16 * 16 for p in PROMPTS[:2]]
    assert fresh.engine.kv_tier.disk.num_hits > 0
    # Corrupt every file of prompt 3's chain: it is recomputed, with the same tokens.
    for f in tmp_path.glob("*/*.kvb"):
        raw = bytearray(f.read_bytes())
        raw[-3] ^= 0x55
        f.write_bytes(bytes(raw))
    third = _tier_llm(tmp_path, 0)
    tokens, cached = _run(third, PROMPTS[3:4])
    assert tokens == reference[3:4] and cached == [0]
    assert third.engine.kv_tier.disk.num_corrupt == 1


def test_tier_options_are_checked():
    with pytest.raises(ValueError, match="need enable_prefix_caching"):
        EngineConfig.from_options(dict(kv_offload_host_bytes=1 << 20, enable_prefix_caching=False))
    with pytest.raises(ValueError, match="kv_offload_host_bytes must be an integer"):
        EngineConfig.from_options(dict(kv_offload_host_bytes=-1))
    with pytest.raises(ValueError, match="kv_offload_disk_bytes must be > 0"):
        EngineConfig.from_options(dict(kv_offload_disk_path="/tmp/x", kv_offload_disk_bytes=0))
    assert not EngineConfig().kv_offload
