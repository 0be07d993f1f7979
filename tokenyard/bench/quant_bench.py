"""Weight-only quantisation: decode speed through the engine, and quality on the demo models.

    python -m tokenyard.bench.quant_bench [--out bench/out/quant.json] [--skip-speed] [--skip-quality]

Speed: a random Llama (default ~200M parameters: d=1024, 12 layers, FFN 2816, vocab 32000,
untied head), built once under bench/out/. For each mode (none in fp32, none in bf16, int8,
int4 group 128) an Engine decodes at batch 1 and 32: prompts of 32 random tokens are prefilled
first, then `--steps` decode steps are timed after `--warmup` untimed ones (one token per
sequence per step). tokens/s = batch / median step time (the mean is recorded too). The
engines are loaded side by side and timed in interleaved rounds (fair on a shared machine).

Quality, per demo model and mode, on held-out task-suite items (test split):
- answer NLL: mean negative log-likelihood of the answer tokens (+ end token), teacher forced
  through the engine's model (`answer_nll`), and its delta against the fp32 model;
- top-1 agreement: fraction of those positions where the mode's argmax equals fp32's;
- greedy agreement: fraction of items whose greedy completion through the engine is the same
  token sequence as fp32's;
- task accuracy: exact match through the engine (LLM.chat, greedy, 48 tokens), judged as
  tokenyard/demo/evaluate.py does (TaskItem.check).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tokenyard.engines import LLM, Engine, SamplingParams
from tokenyard.engines.model.attention import AttentionMetadata
from tokenyard.engines.model.kv_cache import allocate_kv_cache

REPO = Path(__file__).resolve().parent.parent.parent
DEMO_MODELS = (REPO / "models" / "demo-small", REPO / "models" / "demo-large")
SPEED_MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024,
                   tie_word_embeddings=False)
# name -> engine options
SPEED_MODES = {
    "none-fp32": dict(dtype="float32"),
    "none-bf16": dict(dtype="bfloat16"),
    "int8": dict(quantization="int8"),
    "int4-g128": dict(quantization="int4", quant_group_size=128),
    "int8-keep-head": dict(quantization="int8"),
    "int4-g128-keep-head": dict(quantization="int4", quant_group_size=128),
}
# name -> (dtype, quantization, group size, lm_head)
QUALITY_MODES = {
    "none-fp32": ("float32", "none", 128, False),
    "none-bf16": ("bfloat16", "none", 128, False),
    "int8": ("bfloat16", "int8", 128, True),
    "int8-keep-head": ("bfloat16", "int8", 128, False),
    "int4-g32": ("bfloat16", "int4", 32, True),
    "int4-g64": ("bfloat16", "int4", 64, True),
    "int4-g128": ("bfloat16", "int4", 128, True),
    "int4-g128-keep-head": ("bfloat16", "int4", 128, False),
}


# -- teacher forcing ------------------------------------------------------------------------

@torch.inference_mode()
def sequence_logits(model, seqs: list[list[int]], block_size: int = 16) -> list[torch.Tensor]:
    """fp32 logits at every position of each sequence: one flat forward through a fresh paged cache."""
    cfg = model.cfg
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    tables, slots, lens, ids, positions = [], [], [], [], []
    next_block = 0
    for s in seqs:
        nb = -(-len(s) // block_size)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(len(s))]
        lens.append(len(s))
        ids += s
        positions += range(len(s))
    kv = allocate_kv_cache(cfg, next_block, block_size, dtype, device)
    meta = AttentionMetadata.build(slots, lens, lens, tables, block_size, cfg.sliding_window, device, "torch")
    logits = model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), meta, kv,
                   torch.arange(len(ids), device=device))
    return list(logits.float().split(lens))


def encoded_items(model_dir: Path, n: int, seed: int = 7) -> list[tuple[list[int], int]]:
    """Held-out (test split) task-suite items as (prompt + answer + end ids, answer start)."""
    from tokenyard.demo import task_suite
    from tokenyard.demo.train import encode_item
    from tokenyard.engines.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    return [encode_item(tok, it) for it in task_suite.generate_items("test", n, seed=seed)]


def answer_nll(model, encoded: list[tuple[list[int], int]], batch: int = 64) -> tuple[float, torch.Tensor]:
    """(mean NLL per answer token, the argmax at every scored position as one flat tensor)."""
    total, count, argmax = 0.0, 0, []
    for i in range(0, len(encoded), batch):
        part = encoded[i:i + batch]
        for (ids, start), lg in zip(part, sequence_logits(model, [ids for ids, _ in part])):
            pred = lg[start - 1:len(ids) - 1]
            target = torch.tensor(ids[start:], device=pred.device)
            total += float(torch.nn.functional.cross_entropy(pred, target, reduction="sum"))
            count += len(target)
            argmax.append(pred.argmax(-1).cpu())
    return total / count, torch.cat(argmax)


def keep_float_head(model, model_dir: Path) -> None:
    """Put the unquantised LM head back (the "-keep-head" variants): tied to the embedding, or
    the checkpoint's lm_head.weight in the model dtype."""
    from safetensors import safe_open

    from tokenyard.engines.weights.checkpoint import safetensors_files

    dtype = model.embed_tokens.weight.dtype
    head = torch.nn.Linear(model.cfg.hidden_size, model.cfg.vocab_size, bias=False, device="meta")
    if model.cfg.tie_word_embeddings:
        head.weight = model.embed_tokens.weight
    else:
        for f in safetensors_files(model_dir):
            with safe_open(str(f), framework="pt") as fh:
                if "lm_head.weight" in fh.keys():
                    head.weight = torch.nn.Parameter(fh.get_tensor("lm_head.weight").to(dtype), requires_grad=False)
    model.lm_head = head


def load_mode(model_dir: Path, dtype: str, mode: str, group_size: int, lm_head: bool):
    from tokenyard.engines.core.config import EngineConfig
    from tokenyard.engines.model.model_config import ModelConfig
    from tokenyard.engines.quant.engine_model import load_engine_model

    tdtype = EngineConfig(dtype=dtype).torch_dtype(torch.device("cpu"))
    cfg = ModelConfig.from_dir(model_dir)
    model = load_engine_model(model_dir, tdtype, torch.device("cpu"), 512, False, cfg, mode, group_size)[0]
    if mode != "none" and not lm_head:
        keep_float_head(model, model_dir)
    return model


# -- quality ----------------------------------------------------------------------------------

def quality(model_dir: Path, n_items: int, modes: dict, bar: tqdm) -> dict:
    from tokenyard.demo import task_suite

    encoded = encoded_items(model_dir, n_items)
    items = task_suite.generate_items("test", n_items, seed=7)
    chats = [list(it.messages) for it in items]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    out, ref_argmax, ref_nll, ref_tokens = {}, None, None, None
    for name, (dtype, mode, group, lm_head) in modes.items():
        bar.set_postfix_str(f"{model_dir.name} {name}")
        model = load_mode(model_dir, dtype, mode, group, lm_head)
        nll, argmax = answer_nll(model, encoded)
        del model
        llm = LLM(model_dir, dtype=dtype, quantization=mode, quant_group_size=group, kv_cache_memory=128 << 20,
                  progress=False)
        if mode != "none" and not lm_head:
            keep_float_head(llm.engine.model, model_dir)
        gens = llm.chat(chats, params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in gens]
        acc = sum(it.check(o.outputs[0].text) for it, o in zip(items, gens)) / len(items)
        if ref_argmax is None:
            ref_argmax, ref_nll, ref_tokens = argmax, nll, tokens
        out[name] = {
            "answer_nll": nll, "nll_delta": nll - ref_nll,
            "top1_agreement": float((argmax == ref_argmax).float().mean()),
            "greedy_agreement": sum(a == b for a, b in zip(tokens, ref_tokens)) / len(tokens),
            "accuracy": acc,
        }
        bar.update(1)
    return out


# -- speed ------------------------------------------------------------------------------------

def _prefill(engine: Engine, batch: int, max_tokens: int, vocab: int) -> list[str]:
    g = torch.Generator().manual_seed(batch)
    rids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in rids:
        engine.add_request(rid, torch.randint(3, vocab, (32,), generator=g).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.scheduler.waiting or engine._inbox.num_new or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()  # prefill everything first: only decode steps are timed
    return rids


def _timed_steps(engine: Engine, batch: int, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        assert engine.stats().last_step_tokens == batch
    return times


def speed(model_dir: Path, batches: list[int], steps: int, warmup: int, rounds: int, bar: tqdm) -> dict:
    """All modes' engines are loaded side by side and timed in interleaved rounds, so a burst of
    load from a neighbour on a shared machine hits every mode alike; the median step counts."""
    engines, out = {}, {}
    for name, opts in SPEED_MODES.items():
        bar.set_postfix_str(f"load {name}")
        t0 = time.perf_counter()
        engine = Engine(model_dir, kv_cache_memory=128 << 20, max_num_seqs=64, progress=False, **opts)
        if name.endswith("keep-head"):
            keep_float_head(engine.model, model_dir)
        weights = sum(t.numel() * t.element_size() for t in
                      {id(t): t for t in [*engine.model.parameters(), *engine.model.buffers()]}.values())
        out[name] = {"load_s": time.perf_counter() - t0, "weight_bytes": weights, "dtype": str(engine.dtype)}
        engines[name] = engine
    vocab = SPEED_MODEL["vocab_size"]
    per_round = -(-steps // rounds)
    for b in batches:
        times: dict[str, list[float]] = {name: [] for name in engines}
        rids = {}
        for name, engine in engines.items():
            rids[name] = _prefill(engine, b, warmup + per_round * rounds + 4, vocab)
            _timed_steps(engine, b, warmup)
        for _ in range(rounds):
            for name, engine in engines.items():
                bar.set_postfix_str(f"batch {b} {name}")
                times[name] += _timed_steps(engine, b, per_round)
                bar.update(1)
        for name, engine in engines.items():
            for rid in rids[name]:
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
            t = sorted(times[name])
            median = t[len(t) // 2]
            out[name][f"batch{b}"] = {"tok_s": b / median, "step_ms_median": 1e3 * median,
                                      "tok_s_mean": b * len(t) / sum(t), "steps": len(t)}
    base = out["none-bf16"]
    for name in out:
        for b in batches:
            out[name][f"batch{b}"]["speedup_vs_bf16"] = out[name][f"batch{b}"]["tok_s"] / base[f"batch{b}"]["tok_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out/quant.json")
    ap.add_argument("--model-dir", default="bench/out/quant-llama-200m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds the timed steps are spread over")
    ap.add_argument("--items", type=int, default=256, help="held-out task-suite items per demo model")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/quant_{speed,quality}.json")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder, load_avg
    rec_speed, rec_quality = RunRecorder("quant_speed"), RunRecorder("quant_quality")

    from tokenyard.bench.random_checkpoint import build_random_checkpoint

    result: dict = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                               f"torch {torch.__version__}",
                    "date": time.strftime("%Y-%m-%d %H:%M")}
    total = (0 if args.skip_speed else len(SPEED_MODES) * len(args.batches) * args.rounds) + \
            (0 if args.skip_quality else len(QUALITY_MODES) * len(DEMO_MODELS))
    with tqdm(total=total, desc="quant bench", unit="run") as bar:
        if not args.skip_speed:
            model_dir = build_random_checkpoint(args.model_dir, "llama", seed=0, std=0.02, **SPEED_MODEL)
            n_params = sum(v for v in _param_count(model_dir))
            result["speed_model"] = {"dir": str(model_dir), "parameters": n_params, **SPEED_MODEL}
            result["speed"] = speed(model_dir, args.batches, args.steps, args.warmup, args.rounds, bar)
            if not args.no_results:
                rec_speed.write({"speed": result["speed"]}, [], speed_model=result["speed_model"],
                                steps=args.steps, warmup=args.warmup, rounds=args.rounds)
        if not args.skip_quality:
            rec_quality.load_before = load_avg()      # the quality pass starts now, after the speed pass
            result["quality_items"] = args.items
            result["quality"] = {m.name: quality(m, args.items, QUALITY_MODES, bar) for m in DEMO_MODELS}
            if not args.no_results:
                rec_quality.write({"quality": result["quality"]}, [], items=args.items)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(markdown(result))


def _param_count(model_dir: Path):
    from safetensors import safe_open

    from tokenyard.engines.weights.checkpoint import safetensors_files

    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield math.prod(fh.get_slice(name).get_shape())


def markdown(result: dict) -> str:
    lines = []
    if "speed" in result:
        lines += ["| mode | weights MiB | batch 1 tok/s | vs bf16 | batch 32 tok/s | vs bf16 |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, r in result["speed"].items():
            b1, b32 = r.get("batch1", {}), r.get("batch32", {})
            lines.append(f"| {name} | {r['weight_bytes'] / 2**20:.0f} | {b1.get('tok_s', 0):.1f} | "
                         f"{b1.get('speedup_vs_bf16', 0):.2f}x | {b32.get('tok_s', 0):.1f} | "
                         f"{b32.get('speedup_vs_bf16', 0):.2f}x |")
    for model, rows in result.get("quality", {}).items():
        lines += ["", f"{model}:", "| mode | answer NLL | delta | top-1 agree | greedy agree | accuracy |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, r in rows.items():
            lines.append(f"| {name} | {r['answer_nll']:.4f} | {r['nll_delta']:+.4f} | {r['top1_agreement']:.3f} | "
                         f"{r['greedy_agreement']:.3f} | {r['accuracy']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
