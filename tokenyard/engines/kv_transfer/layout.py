"""What a KV block's bytes mean: the model that computed them and how the cache lays them out.

Two engines can exchange blocks only when every field here is equal: the same weights (a blocks'
K/V are a function of the model's weights, quantisation and compute dtype), the same block size,
layer count, kv heads, head dim and storage dtype. `fingerprint` names the whole layout in file
names and frames; `mismatch` says which fields differ, for the error a refused import raises.

The model's identity is its config, the names and sizes of its weight files, its weight
quantisation and its compute dtype: cheap at start-up (no weights are hashed) and the same on
every replica that loads the same checkpoint. Two checkpoints whose config and file sizes agree
byte for byte but whose weights differ would pass; an operator who fine-tunes in place should
use a new folder name or a fresh disk-tier directory.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


class KVLayoutMismatch(ValueError):
    """Blocks made by another model or cache layout: they cannot be used here."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    model: str            # digest of the model identity (model_identity)
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str         # what the cache stores: float32, bfloat16, float16, int8, fp8_e4m3
    scales: bool          # int8 / fp8: one fp32 scale per (kv head, slot) travels with the codes

    @property
    def fingerprint(self) -> str:
        raw = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(raw, digest_size=16).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "KVLayout":
        names = {f.name for f in fields(cls)}
        if set(raw) != names:
            raise KVLayoutMismatch(f"KV layout record has fields {sorted(raw)}, expected {sorted(names)}")
        return cls(**raw)

    def mismatch(self, other: "KVLayout") -> list[str]:
        """'field: theirs != ours' for every field that differs."""
        return [f"{f.name}: {getattr(other, f.name)!r} != {getattr(self, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def check(self, other: "KVLayout") -> None:
        """Raise KVLayoutMismatch naming the differing fields (other = the blocks', self = ours)."""
        diff = self.mismatch(other)
        if diff:
            raise KVLayoutMismatch("KV blocks were made by another model or cache layout (blocks' != this "
                                   "engine's): " + "; ".join(diff))


def model_identity(model_dir: str | Path, config: dict[str, Any], quantization: str, group_size: int,
                   dtype: str) -> str:
    """A digest of the model: its parsed config, weight file names and sizes, quantisation, dtype."""
    path = Path(model_dir)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    ident = {"config": config, "files": [[p.name, p.stat().st_size] for p in files],
             "quantization": quantization, "group_size": group_size, "dtype": dtype}
    return hashlib.blake2b(json.dumps(ident, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()
