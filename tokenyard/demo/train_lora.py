"""Train a small LoRA adapter of a demo model on one task family: the demo adapters the engine serves.

    tokenyard demo train-lora --task sort [--base tokenyard/models/demo-large] [--rank 8] [--steps 300]
    python -m tokenyard.demo.train_lora --task sort          # the same

The base stays frozen; PEFT (a dev dependency, like transformers for `tokenyard demo train`) wraps
the seven projections of every layer with rank-r A and B. Data, batching and the teacher-forced
exact-match judge are train.py's: chat-rendered items of the task's train split, loss on the
assistant tokens only. The adapter is saved in PEFT's format (adapter_config.json +
adapter_model.safetensors) in bf16, a few hundred KB, so it loads into any engine serving the base
(`LLM(base, lora_modules={"sort": dir})`, `lora_modules:` in a deployment).

Seeded: the seed fixes the LoRA init and the data order, so on one machine (same wheels, same
thread count) a rerun gives the same adapter. Training runs in fp32 (the base is small: 0.25-0.45 s
a step of 32 items on two cores).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenyard.demo import task_suite

# torch, tqdm, transformers and peft are imported where they are used: `tokenyard demo --help` builds
# this command's parser and should not pay for them.

MODELS = Path(__file__).resolve().parent.parent / "models"
# Where the committed demo adapters live: beside the demo models, one folder per task.
ADAPTERS = MODELS / "demo-large-lora"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(slots=True)
class LoraTrainConfig:
    task: str
    rank: int = 8
    alpha: float = 16.0
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    train_pool: int = 20_000
    eval_items: int = 128
    threads: int = 2


def _lr(step: int, cfg: LoraTrainConfig) -> float:
    """Linear warm-up, then linear decay to 10% (a short run: no need for the base's cosine)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return cfg.lr * (1.0 - 0.9 * (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))


def exact_rate(model, encoded: list[tuple[list[int], int]], batch: int = 64) -> float:
    """Share of items whose whole answer is the argmax given the true prefix (greedy decoding's answer)."""
    import torch

    from tokenyard.demo.train import _batch

    model.eval()
    hits = 0
    for i in range(0, len(encoded), batch):
        ids, labels, mask = _batch(encoded[i:i + batch])
        with torch.no_grad():
            pred = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        hits += int(((pred == target) | (target == -100)).all(dim=1).sum())
    model.train()
    return hits / max(1, len(encoded))


def train_lora(base_dir: Path, out_dir: Path, cfg: LoraTrainConfig, progress: bool = True) -> dict:
    """Train one adapter; write it to out_dir (PEFT format, bf16) and return a summary (also written
    to out_dir/training.json)."""
    import peft
    import torch
    import transformers
    from tqdm import tqdm

    from tokenyard.demo.train import _batch, encode_item
    from tokenyard.engines.text.tokenizer import Tokenizer

    task_suite.get_task(cfg.task)   # a clear error for an unknown task, before any work
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tok = Tokenizer.from_dir(base_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lcfg = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(TARGETS), lora_dropout=0.0,
                           bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lcfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    pool = [encode_item(tok, it) for it in task_suite.generate_items("train", cfg.train_pool, seed=cfg.seed,
                                                                       tasks=[cfg.task])]
    val = [encode_item(tok, it) for it in task_suite.generate_items("validation", cfg.eval_items, seed=cfg.seed,
                                                                      tasks=[cfg.task])]
    before = exact_rate(model, val)
    t0 = time.monotonic()
    running = None
    model.train()
    bar = tqdm(range(cfg.steps), desc=f"LoRA {cfg.task} (r={cfg.rank})", disable=not progress)
    for step in bar:
        ids, labels, mask = _batch([pool[rng.randrange(len(pool))] for _ in range(cfg.batch_size)])
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        bar.set_postfix(loss=f"{running:.3f}")
    seconds = time.monotonic() - t0
    after = exact_rate(model, val)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16)   # the adapter's tensors in bf16: half the bytes, what the demo ships
    model.save_pretrained(out_dir, safe_serialization=True)
    _portable_config(out_dir)
    (out_dir / "README.md").unlink(missing_ok=True)   # PEFT's empty model-card template
    summary = {"task": cfg.task, "base": base_dir.name, "config": asdict(cfg), "train_seconds": round(seconds, 1),
               "final_loss": running, "validation_exact_before": before, "validation_exact_after": after,
               "adapter_bytes": (out_dir / "adapter_model.safetensors").stat().st_size}
    (out_dir / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _portable_config(out_dir: Path) -> None:
    """PEFT writes the base's absolute path into adapter_config.json; keep the base's folder name
    only, so the committed file says nothing about the machine it was trained on."""
    path = out_dir / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg["base_model_name_or_path"] = Path(cfg.get("base_model_name_or_path") or "").name or None
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--task", required=True, choices=task_suite.TASKS, help="the task family the adapter learns")
    ap.add_argument("--base", default=str(MODELS / "demo-large"), help="the demo checkpoint to adapt")
    ap.add_argument("--out", help="adapter folder (default: tokenyard/models/demo-large-lora/TASK)")
    defaults = LoraTrainConfig(task="")
    for name in ("rank", "steps", "batch_size", "seed", "threads"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    ap.add_argument("--lr", type=float, default=defaults.lr)
    ap.add_argument("--alpha", type=float, help="LoRA alpha (default: 2 x rank)")


def run(args: argparse.Namespace) -> int:
    cfg = LoraTrainConfig(task=args.task, rank=args.rank, alpha=args.alpha or 2.0 * args.rank, steps=args.steps,
                          batch_size=args.batch_size, lr=args.lr, seed=args.seed, threads=args.threads)
    out = Path(args.out) if args.out else ADAPTERS / args.task
    summary = train_lora(Path(args.base), out, cfg)
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))


if __name__ == "__main__":
    main()
