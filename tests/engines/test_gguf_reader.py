"""GGUF checkpoints the tests write themselves (gguf's GGUFWriter): each tensor type, the llama
q/k permutation, rope_freqs, the metadata tokenizer, and every refusal naming file and problem."""
import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.engine_helpers import prompt_logits
from tokenyard.engines import LLM
from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.model.model_config import ModelConfig, llama3_inv_freq
from tokenyard.engines.text.byte_level import byte_level_table
from tokenyard.engines.text.tokenizer import Tokenizer
from tokenyard.engines.weights.checkpoint import load_model

T = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "e ll", "ell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# HF name pieces -> llama.cpp's (spelled out here, independently of tokenyard.engines.formats.gguf_reader).
LAYER_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_TO_GGUF[module]}.{kind}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (half-rotation -> interleaved rotary)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_params(cfg: dict) -> dict:
    """transformers 5 writes rope_theta and the scaling under rope_parameters."""
    params = {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {})}
    return {**params, **(cfg.get("rope_parameters") or {})}


def llamacpp_rope_factors(cfg: dict) -> np.ndarray:
    """llama.cpp's rope_freqs for a llama3 rope_scaling (per-frequency divisors of inv_freq)."""
    s, dim = rope_params(cfg), cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (s["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for f in freqs:
        wl = 2 * np.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wl - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def encode(w: np.ndarray, qtype: T) -> tuple[np.ndarray, T | None]:
    if qtype == T.F32:
        return w.astype(np.float32), None
    if qtype == T.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w, qtype), qtype


def write_gguf(path, hf_dir, qtype=T.F32, arch="llama", tokenizer=True, add_bos=False, extra_tensor=None,
               arch_name=None):
    """A GGUF of the safetensors checkpoint in hf_dir: 2-D weights in qtype, norms and biases F32."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), arch_name or arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope_params(cfg)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    if tokenizer:
        alphabet = sorted(byte_level_table(), key=byte_level_table().get)
        tokens = SPECIALS + alphabet + [m.replace(" ", "") for m in MERGES] + ["<think>"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - 1) + [4])
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(add_bos)
        w.add_chat_template(TEMPLATE)
    for hf, value in tensors.items():
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            heads = cfg["num_attention_heads"] if ".q_proj." in hf else cfg["num_key_value_heads"]
            value = llamacpp_permute(value, heads)
        data, raw = encode(value, qtype) if value.ndim == 2 else (value, None)
        w.add_tensor(gguf_name(hf), data, raw_dtype=raw)
    if rope_params(cfg).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llamacpp_rope_factors(cfg))
    if extra_tensor:
        w.add_tensor(*extra_tensor[:2], raw_dtype=extra_tensor[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def expected_params(hf_dir, qtype):
    """The HF checkpoint's tensors as the GGUF holds them: gguf's dequantisation of each quantised
    2-D tensor (quantised blocks run along rows, so row permutation commutes with quantisation)."""
    out = {}
    for hf, t in load_file(str(hf_dir / "model.safetensors")).items():
        v = t.float().numpy()
        if v.ndim == 2 and qtype not in (T.F32,):
            data, raw = encode(v, qtype)
            v = gguf.quants.dequantize(data, raw) if raw is not None else data.astype(np.float32)
        out[hf] = torch.from_numpy(np.array(v, dtype=np.float32))
    return out


def engine_param(model, cfg: ModelConfig, hf: str) -> torch.Tensor:
    """The rows of our (fused) parameter that hold HF tensor `hf`."""
    from tokenyard.engines.weights.weight_names import parameter_targets

    ours, rows, _ = parameter_targets(cfg)[hf]
    p = dict(model.named_parameters())[ours]
    return p if rows is None else p[rows]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float_gguf_equals_the_safetensors_checkpoint(checkpoint_dir, tmp_path, arch):
    """F32 GGUF of a checkpoint: same config, every weight bit-equal (q/k unpermuted exactly),
    and the same logits through the engine (llama: rope scaling from rope_freqs)."""
    hf_dir = checkpoint_dir(arch)
    path = write_gguf(tmp_path / "m.gguf", hf_dir, T.F32, arch)
    ours, theirs = ModelConfig.from_dir(path), ModelConfig.from_dir(hf_dir)
    for key in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "tie_word_embeddings", "qkv_bias", "bos_token_id", "eos_token_ids", "rope_theta", "intermediate_size"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-7)  # GGUF stores it as float32
    model, cfg = load_model(path, torch.float32, CPU, 256, progress=False)
    for hf, value in expected_params(hf_dir, T.F32).items():
        assert torch.equal(engine_param(model, cfg, hf), value), hf
    if arch == "llama":  # inv_freq / rope_freqs vs the llama3 remap: the same numbers to fp32 rounding
        dim = cfg.head_dim
        base = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        want = torch.outer(torch.arange(256, dtype=torch.float32), llama3_inv_freq(base, theirs.rope_scaling))
        torch.testing.assert_close(model.rotary.cos[:, : dim // 2], want.cos(), rtol=0, atol=1e-5)
    a = LLM(path, kv_cache_memory=4 << 20, progress=False)
    b = LLM(hf_dir, kv_cache_memory=4 << 20, progress=False)
    prompt = torch.randint(3, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(4)).tolist()
    got, want = prompt_logits(a.engine, prompt, 32), prompt_logits(b.engine, prompt)
    # Same weights and kernels; only the rotary table's last bits may differ (atol 1e-5 above).
    err = ((got - want).abs().max(-1).values / want.abs().max(-1).values).max().item()
    assert err <= 1e-4, err


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0])
def test_each_tensor_type_loads_as_ggufs_own_dequantisation(checkpoint_dir, tmp_path, qtype):
    hf_dir = checkpoint_dir("llama")
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", hf_dir, qtype)
    model, cfg = load_model(path, torch.float32, CPU, 128, progress=False)
    originals = {k: v.float() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    for hf, value in expected_params(hf_dir, qtype).items():
        got = engine_param(model, cfg, hf)
        assert torch.equal(got, value), hf  # exactly gguf's values, in HF row order
        if value.ndim == 2:  # and they are a quantisation of the original, not some other tensor
            rel = ((got - originals[hf]).norm() / originals[hf].norm()).item()
            assert rel < 0.15, (hf, rel)  # 4-bit blocks of 32: ~8% relative error on Gaussian weights


def test_quantized_gguf_can_be_loaded_in_bf16(checkpoint_dir, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", checkpoint_dir("qwen2"), T.Q8_0, "qwen2")
    model, _ = load_model(path, torch.bfloat16, CPU, 64, progress=False)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_tokenizer_from_metadata(checkpoint_dir, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", checkpoint_dir("llama"), T.F32)
    tok = Tokenizer.from_dir(path)
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    text = "jello world, the <|im_start|>tea <think> café  \n\t 12 🙂"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    n0 = len(SPECIALS) + 256
    ello, world = n0 + MERGES.index("ell o"), n0 + MERGES.index("Ġworl d")
    assert ids[:3] == [tok.token_to_id("j"), ello, world]  # merges applied in rank order
    assert 1 in ids and tok.is_special(1) and tok.token_to_id("<think>") in ids
    assert not tok.is_special(tok.token_to_id("<think>"))
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("<|im_start|>", "")
    assert tok.chat_template == TEMPLATE
    assert b"".join(tok.id_to_bytes(i) for i in ids).decode() == text  # what streaming decodes
    with_bos = Tokenizer.from_dir(write_gguf(tmp_path / "bos.gguf", checkpoint_dir("llama"), T.F32, add_bos=True))
    the = [tok.token_to_id("t"), n0 + MERGES.index("h e")]
    assert with_bos.encode("the") == [1, *the] and with_bos.encode("the", add_special_tokens=False) == the
    assert tok.encode("the") == the  # add_bos_token false: nothing added


# -- refusals: each names the file and the problem -------------------------------------------

def _gguf(checkpoint_dir, tmp_path, **kw):
    return write_gguf(tmp_path / "bad.gguf", checkpoint_dir("qwen2"), T.F32, "qwen2", **kw)


def test_truncated_file(checkpoint_dir, tmp_path):
    path = _gguf(checkpoint_dir, tmp_path)
    data = path.read_bytes()
    for cut in (len(data) - 1000, 200):  # inside the tensor data, inside the metadata
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"bad\.gguf: truncated"):
            LLM(path, kv_cache_memory=4 << 20, progress=False)


def test_wrong_magic(checkpoint_dir, tmp_path):
    path = _gguf(checkpoint_dir, tmp_path)
    path.write_bytes(b"GGML" + path.read_bytes()[4:])
    with pytest.raises(CheckpointError, match=r"bad\.gguf: not a GGUF file \(magic b'GGML'"):
        ModelConfig.from_dir(path)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"nothing\.gguf: no such GGUF file"):
        LLM(tmp_path / "nothing.gguf", progress=False)


def test_unsupported_tensor_type(checkpoint_dir, tmp_path):
    # IQ4_NL: 18-byte blocks of 32 values; a valid tensor of a type we do not load.
    extra = ("blk.0.extra.weight", np.zeros((4, 18), dtype=np.uint8), T.IQ4_NL)
    path = _gguf(checkpoint_dir, tmp_path, extra_tensor=extra)
    with pytest.raises(CheckpointError, match=r"bad\.gguf: unsupported GGUF tensor type\(s\): blk\.0\.extra\.weight \(IQ4_NL\)"):
        load_model(path, torch.float32, CPU, 64, progress=False)


def test_unexpected_tensor(checkpoint_dir, tmp_path):
    path = _gguf(checkpoint_dir, tmp_path, extra_tensor=("blk.0.extra.weight", np.zeros((4, 8), np.float32), None))
    with pytest.raises(CheckpointError, match=r"bad\.gguf: 1 unexpected tensor\(s\) for Qwen2ForCausalLM: blk\.0\.extra"):
        load_model(path, torch.float32, CPU, 64, progress=False)


def test_unknown_architecture(checkpoint_dir, tmp_path):
    path = _gguf(checkpoint_dir, tmp_path, arch_name="falcon")
    with pytest.raises(CheckpointError, match=r"bad\.gguf: GGUF architecture 'falcon' is not supported"):
        LLM(path, progress=False)


def test_missing_tokenizer(checkpoint_dir, tmp_path):
    path = _gguf(checkpoint_dir, tmp_path, tokenizer=False)
    with pytest.raises(CheckpointError, match=r"bad\.gguf: GGUF file has no tokenizer"):
        Tokenizer.from_dir(path)
    llm = LLM(path, kv_cache_memory=4 << 20, progress=False)  # token-id prompts still run
    assert llm.tokenizer is None
    out = llm.generate([[5, 6, 7]], use_tqdm=False)
    assert out[0].outputs[0].token_ids
