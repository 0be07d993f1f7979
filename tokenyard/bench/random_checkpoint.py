"""Random-weight Hugging Face checkpoints built with transformers (tests and benchmarks).

transformers is a test/bench-only dependency: the engines never import it. Weights are drawn
with a larger std than a fresh model's default so logits are confident (greedy choices are not
near-ties), which makes token-level parity checks meaningful.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def build_random_checkpoint(out_dir: str | Path, arch: str = "llama", *, seed: int = 0, std: float = 0.08,
                            dtype: str = "float32", **config: Any) -> Path:
    import torch
    import transformers

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    cfg_name, model_name = ARCHS[arch]
    defaults: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    defaults.update(config)
    cfg = getattr(transformers, cfg_name)(**defaults)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
