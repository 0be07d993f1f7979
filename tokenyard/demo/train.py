"""Train the demo model pair on the task suite: reproducible, resumable, with learning curves.

Reproducible means: the seed fixes the tokenizer, the initial weights and the data order, so on
one machine (same wheels, same thread count) a rerun gives the same weights bit for bit
(tests/demo/test_demo_training.py). On another CPU the float sums differ in their last bits and
thousands of AdamW steps grow that apart, so there the weights differ and what reproduces is the
models' accuracy, within the tolerance tests/demo/test_demo_models.py states.

    tokenyard demo train [--which small|large|both] [--minutes M | --steps N] [--smoke]

Both models are Llama-architecture decoders built with transformers (a dev dependency: training
is a tool for the demo, the engines never import it), trained with AdamW under bf16 autocast on
the assistant tokens of chat-rendered task items, and saved as HF checkpoints (config.json,
bf16 model.safetensors, generation_config.json, tokenizer files) that the engine loads like any
other. A run directory keeps the latest training state, so a later run continues where the
last one stopped. Learning curves are the per-task exact-match rate on a fixed validation
sample, judged teacher-forced: the answer is exact iff every answer token (and the end token)
is the argmax given the true prefix, which is exactly what greedy decoding would produce.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from tokenyard.demo import task_suite
from tokenyard.demo.bpe import END, SPECIALS, train_tokenizer
from tokenyard.engines.text.chat_template import apply_chat_template
from tokenyard.engines.text.tokenizer import Tokenizer


@dataclass(slots=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int       # widths are multiples of 128: the int4 kernels' group sizes need it


SPECS = {
    "small": ModelSpec("small", hidden=128, layers=4, heads=4, kv_heads=2, ffn=384),
    "large": ModelSpec("large", hidden=256, layers=8, heads=8, kv_heads=2, ffn=768),
}


@dataclass(slots=True)
class TrainConfig:
    steps: int = 3000
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.05
    eval_every: int = 250
    checkpoint_every: int = 250
    eval_items: int = 320
    seed: int = 0
    train_pool: int = 200_000
    tokenizer_corpus: int = 40_000   # suite texts the BPE is trained on
    vocab_size: int = 2048


@dataclass(slots=True)
class History:
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    exact: dict[str, list[float]] = field(default_factory=dict)   # per task, at each eval


def build_tokenizer(out_dir: Path, vocab_size: int = 2048, seed: int = 0, corpus: int = 40_000) -> Tokenizer:
    if not (out_dir / "tokenizer.model").is_file():
        train_tokenizer(task_suite.corpus_texts(corpus, seed=seed), vocab_size - len(SPECIALS), out_dir)
    return Tokenizer.from_dir(out_dir)


def encode_item(tok: Tokenizer, item: task_suite.TaskItem) -> tuple[list[int], int]:
    """(token ids of prompt + answer + end, index where the answer starts)."""
    prompt = tok.encode(apply_chat_template(tok, list(item.messages)), add_special_tokens=False)
    answer = tok.encode(item.answer + END, add_special_tokens=False)
    return prompt + answer, len(prompt)


def _batch(encoded: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.zeros(len(encoded), width, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    mask = torch.zeros(len(encoded), width, dtype=torch.long)
    for row, (seq, start) in enumerate(encoded):
        ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
        labels[row, start:len(seq)] = torch.tensor(seq[start:])
    return ids, labels, mask


def make_model(spec: ModelSpec, tok: Tokenizer, seed: int):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=spec.hidden, intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.token_to_id(END), pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


@torch.no_grad()
def teacher_forced_exact(model, encoded: list[tuple[list[int], int]], items: list, batch: int = 64) -> dict[str, float]:
    hits: dict[str, list[int]] = {}
    model.eval()
    for i in range(0, len(encoded), batch):
        ids, labels, mask = _batch(encoded[i:i + batch])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=mask).logits
        pred = logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        ok = ((pred == target) | (target == -100)).all(dim=1)
        for item, good in zip(items[i:i + batch], ok.tolist()):
            hits.setdefault(item.task, []).append(int(good))
    model.train()
    return {task: sum(v) / len(v) for task, v in sorted(hits.items())}


def train(spec: ModelSpec, run_dir: Path, out_dir: Path, tok_dir: Path, cfg: TrainConfig,
          minutes: float | None = None, progress: bool = True) -> History:
    """Train (or continue training) one model; write the HF checkpoint to out_dir at the end."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(tok_dir, cfg.vocab_size, cfg.seed, cfg.tokenizer_corpus)
    model = make_model(spec, tok, cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state_path = run_dir / "state.pt"
    history = History()
    step = 0
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], History(**state["history"])
        random.setstate(state["py_rng"])
    else:
        random.seed(cfg.seed)
    pool = task_suite.generate_items("train", cfg.train_pool, seed=cfg.seed)
    val_items = task_suite.generate_items("validation", cfg.eval_items, seed=cfg.seed)
    val_encoded = [encode_item(tok, it) for it in val_items]
    encoded_cache: dict[int, tuple[list[int], int]] = {}
    n_params = sum(p.numel() for p in model.parameters())
    deadline = time.monotonic() + 60 * minutes if minutes else None
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {spec.name} ({n_params / 1e6:.1f}M)", disable=not progress)
    model.train()
    t_start = time.monotonic() - (history.seconds[-1] if history.seconds else 0.0)
    tokens = history.tokens[-1] if history.tokens else 0
    running = None
    while step < cfg.steps and (deadline is None or time.monotonic() < deadline):
        idx = [random.randrange(len(pool)) for _ in range(cfg.batch_size)]
        batch = [encoded_cache.get(i) or encoded_cache.setdefault(i, encode_item(tok, pool[i])) for i in idx]
        ids, labels, mask = _batch(batch)
        lr = _lr(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += int(mask.sum())
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{running:.3f}", lr=f"{lr:.1e}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            exact = teacher_forced_exact(model, val_encoded, val_items)
            history.steps.append(step)
            history.loss.append(running)
            history.tokens.append(tokens)
            history.seconds.append(time.monotonic() - t_start)
            for task, value in exact.items():
                history.exact.setdefault(task, []).append(value)
            bar.write(f"step {step}: loss {running:.3f}, exact " + ", ".join(f"{k} {v:.2f}" for k, v in exact.items()))
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            _save_state(state_path, model, opt, step, history)
    bar.close()
    _save_state(state_path, model, opt, step, history)
    save_checkpoint(model, tok_dir, out_dir)
    (run_dir / "history.json").write_text(json.dumps(asdict(history), indent=1))
    return history


def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _save_state(path: Path, model, opt, step: int, history: History) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "history": asdict(history), "py_rng": random.getstate()}, tmp)
    tmp.replace(path)  # never leave a half-written state behind


def save_checkpoint(model, tok_dir: Path, out_dir: Path) -> None:
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.to(torch.float32)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, out_dir / name)
