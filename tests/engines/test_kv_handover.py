"""The replica side of disaggregated serving (engines/serving/kv_handover.py), in process: a prefill
handover exports what a decode handover imports piece by piece (the pieces interleave with steps),
the decode engine then gives one engine's tokens; a corrupted block ends the import there; a
replica of the wrong kind is refused with a clear error."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.engine_helpers import random_prompts
from tokenyard.engines import LLM, SamplingParams
from tokenyard.engines.runtime.async_engine import AsyncEngine
from tokenyard.engines.serving import kv_handover
from tokenyard.engines.serving.kv_handover import KVHandover, check_role

ROOT = Path(__file__).resolve().parents[2]
DEMO_SMALL = ROOT / "tokenyard" / "models" / "demo-small"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, seed=0)
PROMPT = random_prompts(1, 200, 200, 1962, seed=3)[0]


def _llm(**kw) -> LLM:
    return LLM(DEMO_SMALL, kv_cache_memory=8 << 20, progress=False, **kw)


async def _generate(engine: AsyncEngine, rid: str, prompt: list[int]) -> list[int]:
    stream = engine.add_request(rid, prompt, GREEDY)
    tokens = []
    async for out in stream:
        tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_import_in_pieces_gives_the_tokens_of_one_engine(monkeypatch, tmp_path, kv):
    want = _llm(kv_cache_dtype=kv).generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    pre_llm, dec_llm = _llm(kv_cache_dtype=kv), _llm(kv_cache_dtype=kv)
    monkeypatch.setattr(kv_handover, "IMPORT_CHUNK_BYTES", 1)    # one block per piece

    async def run():
        pre, dec = AsyncEngine(pre_llm.engine, "p"), AsyncEngine(dec_llm.engine, "d")
        await pre.start()
        await dec.start()
        try:
            hp, hd = KVHandover(pre, "prefill", str(tmp_path)), KVHandover(dec, "decode", str(tmp_path))
            hp.check_engine()
            reply = await hp.prefill("r", PROMPT, None, "shm")
            assert reply["num_blocks"] == (len(PROMPT) - 1) // 16 and reply["handle"]
            res = await hd.import_handle(reply["handle"])
            return res, await _generate(dec, "r", PROMPT), hd.stats(), dec.stats()
        finally:
            await pre.stop()
            await dec.stop()

    res, tokens, stats, dstats = asyncio.run(run())
    n = (len(PROMPT) - 1) // 16
    assert res == {"num_blocks": n, "num_imported": n, "num_present": 0, "rejected_at": None, "reason": None}
    assert tokens == want
    assert stats["kv_imported_blocks"] == n and stats["kv_import_failures"] == 0
    assert dstats.prefix_cache_hit_tokens == n * 16


def test_corrupted_block_ends_the_import_and_a_lost_handle_is_recomputed(tmp_path):
    pre_llm, dec_llm = _llm(), _llm()

    async def run():
        pre, dec = AsyncEngine(pre_llm.engine, "p"), AsyncEngine(dec_llm.engine, "d")
        await pre.start()
        await dec.start()
        try:
            hp, hd = KVHandover(pre, "prefill", str(tmp_path)), KVHandover(dec, "decode", str(tmp_path))
            await hp.prefill("r", PROMPT, None, "shm")
            payload = hp._connector().export_prefix(PROMPT)
            bad = bytearray(payload.blocks[4].data)
            bad[7] ^= 0x40
            payload.blocks[4].data = bytes(bad)
            res = await hd.import_payload(payload)
            lost = await hd.import_handle("0" * 32, timeout_s=0.1)
            return res, lost, hd.stats()
        finally:
            await pre.stop()
            await dec.stop()

    res, lost, stats = asyncio.run(run())
    assert res["num_imported"] == 4 and res["rejected_at"] == 4 and "checksum" in res["reason"]
    assert lost is None and stats["kv_import_failures"] == 1


def test_roles_and_engines_that_cannot_hand_over():
    assert check_role("decode") == "decode"
    with pytest.raises(ValueError, match="role must be one of"):
        check_role("encode")
    from tokenyard.engines.serving.mock_engine import MockConfig, MockEngine
    mock = AsyncEngine(MockEngine(DEMO_SMALL, MockConfig()), "m")
    with pytest.raises(ValueError, match="needs a torch engine"):
        KVHandover(mock, "prefill").check_engine()
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KVHandover(AsyncEngine(_llm(enable_prefix_caching=False).engine, "x"), "decode").check_engine()
