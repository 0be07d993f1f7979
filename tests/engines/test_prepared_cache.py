"""The prepared-weights cache (tokenyard/engines/formats/prepared_cache.py and its users): a hit gives
the same weights and greedy tokens as a cold load, a bad entry is rebuilt, the knob turns it off,
and the key follows the options. The suite runs with the cache off (tests/conftest.py); these
tests turn it on, each in a folder of its own."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.formats import prepared_cache as pc
from tokenyard.engines.quant import prepared_model
from tokenyard.engines.runtime.engine import Engine
from tokenyard.engines.weights.gguf_models import smollm2_path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo-small"
CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("TOKENYARD_WEIGHT_CACHE", "on")
    monkeypatch.setenv("TOKENYARD_WEIGHT_CACHE_DIR", str(d))
    return d


def _flip_byte(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


def _greedy(engine: Engine, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    out = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        toks: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                toks += o.new_token_ids
        out.append(toks)
    return out


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
            "f16": torch.randn(2, 2, generator=g).half(), "i8": torch.randint(-128, 127, (9,), dtype=torch.int8),
            "u8": torch.randint(0, 255, (4, 3), dtype=torch.uint8), "i32": torch.arange(5, dtype=torch.int32),
            "i64": torch.arange(3, dtype=torch.int64), "empty": torch.zeros(0, 4)}


# ------------------------------------------------------------------ the store

def test_round_trip_is_exact_and_a_safetensors_file(cache):
    tensors = _tensors()
    key = pc.make_key("t", {"x": 1})
    path = pc.store("t", key, tensors, {"hello": [1, 2]})
    assert path is not None and path.parent == cache and not list(cache.glob(".write-*"))
    entry = pc.load("t", key)
    assert entry is not None and entry.meta == {"hello": [1, 2]}
    assert entry.tensors.keys() == tensors.keys()
    for name, t in tensors.items():
        assert entry.tensors[name].dtype == t.dtype and torch.equal(entry.tensors[name], t), name
    from safetensors import safe_open  # the layout is plain safetensors: any reader opens it
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("bf16"), tensors["bf16"]) and torch.equal(f.get_tensor("i64"), tensors["i64"])


@pytest.mark.parametrize("damage", ["flip_data", "truncate", "garbage_header", "other_key"])
def test_a_bad_entry_is_removed_and_reported_never_served(cache, caplog, damage):
    tensors = {"w": torch.arange(1 << 20, dtype=torch.float32)}      # 4 MiB: several CRC chunks' worth
    key = pc.make_key("t", {"x": 1})
    path = pc.store("t", key, tensors, {})
    size = path.stat().st_size
    if damage == "flip_data":
        _flip_byte(path, size - 12345)
    elif damage == "truncate":
        os.truncate(path, size - 100)
    elif damage == "garbage_header":
        _flip_byte(path, 20)
    else:                                       # another entry's bytes under this name
        pc.store("t", pc.make_key("t", {"x": 2}), tensors, {}).replace(path)
    with caplog.at_level(logging.WARNING, logger="tokenyard.engines.formats.prepared_cache"):
        assert pc.load("t", key) is None
    assert "unusable" in caplog.text and not path.exists()


def test_the_knob_turns_it_off_and_moves_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENYARD_WEIGHT_CACHE", "off")
    monkeypatch.setenv("TOKENYARD_WEIGHT_CACHE_DIR", str(tmp_path / "c"))
    assert pc.cache_dir() is None
    assert pc.store("t", "k" * 64, {"a": torch.ones(2)}, {}) is None and pc.load("t", "k" * 64) is None
    assert prepared_model.model_key(DEMO, torch.float32, CPU, 64, "int8", 128) is None
    assert not (tmp_path / "c").exists()
    monkeypatch.delenv("TOKENYARD_WEIGHT_CACHE_DIR")
    monkeypatch.setenv("TOKENYARD_WEIGHT_CACHE", "on")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pc.cache_dir() == tmp_path / "xdg" / "tokenyard" / "weights"


def test_the_model_key_follows_options_and_content(cache, tmp_path):
    import shutil

    def key(model=DEMO, dtype=torch.float32, positions=64, mode="int8", group=128):
        return prepared_model.model_key(model, dtype, CPU, positions, mode, group)

    base = key()
    assert base is not None and base == key()
    assert len({base, key(mode="int4", group=32), key(mode="int4", group=64), key(dtype=torch.bfloat16),
                key(positions=128)}) == 5
    assert key(mode="none") is None                        # plain float folders are read as they are
    assert prepared_model.model_key(DEMO, torch.float32, torch.device("meta"), 64, "int8", 128) is None
    copy = tmp_path / "copy"
    shutil.copytree(DEMO, copy)
    same = key(copy)
    weights = next(copy.glob("*.safetensors"))
    _flip_byte(weights, weights.stat().st_size // 2)       # content changed (its mtime too)
    assert key(copy) != same


# ------------------------------------------------------------------ engines through the cache

def test_quantised_at_load_engine_hits_and_rebuilds_a_corrupt_entry(cache):
    opts = dict(quantization="int8", kv_cache_memory=8 << 20, progress=False, cpu_compile="off")
    prompts = [[1, 5, 9, 2], [7, 7, 3]]
    cold = Engine(DEMO, **opts)
    assert "quantise_pack" in cold.startup_phases.as_dict()
    want = _greedy(cold, prompts)
    (entry,) = cache.glob("model-*.safetensors")
    warm = Engine(DEMO, **opts)
    assert "quantise_pack" not in warm.startup_phases.as_dict()      # nothing quantised: read back
    a = {**dict(cold.model.named_parameters()), **dict(cold.model.named_buffers())}
    b = {**dict(warm.model.named_parameters()), **dict(warm.model.named_buffers())}
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert _greedy(warm, prompts) == want
    _flip_byte(entry, entry.stat().st_size // 2)
    again = Engine(DEMO, **opts)
    assert "quantise_pack" in again.startup_phases.as_dict()         # rebuilt, and stored anew
    assert _greedy(again, prompts) == want and entry.exists()


def test_smollm2_warm_start_gives_the_cold_start_tokens(cache):
    """The real Q4_1 file: the first engine repacks and stores (GGUF metadata, tokenizer, packed
    model, the C step's projections), the second reads them back; a corrupt C-step entry is
    rebuilt. Greedy tokens on two prompts are equal throughout."""
    opts = dict(kv_cache_memory=32 << 20, progress=False)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 2, 3, 4, 5, 6, 7, 8]]
    cold = Engine(smollm2_path(), **opts)
    assert cold.runner.native is not None                         # the C step, warmed up before ready
    assert "warm_up" in cold.startup_phases.as_dict()
    st = cold.stats()
    assert st.num_steps == 0 and st.output_tokens == 0 and cold.runner.num_native_steps == 0
    want = _greedy(cold, prompts)
    kinds = sorted(p.name.rsplit("-", 1)[0] for p in cache.iterdir())
    assert kinds == ["gguf-meta", "model", "native-step"], kinds
    warm = Engine(smollm2_path(), **opts)
    assert warm.model.weights_cache_key == cold.model.weights_cache_key
    # the torch copy of a projection is the mapped entry's (no repack), and equal to the cold one
    assert torch.equal(warm.model.layers[3].qkv_proj.packed, cold.model.layers[3].qkv_proj.packed)
    assert _greedy(warm, prompts) == want
    (native,) = cache.glob("native-step-*.safetensors")
    _flip_byte(native, native.stat().st_size - 999)
    again = Engine(smollm2_path(), **opts)
    assert _greedy(again, prompts) == want and native.exists()


def test_gguf_tokenizer_from_the_cache_encodes_as_the_file_does(cache, monkeypatch):
    from tokenyard.engines.text.tokenizer import Tokenizer

    texts = ["Hello, world! 12345 café naïve 日本語", "<|im_start|>user\nhi<|im_end|>\n", "  tabs\t\tand 3.14 "]
    built = Tokenizer.from_dir(smollm2_path())                      # a miss: built from the metadata, stored
    assert list(cache.glob("gguf-tokenizer-*.json"))
    cached = Tokenizer.from_dir(smollm2_path())
    monkeypatch.setenv("TOKENYARD_WEIGHT_CACHE", "off")
    plain = Tokenizer.from_dir(smollm2_path())
    for t in texts:
        ids = plain.encode(t)
        assert built.encode(t) == ids and cached.encode(t) == ids
        assert cached.encode(t, add_special_tokens=False) == plain.encode(t, add_special_tokens=False)
        assert cached.decode(ids) == plain.decode(ids)
