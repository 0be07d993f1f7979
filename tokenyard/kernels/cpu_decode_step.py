"""A whole decode step of a Llama-family decoder in C (cpu_decode_step.c), over plain tensors.

    spec = StepModel(..., layers=[StepLayer(...), ...], lm_head=StepLinear.f32(w))
    step = load().create(spec, max_batch=4, max_len=2048, threads=2)   # None from load(): no kernel
    logits = step.run(ids, positions, slots, seq_lens, tables)        # fp32 [B, vocab]
    step.close()

Why and what: see the C file's header. This module only describes the weights to the C side
(pointers into the tensors, which it keeps alive) and converts int4 weights into the kernel's
group order (`int4_gguf_order`); it knows nothing of engines (tokenyard/engines/model/native_decoder.py
builds the description from a model).

Threads: the step runs on `threads` threads, the caller's included; the others are the C pool's
own and spin for `spin_limit` pause instructions after a step before they sleep, so a decode loop
never waits for a wake-up while an idle engine costs no CPU. TOKENYARD_STEP_SPIN sets the default
(200,000; on a Zen 4 core a pause is about 64 cycles, so a few milliseconds of one core after each
step): lower it where the step shares its cores with other work between steps (a gateway's event
loop, torch's threads in a mixed step), since a spinning worker takes that core from them.

Build: nativelib (cached in ~/.cache/tokenyard/native), -O3 -march=native, reassociation allowed
(the vector dot products). TOKENYARD_NATIVE_MARCH
replaces -march=native (tests build an AVX2 and a plain x86-64 variant to check every vector path).
"""
from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenyard import knobs
from tokenyard.nativelib.build import cached_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode_step.c")
INCLUDES = tuple(Path(__file__).with_name(name) for name in
                 ("cpu_decode_attention.c", "cpu_matvec.c", "cpu_matvec_q8.c", "cpu_matvec_panel.c"))
MAX_BATCH = 256
DEFAULT_SPIN_LIMIT = knobs.DEFAULT_STEP_SPIN
F32, INT8, INT4, INT4_ROWS16 = 0, 1, 2, 3
_LOCK = threading.Lock()
_LOADED: dict[str, "Library | None"] = {}


def flags(int8_inputs: bool = True) -> tuple[str, ...]:
    """The compiler flags; int8_inputs False builds the variant whose int4 and int8 products keep fp32
    inputs at every batch (-DTY_Q8_INPUTS=0, cpu_matvec_q8.c; no 16-row int4 blocks either)."""
    march = knobs.native_march()
    return ("-O3", f"-march={march}", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
            "-fno-trapping-math", "-pthread", "-shared", "-fPIC") + (() if int8_inputs else ("-DTY_Q8_INPUTS=0",))


def default_spin_limit() -> int:
    """Pause instructions an idle pool worker spins before it sleeps: TOKENYARD_STEP_SPIN, else 200,000."""
    return knobs.step_spin()


# ------------------------------------------------------------------ the description

@dataclass(slots=True)
class StepLinear:
    """y = x @ W^T + bias for one projection, in one of the kernel's three weight forms."""
    kind: int
    n: int
    k: int
    w: torch.Tensor
    scale: torch.Tensor | None = None
    minv: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    group: int = 0

    @classmethod
    def f32(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "StepLinear":
        return cls(F32, w.shape[0], w.shape[1], _f32(w), bias=_opt_f32(bias))

    @classmethod
    def int8(cls, w_q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> "StepLinear":
        """w = w_q[n, k] * scales[n]."""
        if w_q.dtype != torch.int8:
            raise ValueError(f"int8 weight expected, got {w_q.dtype}")
        return cls(INT8, w_q.shape[0], w_q.shape[1], w_q.contiguous(), scale=_f32(scales), bias=_opt_f32(bias))

    @classmethod
    def int4(cls, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
             bias: torch.Tensor | None = None) -> "StepLinear":
        """w = q * scale + min, q: values in [0, 15] as [n, k] (any integer dtype), scales and mins
        [n, k / group]. Packed here into the kernel's order (a copy: 0.5 byte a weight)."""
        n, k = q.shape
        if group % 32 or k % group:
            raise ValueError(f"int4 groups must be multiples of 32 dividing K={k}, got {group}")
        return cls(INT4, n, k, int4_gguf_order(q), scale=_f32(scales), minv=_f32(mins), bias=_opt_f32(bias),
                   group=group)


def int4_rows16(lin: StepLinear) -> StepLinear:
    """An int4 projection (n a multiple of 16) in the kernel's 16-row blocks (cpu_matvec_q8.c, TY_INT4R16):
    per 16 rows and 32-block, [h 4][row 16][i 4] of the rows' GGUF-order bytes (byte 4h + i); scales
    and minimums per 16 rows and group as 16 fp16 values, one per row. A copy; `lin` is left as it was."""
    n, k, g = lin.n, lin.k, lin.group
    if lin.kind != INT4 or n % 16:
        raise ValueError(f"16-row blocks need an int4 weight with a multiple of 16 rows, got kind {lin.kind}, n={n}")
    groups, blocks, ng = n // 16, k // 32, k // g
    w = lin.w.reshape(groups, 16, blocks, 4, 4).permute(0, 2, 3, 1, 4).contiguous().reshape(n, k // 2)

    def by_row(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(groups, 16, ng).transpose(1, 2).to(torch.float16).contiguous().reshape(n, ng)
    return StepLinear(INT4_ROWS16, n, k, w, scale=by_row(lin.scale), minv=by_row(lin.minv), bias=lin.bias, group=g)


def fp16_carries(lin: StepLinear) -> bool:
    """Whether fp16 holds this int4 projection's scales to 11 bits (normal fp16: 2^-14 <= |s| <= 65504;
    GGUF's Q4_0/Q4_1 scales are fp16 already, torch's packed ones bf16) and its minimums in range
    (a minimum below 2^-14 keeps an absolute error under 2^-25)."""
    s, m = lin.scale.abs(), lin.minv.abs()
    return bool(((s == 0) | ((s >= 2.0 ** -14) & (s <= 65504.0))).all()) and bool((m <= 65504.0).all())


def int4_gguf_order(q: torch.Tensor) -> torch.Tensor:
    """q [n, k] in [0, 15] -> uint8 [n, k / 2]: per 32 weights, byte j holds weight j (low nibble)
    and weight j + 16 (high nibble)."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


@dataclass(slots=True)
class StepLayer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: StepLinear          # [q + 2 kv, hidden]: q heads, then k heads, then v heads
    o: StepLinear
    gate_up: StepLinear      # [2 * inter, hidden]: gate rows, then up rows
    down: StepLinear
    k_cache: torch.Tensor    # fp32 [kv_heads, slots, head_dim], written in place
    v_cache: torch.Tensor


@dataclass(slots=True)
class StepModel:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    block_size: int
    eps: float
    scale: float
    embed: torch.Tensor      # fp32 [vocab, hidden]
    final_norm: torch.Tensor
    cos: torch.Tensor        # fp32 [positions, head_dim] (half-rotation tables)
    sin: torch.Tensor
    lm_head: StepLinear
    layers: list[StepLayer] = field(default_factory=list)
    sliding_window: int | None = None


def linear_slots(spec: StepModel) -> list[tuple[object, str]]:
    """(object, attribute) of every projection of `spec`: the LM head, then each layer's four."""
    return [(spec, "lm_head")] + [(layer, name) for layer in spec.layers for name in ("qkv", "o", "gate_up", "down")]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


def _opt_f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _f32(t)


# ------------------------------------------------------------------ ctypes mirror of the C structs

_i64, _ptr, _f = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _CLinear(ctypes.Structure):
    _fields_ = [("kind", _i64), ("n", _i64), ("k", _i64), ("group", _i64), ("w", _ptr), ("scale", _ptr),
                ("minv", _ptr), ("bias", _ptr)]


class _CLayer(ctypes.Structure):
    _fields_ = [("in_norm", _ptr), ("post_norm", _ptr), ("qkv", _CLinear), ("o", _CLinear),
                ("gate_up", _CLinear), ("down", _CLinear), ("k_cache", _ptr), ("v_cache", _ptr)]


class _CModel(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("n_layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab",
                                          "slots", "block_size", "max_batch", "max_len", "sliding_window")] + \
               [("eps", _f), ("scale", _f), ("embed", _ptr), ("final_norm", _ptr), ("cos", _ptr), ("sin", _ptr),
                ("lm_head", _CLinear), ("layers", ctypes.POINTER(_CLayer))]


class _CJob(ctypes.Structure):
    _fields_ = [("batch", _i64), ("width", _i64), ("ids", _ptr), ("positions", _ptr), ("slots", _ptr),
                ("seq_lens", _ptr), ("tables", _ptr), ("logits", _ptr)]


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _c_linear(lin: StepLinear) -> _CLinear:
    return _CLinear(lin.kind, lin.n, lin.k, lin.group, _ptr_of(lin.w), _ptr_of(lin.scale), _ptr_of(lin.minv),
                    _ptr_of(lin.bias))


# ------------------------------------------------------------------ the library and a step

class Library:
    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        lib.tokenyard_step_create.argtypes = [ctypes.POINTER(_CModel), ctypes.c_int, ctypes.c_long]
        lib.tokenyard_step_create.restype = ctypes.c_void_p
        lib.tokenyard_step_run.argtypes = [ctypes.c_void_p, ctypes.POINTER(_CJob)]
        lib.tokenyard_step_run.restype = ctypes.c_int
        lib.tokenyard_step_destroy.argtypes = [ctypes.c_void_p]
        lib.tokenyard_step_destroy.restype = None
        lib.tokenyard_matvec.argtypes = [ctypes.POINTER(_CLinear), _ptr, _i64, _i64, _i64, _i64, _ptr, _i64,
                                         ctypes.c_int]
        lib.tokenyard_matvec.restype = ctypes.c_int
        lib.tokenyard_int8_inputs.restype = ctypes.c_int
        # int4 and int8 products of fewer than 8 tokens (k a multiple of 32) round their inputs to int8
        # per 32-block on AVX2 and AVX-512 builds (cpu_matvec.c says why); fp32 products keep fp32 inputs
        self.int8_inputs = bool(lib.tokenyard_int8_inputs())
        lib.tokenyard_int4_rows16.restype = ctypes.c_int
        # int4 weights with rows in sixteens are read in 16-row blocks on AVX-512 VNNI builds (prepare)
        self.int4_rows16 = bool(lib.tokenyard_int4_rows16())
        self.lib = lib
        self.path = path

    def prepare(self, lin: StepLinear) -> StepLinear:
        """`lin` in the form this build reads fastest: int4 with rows in sixteens in 16-row blocks with fp16
        scales where the build has them and fp16 carries the scales (a copy), anything else as it is."""
        if lin.kind == INT4 and self.int4_rows16 and lin.n % 16 == 0 and fp16_carries(lin):
            return int4_rows16(lin)
        return lin

    def prepare_model(self, spec: StepModel) -> StepModel:
        """`spec` with every projection `prepare`d (in place; also returned)."""
        for obj, name in linear_slots(spec):
            setattr(obj, name, self.prepare(getattr(obj, name)))
        return spec

    def matvec(self, lin: StepLinear, x: torch.Tensor, rows: tuple[int, int] | None = None,
               out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """x [B, k] @ W^T (+ bias) for output rows `rows` (default all) with the step's own kernel,
        into `out` [B, n] (new when None; with accumulate the products are added to it)."""
        r0, r1 = rows or (0, lin.n)
        x = _f32(x)
        if x.dim() != 2 or x.shape[1] != lin.k:
            raise ValueError(f"x must be [batch, {lin.k}], got {tuple(x.shape)}")
        if out is None:
            out = torch.zeros(x.shape[0], lin.n, dtype=torch.float32)
        if out.dtype != torch.float32 or not out.is_contiguous() or tuple(out.shape) != (x.shape[0], lin.n):
            raise ValueError(f"out must be a contiguous fp32 [{x.shape[0]}, {lin.n}] tensor")
        prepared = self.prepare(lin)      # held here: its tensors must outlive the call
        c = _c_linear(prepared)
        rc = self.lib.tokenyard_matvec(ctypes.byref(c), x.data_ptr(), lin.k, x.shape[0], r0, r1, out.data_ptr(),
                                       lin.n, int(accumulate))
        if rc:
            raise ValueError(f"matvec refused: rows {rows}, batch {x.shape[0]}, weight {lin.n}x{lin.k}")
        return out

    def create(self, spec: StepModel, max_batch: int, max_len: int, threads: int,
               spin_limit: int | None = None) -> "DecodeStep":
        return DecodeStep(self, spec, max_batch, max_len, threads,
                          default_spin_limit() if spin_limit is None else spin_limit)


class DecodeStep:
    """One model's decode step with its own thread pool; `close()` (or garbage collection) ends it."""

    def __init__(self, lib: Library, spec: StepModel, max_batch: int, max_len: int, threads: int,
                 spin_limit: int) -> None:
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be in 1..{MAX_BATCH}, got {max_batch}")
        if max_len > spec.cos.shape[0]:
            raise ValueError(f"max_len {max_len} exceeds the rotary tables ({spec.cos.shape[0]} positions)")
        for layer in spec.layers:
            for cache in (layer.k_cache, layer.v_cache):
                if cache.dtype != torch.float32 or not cache.is_contiguous() or cache.device.type != "cpu":
                    raise ValueError("the C decode step needs contiguous fp32 CPU KV caches")
        self._lib = lib
        self.spec = spec
        self.max_batch = max_batch
        self.max_len = max_len
        self.threads = threads
        self.spin_limit = spin_limit
        self.vocab = spec.vocab
        slots = spec.layers[0].k_cache.shape[1] if spec.layers else 0
        self._layers = (_CLayer * len(spec.layers))(*[
            _CLayer(_ptr_of(lyr.in_norm), _ptr_of(lyr.post_norm), _c_linear(lyr.qkv), _c_linear(lyr.o),
                    _c_linear(lyr.gate_up), _c_linear(lyr.down), _ptr_of(lyr.k_cache), _ptr_of(lyr.v_cache))
            for lyr in spec.layers])
        self._model = _CModel(len(spec.layers), spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.inter,
                              spec.vocab, slots, spec.block_size, max_batch, max_len, spec.sliding_window or 0,
                              spec.eps, spec.scale, _ptr_of(spec.embed), _ptr_of(spec.final_norm), _ptr_of(spec.cos),
                              _ptr_of(spec.sin), _c_linear(spec.lm_head), self._layers)
        self._handle = lib.lib.tokenyard_step_create(ctypes.byref(self._model), threads, spin_limit)
        if not self._handle:
            raise ValueError("the C decode step refused this model (shapes, thread count or memory)")

    def run(self, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """One new token per sequence at `positions` (its K/V written to `slots`); fp32 logits [B, vocab]."""
        if self._handle is None:
            raise RuntimeError("this decode step is closed")
        batch = len(ids)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        ints = torch.tensor([ids, positions, slots, seq_lens], dtype=torch.int64)
        logits = torch.empty(batch, self.vocab, dtype=torch.float32)
        job = _CJob(batch, width, ints[0].data_ptr(), ints[1].data_ptr(), ints[2].data_ptr(), ints[3].data_ptr(),
                    table.data_ptr(), logits.data_ptr())
        rc = self._lib.lib.tokenyard_step_run(self._handle, ctypes.byref(job))
        if rc == -1:
            raise ValueError(f"decode step: batch {batch} or table width {width} beyond this step's "
                             f"max_batch {self.max_batch} / max_len {self.max_len}")
        if rc:
            raise ValueError("decode step: a token id, position, slot or block outside the model or cache")
        return logits

    def reopen(self) -> "DecodeStep":
        """A new step over the same spec, reading every tensor's address again: for KV caches whose
        storage was released and given back (an engine's sleep) at another address."""
        return DecodeStep(self._lib, self.spec, self.max_batch, self.max_len, self.threads, self.spin_limit)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle:
            self._lib.lib.tokenyard_step_destroy(handle)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn ctypes down
            pass


def compile_library(out_dir: Path | None = None, int8_inputs: bool = True) -> Path:
    return cached_library(SOURCE, flags(int8_inputs), "decode_step", out_dir, includes=INCLUDES)


def load(int8_inputs: bool = True) -> Library | None:
    """The library, built on first use; None when it cannot be built (a warning, once: the torch
    decode paths serve). int8_inputs: the build that rounds small batches' int4 and int8 product
    inputs to int8 where the machine has AVX2 (`Library.int8_inputs` says whether it does); False:
    the build that keeps them fp32 everywhere (the engine's activation_quant "off")."""
    key = f"{flags()[1]} int8_inputs={int8_inputs}"
    with _LOCK:
        if key not in _LOADED:
            try:
                _LOADED[key] = Library(compile_library(int8_inputs=int8_inputs))
            except (OSError, RuntimeError) as exc:
                log.warning("CPU decode step: the C kernel is unavailable (%s); torch decodes", exc)
                _LOADED[key] = None
        return _LOADED[key]
