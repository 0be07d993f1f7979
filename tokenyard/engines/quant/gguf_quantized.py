"""GGUF checkpoints loaded with their quantised projections kept quantised (`load_gguf_quantized`).

Quantised loading (`quantization: int4 | int8`) maps each projection tensor onto the engine's
weight-only layouts (`tokenyard.kernels.quant_layout`):
- int4 with group size 32 takes Q4_0 and Q4_1 tensors as stored (`gguf_reader.int4_blocks`):
  the loaded weight dequantises to exactly gguf's values, and no float copy is ever made.
- anything else (int8 from Q8_0, whose per-block scales do not fit the per-channel int8 layout;
  int4 from a K-quant or with another group size; float tensors) is requantised from gguf's
  dequantised values, and the largest error against them is measured and reported.
- except the LM head under int4 when the file stores it above 4 bits (llama.cpp's choice for the
  most rounding-sensitive layer): that head is requantised to int8 (`_head_mode`).
Each reason for requantising is logged once per load; `GGUFQuantReport` lists every tensor.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from tqdm import tqdm

from tokenyard.engines.formats import gguf_reader as gr
from tokenyard.engines.model.model import CausalLM
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.model.quantized_linear import QuantLinear
from tokenyard.engines.quant.quantization import LINEARS, LM_HEAD_DEFAULT, _empty_model, _parent, check_mode, quantize_weight
from tokenyard.engines.weights.gguf_loader import float_weight, plan
from tokenyard.engines.weights.weight_names import PROGRESS_MIN_BYTES

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TensorQuant:
    """How one GGUF tensor became (part of) a quantised projection."""
    name: str                 # the GGUF tensor name
    gguf_type: str            # e.g. Q4_1
    module: str               # our module, e.g. layers.0.qkv_proj
    mode: str                 # the layout it got: int4 or int8
    native: bool              # taken as stored (True) or requantised from gguf's values
    max_abs_error: float      # max |loaded weight - gguf's dequantisation| (0.0 when native)
    max_abs_weight: float     # max |gguf's dequantisation| (0.0 when native: not computed)


@dataclass(slots=True)
class GGUFQuantReport:
    mode: str
    group_size: int
    tensors: list[TensorQuant] = field(default_factory=list)

    @property
    def native(self) -> int:
        return sum(t.native for t in self.tensors)

    @property
    def requantised(self) -> list[TensorQuant]:
        return [t for t in self.tensors if not t.native]

    def summary(self) -> str:
        worst = max(self.requantised, key=lambda t: t.max_abs_error, default=None)
        tail = (f"; largest requantisation error {worst.max_abs_error:.3g} in {worst.name} ({worst.mode}, "
                f"max |w| {worst.max_abs_weight:.3g})") if worst else ""
        return (f"{self.mode}{f' (group {self.group_size})' if self.mode == 'int4' else ''}: "
                f"{self.native} tensor(s) kept as stored, {len(self.requantised)} requantised{tail}")


def _requant_reason(kind: str, mode: str, group_size: int) -> str | None:
    """Why a tensor of GGUF type `kind` cannot be taken as stored for `mode`, or None if it can."""
    if mode == "int4" and kind in gr.NATIVE_INT4_TYPES:
        if group_size == gr.BLOCK:
            return None
        return f"{kind} has groups of {gr.BLOCK}; int4 with group size {group_size} requantises it"
    if mode == "int8" and kind == "Q8_0":
        return ("Q8_0 has one scale per block of 32; the engine's int8 has one per output channel, "
                "so it is requantised")
    return f"{kind} has no {mode} form in the engine's layouts, so it is requantised"


# GGUF types of at most 4 bits per weight: requantising them to int4 loses little more.
_FOUR_BIT_OR_LESS = ("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K")


def _head_mode(kind: str, mode: str) -> str:
    """llama.cpp keeps the output head (or the tied embedding) of a 4-bit file at Q6_K or Q8_0 on
    purpose: the head is the layer most sensitive to rounding. Requantising such a head to int4
    undoes that choice: on SmolLM2-135M (Q8_0 tied head) the prompt logits moved by up to 4.49
    from the dequantised model's and the greedy answer to "capital of France?" turned to garbled
    French, against 0.91 and the right answer with an int8 head. So an int4 load gives a head stored
    above 4 bits the int8 layout (requantised, reported)."""
    return "int8" if mode == "int4" and kind not in _FOUR_BIT_OR_LESS else mode


def _quant_part(path: Path, cfg: ModelConfig, t, hf: str, module: str, mode: str, group_size: int,
                logged: set[str]):
    """(layout, TensorQuant) for one GGUF tensor of a quantised projection."""
    from tokenyard.kernels.quant_layout import Int4Weight, dequantize_int4_weight, dequantize_int8


    kind = t.tensor_type.name
    if module == "lm_head" and _head_mode(kind, mode) != mode:
        mode = _head_mode(kind, mode)
        reason = f"the LM head is stored as {kind}, above 4 bits: it is requantised to int8, not int4"
    else:
        reason = _requant_reason(kind, mode, group_size)
    if reason is None:
        layout = gr.int4_blocks(t)
        heads = gr.qk_heads(gr.architecture(gr.open_gguf(path), path), cfg, hf)
        if heads:  # llama.cpp permuted whole rows; blocks run along a row, so rows move as units
            layout = Int4Weight(gr.unpermute_rows(layout.packed, heads), gr.unpermute_rows(layout.scales, heads),
                                None if layout.zeros is None else gr.unpermute_rows(layout.zeros, heads),
                                layout.group_size,
                                mins=None if layout.mins is None else gr.unpermute_rows(layout.mins, heads))
        return layout, TensorQuant(t.name, kind, module, mode, True, 0.0, 0.0)
    if reason not in logged:
        logged.add(reason)
        log.info("%s: %s (first: %s)", path.name, reason, t.name)
    w = float_weight(path, cfg, t, hf)
    layout = quantize_weight(w, mode, group_size)
    back = dequantize_int4_weight(layout) if mode == "int4" else dequantize_int8(layout.w_q, layout.scales)
    err = float((back - w).abs().max()) if w.numel() else 0.0
    return layout, TensorQuant(t.name, kind, module, mode, False, err, float(w.abs().max()) if w.numel() else 0.0)


def _to(x, device: torch.device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _concat(parts: list, mode: str):
    """Stack the row blocks of a fused projection (q/k/v, gate/up) into one layout."""
    from tokenyard.kernels.quant_layout import Int4Weight, Int8Weight

    if len(parts) == 1:
        return parts[0]
    if mode == "int8":
        return Int8Weight(torch.cat([p.w_q for p in parts]), torch.cat([p.scales.float() for p in parts]))
    if all(p.mins is None for p in parts):
        return Int4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.scales.float() for p in parts]),
                          torch.cat([p.zeros for p in parts]), parts[0].group_size)
    parts = [p.with_mins() for p in parts]  # mixed forms: the float-minimum one holds both
    return Int4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.scales.float() for p in parts]), None,
                      parts[0].group_size, mins=torch.cat([p.mins.float() for p in parts]))


def load_gguf_quantized(path: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int,
                        mode: str, group_size: int, lm_head: bool | None = None, backend: str = "auto",
                        progress: bool = True, cfg: ModelConfig | None = None
                        ) -> tuple[CausalLM, ModelConfig, GGUFQuantReport]:
    """A GGUF model whose projections (and LM head, by default) are QuantLinears built from the
    file's blocks where the layouts agree (see the module doc); the rest is dequantised to `dtype`."""

    check_mode(mode, group_size)
    if mode == "none":
        raise ValueError("load_gguf_quantized needs int8 or int4; quantization none is load_gguf_model")
    lm_head = LM_HEAD_DEFAULT if lm_head is None else lm_head
    path = Path(path)
    cfg = cfg or ModelConfig.from_dir(path)
    reader = gr.open_gguf(path)
    gr.check_types(reader, path)
    jobs = plan(path, cfg)
    quant: dict[str, list] = {}   # our module -> [(row start, gguf tensor, HF name)]
    plain = []
    for t, hf, (ours, rows, shape) in jobs:
        module = ours.rpartition(".")[0]
        is_proj = module.rpartition(".")[2] in LINEARS and hf.endswith(".weight")
        if is_proj or (lm_head and hf == "lm_head.weight"):
            quant.setdefault(module, []).append((rows.start if rows else 0, t, hf))
        else:
            plain.append((t, hf, ours, rows))
        if lm_head and cfg.tie_word_embeddings and hf == "model.embed_tokens.weight":
            quant["lm_head"] = [(0, t, hf)]  # a tied head gets its own quantised copy of the table
    for module, parts in quant.items():
        k = cfg.hidden_size if module == "lm_head" else gr.logical_shape(parts[0][1])[1]
        if module == "lm_head" and _head_mode(parts[0][1].tensor_type.name, mode) == "int8":
            continue
        if mode == "int4" and k % group_size:
            raise ValueError(f"int4 with group size {group_size} needs every quantised layer's input size "
                             f"divisible by it: {module} has K={k}")
    model = _empty_model(cfg, dtype, device, max_positions, list(quant))
    params = dict(model.named_parameters())
    report = GGUFQuantReport(mode, group_size)
    logged: set[str] = set()
    total = sum(int(t.n_bytes) for t, _, _ in jobs)
    with torch.no_grad(), tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name} ({mode})",
                               disable=not progress or total < PROGRESS_MIN_BYTES) as bar:
        for t, hf, ours, rows in plain:  # first: biases must be in place before QuantLinear copies them
            (params[ours] if rows is None else params[ours][rows]).copy_(float_weight(path, cfg, t, hf).to(dtype))
            bar.update(int(t.n_bytes))
        for module, parts in quant.items():
            layouts = []
            for _start, t, hf in sorted(parts, key=lambda p: p[0]):
                layout, info = _quant_part(path, cfg, t, hf, module, mode, group_size, logged)
                layouts.append(layout)
                report.tensors.append(info)
                bar.update(int(t.n_bytes))
            layout = _concat(layouts, mode)
            layout = type(layout)(**{f.name: _to(getattr(layout, f.name), device) for f in fields(layout)})
            parent, attr = _parent(model, module)
            setattr(parent, attr, QuantLinear(layout, getattr(getattr(parent, attr), "bias", None), backend))
    factors = gr.rope_factors(path, cfg)
    if factors is not None:
        gr.apply_rope_factors(model, cfg, factors)
    model.eval()
    log.info("%s: %s", path.name, report.summary())
    return model, cfg, report
