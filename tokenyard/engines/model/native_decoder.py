"""Pure-decode steps of a few sequences through the C decode step (tokenyard/kernels/cpu_decode_step.c).

Why: a decode step at batch 1 reads every weight once and should take about as long as that read.
Eager torch spends most of a small model's step between the reads (a dispatch and an allocation
per op), and the inductor-compiled step (compiled_decoder.py) still opens an OpenMP region, with
a barrier between the two cores, per kernel and calls oneDNN per projection. The C step is one
call per step: its own threads walk every layer together (bench/RESULTS.md, "Native CPU decode
step", has the measurements against both and against llama.cpp on the same weights).

What runs there: steps in which every scheduled sequence decodes one token, with at most
`max_batch` sequences (the runner's auto rule: 16 beside the compiled graph, whose oneDNN GEMMs
win from about 32 sequences, else every batch, where it beats eager torch); everything else (prefill chunks,
mixed and speculative verify steps, larger decode batches) runs as before. The step writes K/V to
the same slots and returns the same logits as the eager forward, to fp32 rounding
(tests/engines/test_native_decode.py).

Which models: fp32 on the CPU with plain fp32 KV caches, SiLU MLPs, no tensor or pipeline
parallelism; projections that are fp32 nn.Linear, or QuantLinear int8 or int4 (groups of 32, 64
or 128: the int4 weights are copied once into the kernel's group order, 0.5 byte a weight plus
fp32 scale and minimum per group, or on AVX-512 VNNI builds into 16-row blocks with fp16 scales and
minimums (Library.prepare), while the torch copy stays for prefill). `unsupported()` says
why a model does not qualify.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from tokenyard.engines.model import native_step_cache
from tokenyard.engines.model.model import CausalLM
from tokenyard.engines.model.quantized_linear import QuantLinear
from tokenyard.kernels import cpu_decode_step
from tokenyard.kernels.cpu_decode_step import StepLayer, StepLinear, StepModel, linear_slots
from tokenyard.kernels.hugepage_arena import HugePageArena
from tokenyard.kernels.quant_layout import unpack_int4, zeros_to_mins
from tokenyard.kernels.quant_matmul_torch import int4pack_codes


def unsupported(model: CausalLM, kv_caches: list) -> str | None:
    """None when the C step can run this model's decode steps, else the reason it cannot."""
    cfg = model.cfg
    if model.embed_tokens.weight.device.type != "cpu":
        return "not a CPU model"
    if model.embed_tokens.weight.dtype != torch.float32:
        return f"model dtype {model.embed_tokens.weight.dtype} (the C step computes in fp32)"
    if cfg.hidden_act != "silu":
        return f"activation {cfg.hidden_act}"
    if any(layer.tp_enabled for layer in model.layers):
        return "tensor parallelism"
    for k, v in kv_caches:
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dtype != torch.float32:
            return "a quantised or non-fp32 KV cache"
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and _linear_problem(module) is not None:
            return f"{name}: {_linear_problem(module)}"
    return None


def _linear_problem(q: QuantLinear) -> str | None:
    if q.int4 and (q.group_size % 32 or q.in_features % q.group_size):
        return f"int4 group size {q.group_size}"
    if q.int4 and q.backend == "cpu" and q._layout is None:
        return "torch's int4 packing is in a layout this build cannot read"
    if q.backend == "triton":
        return "a CUDA weight"
    return None


def step_linear(module: nn.Module) -> StepLinear:
    """The kernel's description of one projection (fp32 Linear, or QuantLinear int8 / int4)."""
    if isinstance(module, nn.Linear):
        return StepLinear.f32(module.weight, module.bias)
    if not isinstance(module, QuantLinear):
        raise TypeError(f"unsupported projection {type(module).__name__}")
    n, k = module.out_features, module.in_features
    if not module.int4:
        return StepLinear.int8(module.w_q, module.scales.float(), module.bias)
    if module.backend == "cpu":
        # torch's packed op computes w = (q - 8) * scale + zero' (scale_zero: bf16 [K/g, N, 2]),
        # which is q * scale + (zero' - 8 * scale).
        q = int4pack_codes(module.packed, module._n_padded, k, module._layout)[:n]
        sz = module.scale_zero[:, :n].float()
        scales = sz[..., 0].t().contiguous()
        mins = (sz[..., 1] - 8.0 * sz[..., 0]).t().contiguous()
        return StepLinear.int4(q, scales, mins, module.group_size, module.bias)
    q = unpack_int4(module.packed)
    mins = module.mins if module.mins is not None else zeros_to_mins(module.scales, module.zeros)
    return StepLinear.int4(q, module.scales, mins, module.group_size, module.bias)


def describe(model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
             linear: Callable[[str, nn.Module], StepLinear] | None = None) -> StepModel:
    """The C step's description of `model`. linear(slot, module): each projection's StepLinear
    (default `step_linear`; slots "lm_head" and "layers.I.qkv|o|gate_up|down", native_step_cache.py)."""
    cfg = model.cfg
    lin = linear or (lambda _slot, module: step_linear(module))
    layers = [StepLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        lin(f"layers.{i}.qkv", layer.qkv_proj), lin(f"layers.{i}.o", layer.o_proj),
                        lin(f"layers.{i}.gate_up", layer.gate_up_proj), lin(f"layers.{i}.down", layer.down_proj), k, v)
              for i, (layer, (k, v)) in enumerate(zip(model.layers, kv_caches))]
    return StepModel(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                     cfg.vocab_size, block_size, float(cfg.rms_norm_eps), float(model.layers[0].scale),
                     model.embed_tokens.weight.detach().contiguous(), model.norm.weight.detach().float().contiguous(),
                     model.rotary.cos.float().contiguous(), model.rotary.sin.float().contiguous(),
                     lin("lm_head", model.lm_head), layers, cfg.sliding_window)


def _streamed(spec: StepModel) -> list[tuple[object, str]]:
    """(object, attribute) of every weight tensor the step streams (not the KV caches or tables).
    The embedding table only when the LM head is that table (tied fp32): otherwise a step reads
    one row of it per token, which huge pages do not speed up, and leaving it where it lies spares
    copying it (SmolLM2: 113 MB; from the prepared-weights cache, it stays mapped from the file)."""
    out: list[tuple[object, str]] = [(spec, "final_norm")]
    if spec.lm_head.w.data_ptr() == spec.embed.data_ptr():
        out.append((spec, "embed"))
    for layer in spec.layers:
        out += [(layer, "in_norm"), (layer, "post_norm")]
    for lin in (getattr(obj, name) for obj, name in linear_slots(spec)):
        out += [(lin, name) for name in ("w", "scale", "minv", "bias") if getattr(lin, name) is not None]
    return out


def rehome(spec: StepModel, model: CausalLM) -> HugePageArena:
    """Move every tensor the step streams into one huge-page arena (tokenyard/kernels/hugepage_arena.py says
    why) and point the model's own parameters and buffers that shared them at the new copies, so
    the torch paths read the same memory and nothing is held twice."""
    def key(t: torch.Tensor) -> tuple:
        return t.data_ptr(), tuple(t.shape), t.dtype

    streamed = _streamed(spec)
    unique: dict[tuple, torch.Tensor] = {}
    for obj, name in streamed:
        t = getattr(obj, name)
        unique.setdefault(key(t), t)
    arena = HugePageArena.holding(list(unique.values()))
    moved = {k: arena.view(i) for i, k in enumerate(unique)}
    for obj, name in streamed:
        setattr(obj, name, moved[key(getattr(obj, name))])
    with torch.no_grad():
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and key(p) in moved:
                    p.data = moved[key(p)]
            for name, b in module._buffers.items():
                if b is not None and key(b) in moved:
                    module._buffers[name] = moved[key(b)]
    return arena


class NativeDecoder:
    """Runs pure-decode steps of up to max_batch sequences through the C step; `can_run` says
    whether a step qualifies."""

    def __init__(self, model: CausalLM, kv_caches: list, block_size: int, max_model_len: int, max_batch: int,
                 threads: int) -> None:
        t0 = time.perf_counter()
        problem = unsupported(model, kv_caches)
        if problem is not None:
            raise ValueError(f"the C decode step cannot run this model: {problem}")
        lib = cpu_decode_step.load()
        if lib is None:
            raise RuntimeError("the C decode step is unavailable (no C compiler, or its build failed: "
                               "see the warning above)")
        self.block_size = block_size
        self.max_len = min(max_model_len, model.rotary.cos.shape[0])
        self.max_batch = max_batch
        self.width = -(-self.max_len // block_size)
        # int4 in 16-row blocks where the build reads them (a copy made before the arena takes it in)
        # (projections from the prepared-weights cache when it holds this model's: native_step_cache.py)
        cached = native_step_cache.load_linears(lib, model)
        if cached is not None:
            spec = describe(model, kv_caches, block_size, lambda slot, _module: cached[slot])
        else:
            spec = lib.prepare_model(describe(model, kv_caches, block_size))
            native_step_cache.save_linears(lib, model, spec)
        self.arena = rehome(spec, model)
        self.step = lib.create(spec, max_batch, self.max_len, threads)
        # building the library (first use on a machine: a few seconds of gcc, then cached) + the repack
        self.ready_seconds = time.perf_counter() - t0

    def can_run(self, n: int, max_blocks: int) -> bool:
        return 0 < n <= self.max_batch and max_blocks <= self.width

    def run(self, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        return self.step.run(ids, positions, slots, seq_lens, tables)

    def close(self) -> None:
        self.step.close()
