"""What the C decode step's int8 activations (EngineConfig.activation_quant) cost in quality and give in speed.

    flock /work/cpu.lock .venv/bin/python -m tokenyard.bench.act_quant_quality [--only ppl agree demo speed]

For each model, activation_quant "on" (int8 inputs of the int8/int4 products at decode batches 1..7,
the default "auto" on AVX2/AVX-512 machines) against "off" (fp32 inputs), everything else equal:
- ppl: perplexity of the model's decode path on a fixed text, teacher-forced: the first token is
  prefilled, then every following token goes through the C decode step one at a time (batch 1, where
  the rounding happens), and the log-probability of the true next token is taken from its logits.
  The text: the first `--ppl-tokens` tokens of the repository's README.md (committed, fixed), in
  each model's own tokenizer.
- agree: greedy replies (`--max-tokens` tokens) to `--prompts` task-suite chat prompts with on and with
  off: how many are equal token for token, and the mean share of the reply before they part.
- demo: exact-match accuracy of the demo pair (int8 weights) on the first `--items` task-suite test
  items (tokenyard.demo.evaluate), with max_num_seqs 4 so every decode step is in the rounded range.
- speed: SmolLM2 batch-1 greedy decode tok/s (64 new tokens minus a 1-token request with the same
  32-token prompt), on and off interleaved, median of `--repeats`.
Models: SmolLM2-135M-Instruct from its Q4_1 GGUF as LLM(path) loads it by default (int4 blocks kept)
and requantised to int8 (quantization="int8"); the demo pair (models/demo-small, demo-large) with
quantization="int8" and cpu_decode_step "on" (they are below the 20M-parameter auto rule).
Writes bench/results/act_quant_quality.json (results_io.RunRecorder).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from tokenyard.bench.results_io import RunRecorder

ROOT = Path(__file__).resolve().parents[2]
DEMO = {"demo-small": ROOT / "tokenyard" / "models" / "demo-small", "demo-large": ROOT / "tokenyard" / "models" / "demo-large"}
TEXT = ROOT / "README.md"
COMMON = dict(kv_cache_memory=128 << 20, progress=False, max_num_seqs=4, enable_prefix_caching=False)


def models() -> dict[str, tuple[Path, dict]]:
    from tokenyard.engines.weights.gguf_models import smollm2_path
    path = smollm2_path()
    out = {"smollm2-default": (path, {}), "smollm2-int8": (path, dict(quantization="int8"))}
    for name, p in DEMO.items():
        out[name + "-int8"] = (p, dict(quantization="int8", cpu_decode_step="on"))
    return out


def _llm(path: Path, kw: dict, act: str):
    from tokenyard.engines import LLM
    llm = LLM(str(path), activation_quant=act, **COMMON, **kw)
    runner = llm.engine.runner
    assert runner.native is not None, "the C decode step must run for this measurement"
    return llm


def perplexity(llm, n_tokens: int) -> dict:
    """Teacher-forced perplexity of the C decode step on README.md's first n_tokens tokens: token p goes
    in at position p as a one-sequence decode step (its K/V written there), its logits score token p + 1."""
    import torch

    from tokenyard.engines import SamplingParams
    from tokenyard.engines.core.sequence import Sequence
    eng = llm.engine
    ids = llm.tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)[:n_tokens]
    seq = Sequence("ppl", list(ids), SamplingParams(), 0, 0, 0, frozenset())
    bs = eng.blocks.block_size
    eng.blocks.grow(seq.block_table, len(ids))
    table = seq.block_table
    nll = 0.0
    try:
        for p in range(len(ids) - 1):
            logits = eng.runner.native.run([ids[p]], [p], [table[p // bs] * bs + p % bs], [p + 1], [table])
            nll -= torch.log_softmax(logits[0].double(), -1)[ids[p + 1]].item()
    finally:
        eng.blocks.free(seq)
    return {"tokens": len(ids) - 1, "perplexity": math.exp(nll / (len(ids) - 1))}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    exact, shares = 0, []
    for x, y in zip(a, b):
        exact += x == y
        same = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        shares.append(same / max(len(x), len(y), 1))
    return {"prompts": len(a), "exact_match": exact, "mean_shared_prefix_share": statistics.fmean(shares)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=["ppl", "agree", "demo", "speed"])
    ap.add_argument("--ppl-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args(argv)
    from tokenyard.bench.serve_datasets import task_suite
    from tokenyard.demo import task_suite as suite
    from tokenyard.demo.evaluate import evaluate
    from tokenyard.engines import SamplingParams

    rec = RunRecorder("act_quant_quality")
    figures: dict = {"options": vars(args), "text": str(TEXT.relative_to(ROOT)), "engine": COMMON}
    runs: list = []
    chats = [r.messages for r in task_suite(args.prompts, seed=0)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    items = suite.generate_items("test", args.items, seed=0)
    for name, (path, kw) in models().items():
        smol = name.startswith("smollm2")
        row: dict = {"options": kw}
        replies = {}
        for act in ("on", "off"):
            t0 = time.perf_counter()
            llm = _llm(path, kw, act)
            row.setdefault("activation_quant", {})[act] = llm.engine.runner.activation_quant
            if "ppl" in args.only:
                row.setdefault("perplexity", {})[act] = perplexity(llm, args.ppl_tokens)
            if "agree" in args.only and smol:
                outs = llm.chat(chats, greedy, use_tqdm=False)
                replies[act] = [o.outputs[0].token_ids for o in outs]
            llm.close()
            del llm
            if "demo" in args.only and not smol:
                table = evaluate(path, items, use_tqdm=False, activation_quant=act,
                                 **{k: v for k, v in COMMON.items() if k != "progress"}, **kw)
                row.setdefault("demo_accuracy", {})[act] = table["all"][0]
            print(f"{name} {act}: {time.perf_counter() - t0:.0f} s", {k: v.get(act) for k, v in row.items()
                                                                        if isinstance(v, dict) and act in v}, flush=True)
        if replies:
            row["greedy_agreement"] = {"max_tokens": args.max_tokens, **agreement(replies["on"], replies["off"])}
        figures[name] = row
    if "speed" in args.only:
        figures["decode_speed_b1"], runs = speed(args.repeats)
    print(figures)
    if not args.no_results:
        print(rec.write(figures, runs))
    return 0


def speed(repeats: int, decode_tokens: int = 64) -> tuple[dict, list]:
    from tokenyard.engines import SamplingParams
    ms = {k: v for k, v in models().items() if k.startswith("smollm2")}
    llms = {(name, act): _llm(path, kw, act) for name, (path, kw) in ms.items() for act in ("on", "off")}
    tok = next(iter(llms.values())).tokenizer
    prompt = tok.encode("the lighthouse keeper watched the grey sea while ships passed " * 8, add_special_tokens=False)[:32]
    one, many = SamplingParams(temperature=0.0, max_tokens=1), SamplingParams(temperature=0.0, max_tokens=decode_tokens,
                                                                              ignore_eos=True)

    def timed(llm, params) -> float:
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - t0

    for llm in llms.values():
        timed(llm, many)                      # warm-up
    runs = []
    for r in range(repeats):
        for (name, act), llm in llms.items():
            base, full = timed(llm, one), timed(llm, many)
            runs.append({"model": name, "activation_quant": act, "repeat": r,
                         "decode_tok_s": (decode_tokens - 1) / max(full - base, 1e-9)})
            print(runs[-1], flush=True)
    for llm in llms.values():
        llm.close()
    figures = {f"{name}/{act}": statistics.median(x["decode_tok_s"] for x in runs
                                                  if x["model"] == name and x["activation_quant"] == act)
               for name, act in llms}
    return figures, runs


if __name__ == "__main__":
    raise SystemExit(main())
