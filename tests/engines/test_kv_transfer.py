"""KV hand-over between engines (tokenyard/engines/kv_transfer): an exported prefix imported into a
second engine gives the same greedy tokens as one engine alone (fp32 and int8 KV), a payload from
another layout is refused by name, a corrupted block is refused and recomputed, and the shared-
memory and TCP transports carry a payload whole or fail fast."""
from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path

import pytest

from tests.engine_helpers import random_prompts
from tokenyard.engines import LLM, SamplingParams
from tokenyard.engines.kv_transfer.block_payload import BlockPayload, PayloadError
from tokenyard.engines.kv_transfer.connector import KVConnector
from tokenyard.engines.kv_transfer.frames import HEAD, MAGIC, FrameError, encode_frame
from tokenyard.engines.kv_transfer.layout import KVLayoutMismatch
from tokenyard.engines.kv_transfer.shm_transport import ShmTransport
from tokenyard.engines.kv_transfer.tcp_transport import KVReceiver, TransferError, send_payload

ROOT = Path(__file__).resolve().parents[2]
DEMO_SMALL = ROOT / "tokenyard" / "models" / "demo-small"
# seed set: the prompt's prefill stops at the cacheable boundary, so cold and warm runs compute the
# same chunks (scheduler._chunk_len) and any difference would come from the handed-over bytes.
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=0)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, seed=0)
PROMPTS = random_prompts(4, 90, 260, 1962, seed=5)


def _llm(**kw) -> LLM:
    return LLM(DEMO_SMALL, kv_cache_memory=8 << 20, progress=False, **kw)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_handover_gives_the_tokens_of_one_engine(kv):
    want = _tokens(_llm(kv_cache_dtype=kv), PROMPTS)
    prefill, decode = _llm(kv_cache_dtype=kv), _llm(kv_cache_dtype=kv)
    sender, receiver = KVConnector(prefill.engine), KVConnector(decode.engine)
    prefill.generate(PROMPTS, PREFILL, use_tqdm=False)
    for p in PROMPTS:
        payload = BlockPayload.from_bytes(sender.export_prefix(p).to_bytes())
        assert payload.layout.scales == (kv == "int8")
        assert len(payload.blocks) == (len(p) - 1) // 16
        res = receiver.import_payload(payload)
        assert res.rejected_at is None and res.num_imported == len(payload.blocks)
    outs = decode.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
    # Importing again finds the blocks already there and rewrites nothing.
    again = receiver.import_payload(sender.export_prefix(PROMPTS[0]))
    assert again.num_imported == 0 and again.num_present == (len(PROMPTS[0]) - 1) // 16


def test_layout_or_model_mismatch_is_a_clear_error():
    src = _llm()
    src.generate(PROMPTS[:1], PREFILL, use_tqdm=False)
    payload = KVConnector(src.engine).export_prefix(PROMPTS[0])
    with pytest.raises(KVLayoutMismatch, match="block_size: 16 != 8"):
        KVConnector(_llm(block_size=8).engine).import_payload(payload)
    with pytest.raises(KVLayoutMismatch, match="kv_dtype: 'float32' != 'int8'"):
        KVConnector(_llm(kv_cache_dtype="int8").engine).import_payload(payload)
    other = BlockPayload.from_bytes(payload.to_bytes())
    other.layout = type(other.layout)(**{**other.layout.to_dict(), "model": "0" * 32})
    with pytest.raises(KVLayoutMismatch, match="model: "):
        KVConnector(src.engine).import_payload(other)


def test_corrupted_block_is_refused_and_recomputed():
    src, dst = _llm(), _llm()
    prompt = PROMPTS[2]
    want = _tokens(_llm(), [prompt])
    src.generate([prompt], PREFILL, use_tqdm=False)
    payload = KVConnector(src.engine).export_prefix(prompt)
    bad = bytearray(payload.blocks[3].data)
    bad[100] ^= 0xFF
    payload.blocks[3].data = bytes(bad)
    res = KVConnector(dst.engine).import_payload(payload)
    assert (res.num_imported, res.rejected_at) == (3, 3) and "checksum" in res.reason
    out = dst.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want[0]
    assert out.num_cached_tokens == 3 * 16          # the rest was computed, not read
    # A block whose digest does not match its tokens (another prefix's block) is refused too.
    payload2 = KVConnector(src.engine).export_prefix(prompt)
    payload2.token_ids[16] += 1
    res2 = KVConnector(_llm().engine).import_payload(payload2)
    assert res2.rejected_at == 1 and "digest" in res2.reason


def test_payload_parse_errors():
    src = _llm()
    src.generate(PROMPTS[:1], PREFILL, use_tqdm=False)
    raw = KVConnector(src.engine).export_prefix(PROMPTS[0]).to_bytes()
    with pytest.raises(PayloadError, match="truncated"):
        BlockPayload.from_bytes(raw[:-10])
    with pytest.raises(PayloadError, match="not a KV payload"):
        BlockPayload.from_bytes(b"x" * 64)


def _payload() -> BlockPayload:
    src = _llm()
    src.generate(PROMPTS[:1], PREFILL, use_tqdm=False)
    return KVConnector(src.engine).export_prefix(PROMPTS[0])


def test_shm_transport_round_trip_and_bad_frames(tmp_path):
    payload = _payload()
    shm = ShmTransport()                       # /dev/shm where there is one
    handle = shm.send(payload)
    got = shm.receive(handle)
    assert got.to_bytes() == payload.to_bytes()
    assert not (shm.dir / f"{handle}.kvframe").exists()      # taken once
    local = ShmTransport(tmp_path)
    h = local.send(payload)
    path = tmp_path / f"{h}.kvframe"
    path.write_bytes(path.read_bytes()[:-5])                  # truncated
    with pytest.raises(FrameError, match="truncated"):
        local.receive(h)
    with pytest.raises(TimeoutError):
        local.receive("0" * 32, timeout_s=0.05)
    with pytest.raises(FrameError, match="handle"):
        local.receive("../etc/passwd")


def test_tcp_transport_round_trip_truncation_and_timeouts():
    payload = _payload()
    got: list[BlockPayload] = []

    async def handler(p: BlockPayload) -> dict:
        got.append(p)
        return {"imported": len(p.blocks)}

    async def main() -> None:
        rx = await KVReceiver(handler, timeout_s=0.5).start()
        try:
            reply = await send_payload("127.0.0.1", rx.port, payload, timeout_s=5)
            assert reply == {"ok": True, "imported": len(payload.blocks)}
            assert got[0].to_bytes() == payload.to_bytes()
            # A frame cut short (the sender dies mid-frame): refused at once, nothing handed on.
            body = payload.to_bytes()
            r, w = await asyncio.open_connection("127.0.0.1", rx.port)
            w.write(encode_frame(body)[:HEAD.size + 100])
            await w.drain()
            w.write_eof()
            await asyncio.wait_for(r.read(), 2)
            w.close()
            assert "truncated" in rx.errors[-1]
            # A sender that stalls mid-frame with the connection open: refused after the timeout.
            r, w = await asyncio.open_connection("127.0.0.1", rx.port)
            w.write(struct.pack("<4sQI", MAGIC, 1000, 0) + b"x" * 10)
            await w.drain()
            await asyncio.wait_for(r.read(), 2)
            w.close()
            assert "within 0.5 s" in rx.errors[-1]
            assert len(got) == 1
        finally:
            await rx.close()
        # A receiver that never answers: the sender's timeout, not a hang.
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        try:
            with pytest.raises(TransferError, match="failed: no complete frame within 0.3 s"):
                await send_payload("127.0.0.1", silent.getsockname()[1], b"abc", timeout_s=0.3)
        finally:
            silent.close()

    asyncio.run(main())
