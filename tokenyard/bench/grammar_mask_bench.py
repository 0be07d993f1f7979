"""Per-token mask cost of three grammar libraries at batch 32, on SmolLM2's tokenizer.

    python -m tokenyard.bench.grammar_mask_bench [--steps 60] [--batch 32]

For each library: compile one JSON schema (nested object, enum, array, bounded numbers) against
the 49,152-token vocabulary, then run `batch` matchers in lock step over the token ids of 32
different valid documents: each step fills the token bitmask of every row, then advances every
row by its next token. Reported per step (= one decode step of a batch of 32 constrained rows):
the mask fill time and the advance time, median and p90, plus the compile time.

Then the engine's own path (fill + unpack onto the logits, tokenyard.engines.model.sampler.apply_token_masks).

Last (--decode-tokens N, default 48), the real model end to end: 32 greedy requests at once,
plain vs constrained, output tokens per second.

Writes bench/results/grammar_mask.json through tokenyard.bench.results_io.RunRecorder.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch

from tokenyard.bench.results_io import RunRecorder
from tokenyard.engines.text.tokenizer import Tokenizer
from tokenyard.engines.weights.gguf_models import smollm2_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "tags", "address", "score"],
    "additionalProperties": False,
}


def documents(n: int) -> list[str]:
    roles = ["admin", "user", "guest"]
    return [json.dumps({"name": f"Person number {i}", "age": 20 + i, "role": roles[i % 3],
                        "tags": [f"t{j}" for j in range(i % 4)],
                        "address": {"city": ["Paris", "Lima", "Oslo"][i % 3], "zip": f"{10000 + i}"},
                        "score": round(0.01 * i, 2)}) for i in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_lockstep(fill: Callable[[], None], advance: Callable[[int], None], steps: int) -> dict[str, float]:
    fills, advances = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        advance(step)
        t2 = time.perf_counter()
        fills.append((t1 - t0) * 1e3)
        advances.append((t2 - t1) * 1e3)
    return {"fill_ms_median": round(statistics.median(fills), 4), "fill_ms_p90": round(_pct(fills, 0.9), 4),
            "advance_ms_median": round(statistics.median(advances), 4),
            "advance_ms_p90": round(_pct(advances, 0.9), 4), "steps": steps}


def bench_xgrammar(tok: Tokenizer, vocab: list[bytes], seqs: list[list[int]], steps: int) -> dict[str, Any]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    out: dict[str, Any] = {"library": "xgrammar", "version": xgr.__version__ if hasattr(xgr, "__version__") else None,
                           "tokenizer_info_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 3)}
    bitmask = xgr.allocate_token_bitmask(len(seqs), info.vocab_size)
    for mode in ("loop", "batch"):
        ms = [xgr.GrammarMatcher(compiled) for _ in seqs]
        batch = xgr.BatchGrammarMatcher(max_threads=2) if mode == "batch" else None

        def fill() -> None:
            if batch is not None:
                batch.batch_fill_next_token_bitmask(ms, bitmask)
            else:
                for i, m in enumerate(ms):
                    m.fill_next_token_bitmask(bitmask, i)

        def advance(step: int) -> None:
            for m, s in zip(ms, seqs):
                assert m.accept_token(s[step]), "xgrammar refused a token of a valid document"

        out[mode] = run_lockstep(fill, advance, steps)
    out["apply_mask_ms"] = _apply_cost(lambda logits: xgr.apply_token_bitmask_inplace(logits, bitmask), len(seqs),
                                       len(vocab))
    return out


def bench_llguidance(tok: Tokenizer, vocab: list[bytes], seqs: list[list[int]], steps: int) -> dict[str, Any]:
    import llguidance as llg
    import llguidance.torch as llt

    class _Vocab:
        eos_token_id = tok.eos_token_id
        bos_token_id = None
        tokens = vocab
        special_token_ids = tok.all_special_ids

        def __call__(self, s: str) -> list[int]:
            return tok.encode(s, add_special_tokens=False)

    t0 = time.perf_counter()
    lltok = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab()))
    t1 = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    probe = llg.LLMatcher(lltok, grammar)
    t2 = time.perf_counter()
    out: dict[str, Any] = {"library": "llguidance", "version": llg.get_version() if hasattr(llg, "get_version") else None,
                           "tokenizer_info_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 3),
                           "error": probe.get_error() or None}
    bitmask = llt.allocate_token_bitmask(len(seqs), lltok.vocab_size)
    executor = llg.LLExecutor()
    for mode in ("loop", "batch"):
        ms = [llg.LLMatcher(lltok, grammar) for _ in seqs]

        def fill() -> None:
            if mode == "batch":
                llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ms)], bitmask)
            else:
                for i, m in enumerate(ms):
                    llt.fill_next_token_bitmask(m, bitmask, i)

        def advance(step: int) -> None:
            for m, s in zip(ms, seqs):
                assert m.consume_token(s[step]), f"llguidance refused a token: {m.get_error()}"

        out[mode] = run_lockstep(fill, advance, steps)
    out["apply_mask_ms"] = _apply_cost(lambda logits: llt.apply_token_bitmask_inplace(logits, bitmask), len(seqs),
                                       len(vocab))
    return out


def bench_outlines(tok: Tokenizer, vocab: list[bytes], seqs: list[list[int]], steps: int,
                   budget_s: float) -> dict[str, Any]:
    import outlines_core as oc

    eos = tok.eos_token_id
    mapping: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocab):
        if i != eos and b:
            mapping.setdefault(b, []).append(i)
    t0 = time.perf_counter()
    voc = oc.Vocabulary(eos, mapping)
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    t1 = time.perf_counter()
    index = oc.Index(regex, voc)   # the whole DFA x vocabulary product, built up front
    t2 = time.perf_counter()
    out: dict[str, Any] = {"library": "outlines-core", "version": None, "tokenizer_info_s": round(t1 - t0, 3),
                           "compile_s": round(t2 - t1, 3), "regex_chars": len(regex)}
    if t2 - t1 > budget_s:
        out["note"] = f"compile took over {budget_s} s; per-token figures still taken"
    mask = torch.zeros(len(seqs), (len(vocab) + 31) // 32, dtype=torch.int32)
    guides = [oc.Guide(index) for _ in seqs]

    def fill() -> None:
        for i, g in enumerate(guides):
            g.write_mask_into(mask[i].data_ptr(), mask[i].numel(), mask.element_size())

    def advance(step: int) -> None:
        for g, s in zip(guides, seqs):
            g.advance(s[step])

    out["loop"] = run_lockstep(fill, advance, steps)
    return out


def bench_engine_path(tok: Tokenizer, seqs: list[list[int]], steps: int) -> dict[str, Any]:
    """What the engine pays per step: tokenyard.engines.core.structured_output constraints (xgrammar) filling
    their rows, then tokenyard.engines.model.sampler.apply_token_masks unpacking the bits onto the logits,
    for a batch of 32 constrained rows, and for 32 rows of which 4 are constrained."""
    from tokenyard.engines.core.structured_output import Grammars
    from tokenyard.engines.model.sampler import apply_token_masks

    grammars = Grammars.from_tokenizer(tok, tok.vocab_size, list(tok.eos_token_ids))
    fmt = {"type": "json_schema", "schema": SCHEMA}
    out: dict[str, Any] = {"library": "engine path (xgrammar + torch unpack)"}
    logits = torch.randn(len(seqs), tok.vocab_size)
    for label, every in (("all_rows", 1), ("one_in_8_rows", 8)):
        cons = [grammars.constraint(fmt) if i % every == 0 else None for i in range(len(seqs))]

        def fill() -> None:
            apply_token_masks(logits, cons)

        def advance(step: int) -> None:
            for c, s in zip(cons, seqs):
                if c is not None:
                    assert c.accept(s[step])

        out[label] = run_lockstep(fill, advance, steps)
    return out


def bench_engine_decode(batch: int, max_tokens: int) -> dict[str, Any]:
    """End to end on the real model: `batch` requests at once through the offline LLM (int4 from
    the GGUF, greedy), plain vs json_schema-constrained; output tokens per second of wall time."""
    from tokenyard.engines.core.sampling_params import SamplingParams
    from tokenyard.engines.runtime.llm import LLM

    llm = LLM(smollm2_path(), quantization="int4", quant_group_size=32, kv_cache_memory=256 << 20,
              max_num_seqs=batch, progress=False)
    convs = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(batch)]
    out: dict[str, Any] = {"library": "engine decode (SmolLM2 int4, offline LLM)", "batch": batch,
                           "max_tokens": max_tokens}
    llm.chat(convs[:2], SamplingParams(max_tokens=4, temperature=0.0))   # warm-up
    for label, fmt in (("plain", None), ("json_schema", {"type": "json_schema", "schema": SCHEMA})):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=fmt is None, response_format=fmt)
        t0 = time.perf_counter()
        res = llm.chat(convs, params)
        wall = time.perf_counter() - t0
        toks = sum(len(r.outputs[0].token_ids) for r in res)
        out[label] = {"wall_s": round(wall, 3), "output_tokens": toks, "output_tok_s": round(toks / wall, 1),
                      "finish_reasons": sorted({r.outputs[0].finish_reason for r in res})}
    return out


def _apply_cost(apply: Callable[[torch.Tensor], None], rows: int, vocab: int) -> float:
    logits = torch.randn(rows, vocab)
    apply(logits)
    t0 = time.perf_counter()
    for _ in range(20):
        apply(logits)
    return round((time.perf_counter() - t0) / 20 * 1e3, 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--skip", default="", help="comma-separated libraries to skip")
    ap.add_argument("--decode-tokens", type=int, default=48, help="end-to-end decode comparison (0: skip)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rec = RunRecorder("grammar_mask")
    tok = Tokenizer.from_dir(smollm2_path())
    vocab = [tok.id_to_bytes(i) for i in range(tok.vocab_size)]
    seqs = [tok.encode(d, add_special_tokens=False) for d in documents(args.batch)]
    steps = min(args.steps, min(len(s) for s in seqs))
    runs = []
    skip = set(args.skip.split(","))
    if "xgrammar" not in skip:
        runs.append(bench_xgrammar(tok, vocab, seqs, steps))
        print(runs[-1], flush=True)
    if "llguidance" not in skip:
        runs.append(bench_llguidance(tok, vocab, seqs, steps))
        print(runs[-1], flush=True)
    if "outlines-core" not in skip:
        runs.append(bench_outlines(tok, vocab, seqs, steps, 60.0))
        print(runs[-1], flush=True)
    runs.append(bench_engine_path(tok, seqs, steps))
    print(runs[-1], flush=True)
    engine = runs[-1]
    if args.decode_tokens:
        runs.append(bench_engine_decode(args.batch, args.decode_tokens))
        print(runs[-1], flush=True)
    best = {r["library"]: min(r[m]["fill_ms_median"] for m in ("loop", "batch") if m in r) for r in runs
            if "loop" in r}
    rec.write(figures={"batch": args.batch, "vocab_size": len(vocab), "steps": steps,
                       "best_fill_ms_median_per_step": best,
                       "engine_mask_ms_median_per_step": {k: engine[k]["fill_ms_median"]
                                                          for k in ("all_rows", "one_in_8_rows")},
                       "engine_decode_tok_s": {k: runs[-1][k]["output_tok_s"] for k in ("plain", "json_schema")
                                               if k in runs[-1]},
                       "schema": SCHEMA}, runs=runs)


if __name__ == "__main__":
    main()
