"""Read a GGUF checkpoint (llama.cpp's single-file format) into the engine's `CausalLM`.

The file is parsed by the `gguf` package (the format's own library) and every quantised tensor
is dequantised by `gguf.quants.dequantize`, so the values are the ones llama.cpp means.

What is accepted:
- `general.architecture` llama (Llama 1-3, SmolLM2; Mistral is stored as llama by llama.cpp),
  mistral, or qwen2: the decoder shapes the safetensors loader serves. Anything else is refused
  by name.
- tensor types in `DEQUANTISED_TYPES` (float, the legacy 4/5/8-bit blocks and the K-quants that
  gguf can dequantise); any other type (IQ*, TQ*, ...) is refused naming the tensor and type.

Two conversions undo what llama.cpp's converter did:
- q/k projections of llama-architecture files were permuted from the half-rotation rotary layout
  of Hugging Face checkpoints to the interleaved one llama.cpp computes with; `unpermute_rows`
  puts the rows back (qwen2 files are stored unpermuted, since llama.cpp runs them half-rotated).
- Llama-3.1-style rope scaling is stored as a `rope_freqs.weight` tensor of per-frequency
  divisors, not as metadata; `apply_rope_factors` rebuilds the rotary tables with them.

Errors (missing file, wrong magic, truncated file, unknown architecture or tensor type, missing or
mis-shaped tensors) are `CheckpointError`s that name the file and the problem.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.formats import prepared_cache
from tokenyard.kernels.quant_layout import Int4Weight, pack_int4

GGUF_MAGIC = b"GGUF"
SUFFIX = ".gguf"
# GGUF architecture -> the Hugging Face class whose decoder shape the engine runs.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Architectures whose converter permuted q/k rows into llama.cpp's interleaved rotary layout.
PERMUTED_QK = ("llama", "mistral")
DEQUANTISED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                     "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
ROPE_FREQS = "rope_freqs.weight"
# Types whose blocks are the engine's int4 layout with group 32 as they are (only repacked):
# Q4_0 is w = d * (q - 8) (integer zero 8), Q4_1 is w = d * q + m (float minimum).
NATIVE_INT4_TYPES = ("Q4_0", "Q4_1")
BLOCK = 32  # elements per block of the legacy types

_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def is_gguf(path: str | Path) -> bool:
    """A path names a GGUF checkpoint when it is a file ending in .gguf (folders are HF checkpoints)."""
    p = Path(path)
    return p.suffix.lower() == SUFFIX and not p.is_dir()


def open_gguf(path: str | Path) -> Any:
    """A `gguf.GGUFReader` for the file, shared between the config, weight and tokenizer loaders.

    Parsing the metadata of a 50k-token vocabulary takes seconds, so readers are cached by
    (path, size, modification time): a rewritten file is read again.
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: no such GGUF file")
    st = p.stat()
    return _open_cached(str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> Any:
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # numpy/struct errors from deep in the parser: a cut or corrupt file
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from e
    for t in reader.tensors:  # a memmap slice past the end comes back short instead of failing
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(f"{path}: truncated GGUF file: tensor {t.name} ends at byte "
                                  f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader


_FOUR_BITS = ("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K")
_EIGHT_BITS = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


def _summary(path: str | Path) -> dict[str, Any] | None:
    """{"config": config_dict, "precision": stored_precision} from the prepared-weights cache
    (prepared_cache.py), computed and stored on a miss: parsing the metadata of a 49k-token
    vocabulary takes 1-2 s of a start. None when the cache is off or the file fails to parse (the
    callers then compute, and raise, as without a cache)."""
    if prepared_cache.cache_dir() is None or not Path(path).is_file():
        return None
    key = prepared_cache.make_key("gguf-meta", {"source": prepared_cache.source_identity(path)})
    hit = prepared_cache.load_json("gguf-meta", key)
    if isinstance(hit, dict) and {"config", "precision"} <= hit.keys():
        return hit
    try:
        value = {"config": _config_dict(path), "precision": _stored_precision(path)}
    except CheckpointError:
        return None
    prepared_cache.store_json("gguf-meta", key, value)
    return value


def stored_precision(path: str | Path) -> str:
    """How most of the file's layer weights are stored: "int4" (4-bit blocks or fewer), "int8"
    (5- to 8-bit blocks) or "none" (floats): the engine's `quantization: auto` serves it so."""
    summary = _summary(path)
    return str(summary["precision"]) if summary is not None else _stored_precision(path)


def _stored_precision(path: str | Path) -> str:
    counts = {"int4": 0, "int8": 0, "none": 0}
    for t in open_gguf(path).tensors:
        if not t.name.startswith("blk.") or len(t.shape) < 2:
            continue
        kind = t.tensor_type.name
        counts["int4" if kind in _FOUR_BITS else "int8" if kind in _EIGHT_BITS else "none"] += int(t.n_elements)
    return max(counts, key=lambda k: counts[k]) if any(counts.values()) else "none"


def metadata(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture(reader: Any, path: str | Path) -> str:
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(ARCHITECTURES)}")
    return arch


def _tensor(reader: Any, name: str) -> Any | None:
    return next((t for t in reader.tensors if t.name == name), None)


def config_dict(path: str | Path) -> dict[str, Any]:
    """The GGUF metadata (`{arch}.*` keys) as a config.json-shaped dict; ModelConfig.from_dir validates it."""
    summary = _summary(path)
    return dict(summary["config"]) if summary is not None else _config_dict(path)


def _config_dict(path: str | Path) -> dict[str, Any]:
    reader = open_gguf(path)
    arch = architecture(reader, path)
    hf_arch = ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(metadata(reader, "general.name", "")).lower():
        hf_arch = "MistralForCausalLM"  # llama.cpp writes Mistral as llama (no sliding window kept)

    def need(key: str) -> Any:
        value = metadata(reader, f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    embd = _tensor(reader, "token_embd.weight")
    if embd is None:
        raise CheckpointError(f"{path}: tensor token_embd.weight is missing")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(metadata(reader, f"{arch}.attention.key_length") or hidden // heads)
    rot_dim = metadata(reader, f"{arch}.rope.dimension_count")
    if rot_dim is not None and int(rot_dim) != head_dim:
        raise CheckpointError(f"{path}: partial rotary ({arch}.rope.dimension_count={rot_dim}, head size "
                              f"{head_dim}) is not supported")
    raw: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": int(embd.shape[1]),  # ne[1]: rows of the embedding, the authoritative count
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata(reader, f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(metadata(reader, f"{arch}.rope.freq_base") or 10000.0),
        "max_position_embeddings": int(metadata(reader, f"{arch}.context_length") or 2048),
        "tie_word_embeddings": _tensor(reader, "output.weight") is None,
        "rope_scaling": _rope_scaling(reader, arch, path),
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": [int(i) for i in dict.fromkeys(
            metadata(reader, f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id")) if i is not None],
    }
    return raw


def _rope_scaling(reader: Any, arch: str, path: str | Path) -> dict[str, Any] | None:
    kind = metadata(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(metadata(reader, f"{arch}.rope.scaling.factor"))}
    raise CheckpointError(f"{path}: rope scaling {kind!r} is not supported (none, linear, or rope_freqs factors)")


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> the Hugging Face name the safetensors loader uses (None if unknown)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def check_types(reader: Any, path: str | Path, allowed: tuple[str, ...] = DEQUANTISED_TYPES) -> None:
    bad = [(t.name, t.tensor_type.name) for t in reader.tensors if t.tensor_type.name not in allowed]
    if bad:
        shown = ", ".join(f"{n} ({k})" for n, k in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise CheckpointError(f"{path}: unsupported GGUF tensor type(s): {shown}; supported: {', '.join(allowed)}")


def logical_shape(t: Any) -> tuple[int, ...]:
    """Rows first, as PyTorch and Hugging Face write it (GGUF stores ne[0] = the row length first)."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def dequantize(t: Any) -> torch.Tensor:
    """The float32 values of one GGUF tensor, through gguf's own dequantisation."""
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(t.data, t.tensor_type)
    # A copy: float tensors come back as read-only views of the memory-mapped file.
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(logical_shape(t))


def int4_blocks(t: Any) -> Int4Weight:
    """A Q4_0 or Q4_1 tensor as an `Int4Weight` with group 32, holding the file's values as stored.

    A block is fp16 d (Q4_1: then fp16 m) and 16 bytes whose low nibbles are elements 0-15 and high
    nibbles elements 16-31; the engine packs neighbours (k, k + 1) into a byte, so only the nibbles
    move. Scales and minimums are the fp16 values widened to float32 (exact).
    """
    kind = t.tensor_type.name
    if kind not in NATIVE_INT4_TYPES:
        raise ValueError(f"tensor {t.name} is {kind}, not one of {NATIVE_INT4_TYPES}")
    n, k = logical_shape(t)
    head = 2 if kind == "Q4_0" else 4
    raw = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True)).reshape(n, k // BLOCK, head + BLOCK // 2)

    def fp16(lo: int) -> torch.Tensor:  # GGUF is little-endian, as every host torch runs on here
        return raw[..., lo:lo + 2].contiguous().view(torch.float16).reshape(n, k // BLOCK).float()

    qs = raw[..., head:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, k)
    if kind == "Q4_0":
        zeros = torch.full((n, k // BLOCK), 8, dtype=torch.uint8)
        return Int4Weight(pack_int4(q), fp16(0), zeros, BLOCK)
    return Int4Weight(pack_int4(q), fp16(0), None, BLOCK, mins=fp16(2))


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (per head: rows [0, 2, 4, ..., 1, 3, 5, ...] interleaved
    back into the half-rotation order). Works on weights [rows, K] and biases [rows]."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, -1).transpose(1, 2).reshape(w.shape)


def qk_heads(arch: str, cfg: Any, hf: str) -> int | None:
    """Heads to unpermute for a q/k tensor of a llama-architecture file, else None."""
    if arch not in PERMUTED_QK:
        return None
    if ".self_attn.q_proj." in hf:
        return cfg.num_heads
    if ".self_attn.k_proj." in hf:
        return cfg.num_kv_heads
    return None


def rope_factors(path: str | Path, cfg: Any) -> torch.Tensor | None:
    t = _tensor(open_gguf(path), ROPE_FREQS)
    if t is None:
        return None
    factors = dequantize(t).reshape(-1)
    if factors.numel() != cfg.head_dim // 2:
        raise CheckpointError(f"{path}: {ROPE_FREQS} has {factors.numel()} values, head size {cfg.head_dim} "
                              f"needs {cfg.head_dim // 2}")
    return factors


def apply_rope_factors(model: torch.nn.Module, cfg: Any, factors: torch.Tensor) -> None:
    """Rotary tables with inv_freq divided per frequency by `factors` (llama.cpp's rope_freqs)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv_freq = inv_freq / factors.float()
    rotary = model.rotary
    positions = rotary.cos.shape[0]
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).to(rotary.cos.device)
    rotary.cos, rotary.sin = emb.cos(), emb.sin()
