"""Weight-only quantisation of a loaded model, and quantised checkpoints on disk.

    quantize_model(model, "int8" | "int4", group_size)   replace linears by QuantLinear in place
    save_quantized(model_dir_in, out_dir, mode, group_size)  write a device-neutral checkpoint

What is quantised: every decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj, and by
default the LM head (`LM_HEAD_DEFAULT`). Measured in tokenyard/bench/quant_bench.py: keeping a float head
cuts batch-1 decode from 1.86x to 1.61x of bf16 (int8) and from 3.10x to 2.19x (int4) on a
200M Llama with a 32k vocabulary, while its quality gain on the demo models is small (answer
NLL unchanged within 0.002 nats; top-1 agreement with fp32 +1 to +3 points). A tied head gets
its own quantised copy. The embedding stays in the model dtype (a lookup reads one row per
token, not the whole table). `tokenyard quantize --no-lm-head` keeps a float head.

Loading with quantisation at load reads the checkpoint in float32 first (quantising from the
stored values, as save_quantized does), so start-up briefly holds the float32 model; a
pre-quantised checkpoint never does.

On disk (a quantised checkpoint folder): config.json gains
    "quantization_config": {"quant_method": "tokenyard", "mode": "int8"|"int4",
                            "group_size": g (int4) | null, "lm_head": bool, "format_version": 1}
and model.safetensors keeps the Hugging Face tensor names, with every quantised projection
`<name>.weight` stored as `<name>.qweight` (int8 [N, K], or uint8 [N, K/2] two int4 per byte,
low nibble = even k), `<name>.scales` (float32 [N] or [N, K/g]) and, for int4,
`<name>.qzeros` (uint8 [N, K/g]); everything else (embedding, norms, biases) is copied as
stored. The layout is the one of `tokenyard.kernels.quant_layout`: no backend's packing is on disk, each
backend repacks at load (QuantLinear).

A GGUF file quantised at load keeps its Q4_0/Q4_1 blocks as they are for int4 with group 32
and requantises the rest (tokenyard/engines/quant/gguf_quantized.py, `load_gguf_quantized`).

Quantising at load and loading a saved checkpoint give the same bits: both quantise the
checkpoint's tensors in float32, row by row (q, k and v quantise the same fused or not, since
scales are per output row).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.model.model import CausalLM, materialize
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.model.quantized_linear import QuantLinear
from tokenyard.engines.weights.checkpoint import safetensors_files
from tokenyard.engines.weights.weight_names import parameter_targets
from tokenyard.kernels.quant_layout import INT4_GROUP_SIZES, Int4Weight, Int8Weight, quantize_int4, quantize_int8

MODES = ("none", "int8", "int4")
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LM_HEAD_DEFAULT = True
CONFIG_KEY = "quantization_config"
FORMAT_VERSION = 1
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def check_mode(mode: str, group_size: int) -> None:
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quant_group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} for int4, "
                         f"got {group_size!r}")


def _check_group(name: str, k: int, mode: str, group_size: int) -> None:
    if mode == "int4" and k % group_size:
        raise ValueError(f"int4 with group size {group_size} needs every quantised layer's input size divisible by "
                         f"it: {name} has K={k}; choose a group size that divides {k}")


def quantize_weight(w: torch.Tensor, mode: str, group_size: int) -> Int8Weight | Int4Weight:
    return quantize_int8(w) if mode == "int8" else quantize_int4(w, group_size)


def _targets_of(model: CausalLM, lm_head: bool) -> list[tuple[str, torch.nn.Linear]]:
    out = [(f"layers.{i}.{n}", getattr(layer, n)) for i, layer in enumerate(model.layers) for n in LINEARS]
    if lm_head:
        out.append(("lm_head", model.lm_head))
    return [(name, lin) for name, lin in out if isinstance(lin, torch.nn.Linear)]


def quantize_model(model: CausalLM, mode: str, group_size: int = 128, lm_head: bool = LM_HEAD_DEFAULT,
                   backend: str = "auto") -> CausalLM:
    """Replace the decoder linears (and the LM head if `lm_head`) by QuantLinear, in place.

    Weights are quantised from float32 copies of what the linears hold; a tied LM head gets its
    own quantised copy and the embedding keeps the float table. "none" changes nothing.
    """
    check_mode(mode, group_size)
    if mode == "none":
        return model
    targets = _targets_of(model, lm_head)
    for name, lin in targets:  # check everything before changing anything
        _check_group(name, lin.in_features, mode, group_size)
    with torch.no_grad():
        for name, lin in targets:
            q = QuantLinear(quantize_weight(lin.weight.float(), mode, group_size), lin.bias, backend)
            parent, attr = _parent(model, name)
            setattr(parent, attr, q)
    return model


def _parent(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    head, _, attr = name.rpartition(".")
    return (model.get_submodule(head) if head else model), attr


# -- checkpoints ------------------------------------------------------------------------------

def checkpoint_quantization(model_dir: str | Path) -> dict | None:
    """The checkpoint's quantization_config if it is a Tokenyard-quantised one, else None."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        qc = json.loads(path.read_text()).get(CONFIG_KEY)
    except json.JSONDecodeError:
        return None  # ModelConfig.from_dir reports it
    if qc is None:
        return None
    if qc.get("quant_method") != "tokenyard" or qc.get("mode") not in ("int8", "int4"):
        raise CheckpointError(f"{path}: unsupported {CONFIG_KEY} {qc!r} (only Tokenyard int8/int4 checkpoints load)")
    return qc


def _hf_linear_weights(cfg: ModelConfig, lm_head: bool) -> dict[str, int]:
    """HF weight name of each quantised projection -> its input size K."""
    out = {hf: shape[1] for hf, (ours, _rows, shape) in parameter_targets(cfg).items()
           if ours.rpartition(".")[0].rpartition(".")[2] in LINEARS and hf.endswith(".weight")}
    if lm_head:
        out["lm_head.weight"] = cfg.hidden_size
    return out


def save_quantized(model_dir_in: str | Path, out_dir: str | Path, mode: str, group_size: int = 128,
                   lm_head: bool = LM_HEAD_DEFAULT, progress: bool = True) -> Path:
    """Quantise a Hugging Face checkpoint folder into `out_dir` (see the module doc for the format)."""
    model_dir_in, out_dir = Path(model_dir_in), Path(out_dir)
    if mode not in ("int8", "int4"):
        raise ValueError(f"mode must be int8 or int4, got {mode!r}")
    check_mode(mode, group_size)
    if checkpoint_quantization(model_dir_in) is not None:
        raise CheckpointError(f"{model_dir_in} is already quantised")
    cfg = ModelConfig.from_dir(model_dir_in)
    linears = _hf_linear_weights(cfg, lm_head)
    for hf, k in linears.items():
        _check_group(hf, k, mode, group_size)
    files = safetensors_files(model_dir_in)
    jobs: list[tuple[Path, str, str]] = []  # (file, stored name, name to write)
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():
                if lm_head and cfg.tie_word_embeddings and name == "lm_head.weight":
                    continue  # a tied checkpoint's stray copy: the head is quantised from the embedding
                jobs.append((path, name, name))
                if lm_head and cfg.tie_word_embeddings and name == "model.embed_tokens.weight":
                    jobs.append((path, name, "lm_head.weight"))  # the head's own quantised copy
    tensors: dict[str, torch.Tensor] = {}
    for path, src, name in tqdm(jobs, desc=f"quantising {model_dir_in.name} to {mode}", disable=not progress,
                                unit="tensor"):
        with safe_open(str(path), framework="pt") as fh:
            t = fh.get_tensor(src)
        if name not in linears:
            tensors[name] = t.contiguous()
            continue
        base = name[: -len(".weight")]
        q = quantize_weight(t.float(), mode, group_size)
        if isinstance(q, Int8Weight):
            tensors[base + ".qweight"], tensors[base + ".scales"] = q.w_q, q.scales.float()
        else:
            tensors[base + ".qweight"], tensors[base + ".scales"] = q.packed, q.scales.float()
            tensors[base + ".qzeros"] = q.zeros
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir_in.iterdir():  # tokenizer files, generation_config.json, chat template ...
        if f.is_file() and f.name != "config.json" and f.name not in _WEIGHT_FILES and f.suffix not in (".safetensors", ".bin"):
            shutil.copy2(f, out_dir / f.name)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((model_dir_in / "config.json").read_text())
    raw[CONFIG_KEY] = {"quant_method": "tokenyard", "mode": mode, "group_size": group_size if mode == "int4" else None,
                       "lm_head": bool(lm_head), "format_version": FORMAT_VERSION}
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out_dir


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                 skip: list[str]) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
        for name in skip:  # no float weight is materialised for a quantised projection
            parent, attr = _parent(model, name)
            if attr == "lm_head":
                setattr(parent, attr, torch.nn.Identity())
            else:
                getattr(parent, attr).weight = None
    materialize(model, device)
    model.rotary = type(model.rotary)(cfg, max_positions).to(device)
    model = model.to(dtype)
    model.rotary.cos = model.rotary.cos.float()
    model.rotary.sin = model.rotary.sin.float()
    if cfg.tie_word_embeddings and "lm_head" not in skip:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def load_quantized_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int,
                         progress: bool = True, cfg: ModelConfig | None = None,
                         backend: str = "auto") -> tuple[CausalLM, ModelConfig]:
    """Load a checkpoint written by save_quantized, repacking its weights for `device`."""
    model_dir = Path(model_dir)
    qc = checkpoint_quantization(model_dir)
    if qc is None:
        raise CheckpointError(f"{model_dir}: config.json has no {CONFIG_KEY}")
    cfg = cfg or ModelConfig.from_dir(model_dir)
    mode, group = qc["mode"], qc.get("group_size") or 0
    lm_head = bool(qc.get("lm_head", False))
    plain = parameter_targets(cfg)
    # our module name -> [(row offset, HF base name)] for every quantised projection
    quant: dict[str, list[tuple[int, str]]] = {}
    for hf, (ours, rows, _shape) in list(plain.items()):
        module = ours.rpartition(".")[0]
        if module.rpartition(".")[2] in LINEARS and hf.endswith(".weight"):
            quant.setdefault(module, []).append((rows.start if rows else 0, hf[: -len(".weight")]))
            del plain[hf]
    if lm_head:
        quant["lm_head"] = [(0, "lm_head")]
        plain.pop("lm_head.weight", None)
    model = _empty_model(cfg, dtype, device, max_positions, list(quant))
    params = dict(model.named_parameters())
    stored: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    files = safetensors_files(model_dir)
    with torch.no_grad():
        for path in tqdm(files, desc=f"loading {model_dir.name}", disable=not progress or len(files) < 2):
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():
                    if name.endswith((".qweight", ".scales", ".qzeros")):
                        stored[name] = fh.get_tensor(name)
                    elif name in plain:
                        ours, rows, shape = plain[name]
                        t = fh.get_tensor(name)
                        if tuple(t.shape) != shape:
                            raise CheckpointError(f"{path.name}: tensor {name} has shape {tuple(t.shape)}, "
                                                  f"config.json implies {shape}")
                        (params[ours] if rows is None else params[ours][rows]).copy_(t.to(dtype))
                        seen.add(name)
                    elif not (name == "lm_head.weight" and cfg.tie_word_embeddings):
                        unexpected.append(name)
        missing = [n for n in plain if n not in seen]
        for module, parts in quant.items():
            pieces = []
            for _start, base in sorted(parts):
                keys = [base + ".qweight", base + ".scales"] + ([base + ".qzeros"] if mode == "int4" else [])
                absent = [k for k in keys if k not in stored]
                if absent:
                    missing += absent
                    continue
                pieces.append([stored.pop(k) for k in keys])
            if len(pieces) != len(parts):
                continue
            cat = [torch.cat(col).to(device) for col in zip(*pieces)]
            parent, attr = _parent(model, module)
            old = getattr(parent, attr)
            n, k = (cfg.vocab_size, cfg.hidden_size) if module == "lm_head" else (old.out_features, old.in_features)
            want = [(n, k), (n,)] if mode == "int8" else [(n, k // 2), (n, k // max(group, 1)), (n, k // max(group, 1))]
            if [tuple(t.shape) for t in cat] != want:
                raise CheckpointError(f"{model_dir}: quantised {module} has shapes {[tuple(t.shape) for t in cat]}, "
                                      f"config.json implies {want}")
            layout = Int8Weight(*cat) if mode == "int8" else Int4Weight(*cat, group_size=group)
            bias = getattr(old, "bias", None)
            setattr(parent, attr, QuantLinear(layout, bias, backend))
        unexpected += sorted(stored)
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise CheckpointError(f"{model_dir}: {len(unexpected)} unexpected tensor(s): {shown}")
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"{model_dir}: {len(missing)} tensor(s) missing: {shown}")
    model.eval()
    return model, cfg
