"""The C decode step's projections kept in the prepared-weights cache (formats/prepared_cache.py).

Describing a model to the C step costs seconds for an int4 model: torch's packed int4 codes are
decoded back, reordered into the kernel's group order and, on AVX-512 VNNI builds, into 16-row
blocks (native_decoder.step_linear, cpu_decode_step.Library.prepare). The result is a pure
function of the model's weights and the library's build, so it is cached beside the weights:
keyed by the model's own cache key (`weights_cache_key`, set when the weights came through the
cache: prepared_model.py) and the library's file name (a hash of its sources, flags and the CPU).
Models without that key (cache off, float checkpoints) are described as before. Code that changes
a model's weights after loading it (and before the C step is built) must delete that attribute, or
the step would be described from the cached, unchanged weights.

Each projection's tensors are stored unless they are the model's own (the int8 LM head's codes,
fp32 biases): those are recorded by name and taken from the model when restored, so they stay
shared (the huge-page arena then holds them once). Sizes are checked against each form before a
pointer reaches C; anything that does not fit is a bad entry (removed; the step is described anew).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from tokenyard.engines.formats import prepared_cache
from tokenyard.kernels.cpu_decode_step import F32, INT4, INT4_ROWS16, INT8, Library, StepLinear, StepModel, linear_slots

log = logging.getLogger(__name__)

KIND = "native-step"
FORMAT = 1
_FIELDS = ("w", "scale", "minv", "bias")


def _key(lib: Library, model: nn.Module) -> str | None:
    weights = getattr(model, "weights_cache_key", None)
    if weights is None or prepared_cache.cache_dir() is None:
        return None
    return prepared_cache.make_key(KIND, {"weights": weights, "library": lib.path.name, "rows16": lib.int4_rows16,
                                          "format": FORMAT})


def _slot_names(spec: StepModel) -> list[str]:
    return ["lm_head"] + [f"layers.{i}.{n}" for i in range(len(spec.layers)) for n in ("qkv", "o", "gate_up", "down")]


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def _ident(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype


def save_linears(lib: Library, model: nn.Module, spec: StepModel) -> None:
    """Store `spec`'s (prepared) projections for the next start; nothing when the model has no key."""
    key = _key(lib, model)
    if key is None:
        return
    own = {_ident(t): name for name, t in _model_tensors(model).items()}
    tensors: dict[str, torch.Tensor] = {}
    slots = {}
    for slot, (obj, attr) in zip(_slot_names(spec), linear_slots(spec)):
        lin: StepLinear = getattr(obj, attr)
        fields = {}
        for f in _FIELDS:
            t = getattr(lin, f)
            if t is None:
                continue
            alias = own.get(_ident(t))
            if alias is not None:
                fields[f] = {"model": alias}
            else:
                tensors[f"{slot}.{f}"] = t
                fields[f] = {"stored": f"{slot}.{f}"}
        slots[slot] = {"kind": lin.kind, "n": lin.n, "k": lin.k, "group": lin.group, "fields": fields}
    prepared_cache.store(KIND, key, tensors, {"format": FORMAT, "slots": slots})


def load_linears(lib: Library, model: nn.Module) -> dict[str, StepLinear] | None:
    """slot -> StepLinear (prepared as `lib` reads it) from the cache, or None."""
    key = _key(lib, model)
    if key is None:
        return None
    entry = prepared_cache.load(KIND, key)
    if entry is None:
        return None
    try:
        return _linears(entry, model)
    except (KeyError, ValueError, TypeError) as exc:
        log.warning("prepared-weights cache: %s does not fit the model (%s); rebuilding it", entry.path, exc)
        entry.path.unlink(missing_ok=True)
        return None


def _linears(entry: prepared_cache.Entry, model: nn.Module) -> dict[str, StepLinear]:
    if entry.meta.get("format") != FORMAT:
        raise ValueError(f"meta format {entry.meta.get('format')}, expected {FORMAT}")
    own = _model_tensors(model)
    layers = len(model.layers)
    expected = ["lm_head"] + [f"layers.{i}.{n}" for i in range(layers) for n in ("qkv", "o", "gate_up", "down")]
    slots = entry.meta["slots"]
    if sorted(slots) != sorted(expected):
        raise ValueError(f"{len(slots)} projections cached, the model has {len(expected)}")
    out = {}
    for slot in expected:
        d = slots[slot]
        got: dict[str, torch.Tensor | None] = {f: None for f in _FIELDS}
        for f, src in d["fields"].items():
            got[f] = own[src["model"]] if "model" in src else entry.tensors[src["stored"]]
        lin = StepLinear(int(d["kind"]), int(d["n"]), int(d["k"]), got["w"], got["scale"], got["minv"], got["bias"],
                         int(d["group"]))
        _check(slot, lin)
        out[slot] = lin
    return out


def _check(slot: str, lin: StepLinear) -> None:
    """Every size the C side will read through these pointers, against the form's layout."""
    n, k, g = lin.n, lin.k, lin.group
    w = lin.w
    if w is None or not w.is_contiguous():
        raise ValueError(f"{slot}: no contiguous weight")
    if lin.kind == F32:
        want = [(w, torch.float32, n * k)]
    elif lin.kind == INT8:
        want = [(w, torch.int8, n * k), (lin.scale, torch.float32, n)]
    elif lin.kind in (INT4, INT4_ROWS16):
        if g <= 0 or k % g:
            raise ValueError(f"{slot}: group {g} does not divide K={k}")
        side = torch.float32 if lin.kind == INT4 else torch.float16
        want = [(w, torch.uint8, n * k // 2), (lin.scale, side, n * (k // g)), (lin.minv, side, n * (k // g))]
    else:
        raise ValueError(f"{slot}: unknown kind {lin.kind}")
    if lin.bias is not None:
        want.append((lin.bias, torch.float32, n))
    for t, dtype, numel in want:
        if t is None or t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
            raise ValueError(f"{slot}: a tensor is not {dtype} x {numel}")
