"""Structured outputs on the real model: do constrained generations validate, and what do they cost?

    python -m tokenyard.bench.structured_outputs_bench [--per-schema 50] [--tpot-tokens 48] [--repeats 3]

1. Validity: `per-schema` generations for each of the ten schemas in tokenyard/bench/json_schemas.py (500 by
   default), sampled (temperature 0.8, a seed per request), batched through the engine; each reply
   that finishes with "stop" must parse and validate with `jsonschema`. Replies cut by max_tokens
   ("length") are counted separately: they are not claimed to be valid.
2. TPOT: time per output token at batch 1 and 32, plain vs json_schema, on SmolLM2-135M int4 (the
   served configuration). The engine is stepped directly and the figure is the median step time
   while all requests of the batch are decoding (after the last prefill, before the first
   finishes: each such step is one output token for every request); the run is repeated (plain
   and constrained interleaved) and the median of the repeat medians is reported.
   Plain requests ignore EOS and constrained ones use a schema that needs more than `tpot-tokens`
   tokens, so both decode the same number of tokens. Constrained runs are measured twice, on two
   engines built alike but for the engine option grammar_mask_overlap: masks filled while the forward
   runs ("json_schema", the default) and filled inline after it ("json_schema_inline"); each is
   compared with plain runs on its own engine ("plain", "plain_inline"), and the four kinds rotate
   their order round by round. `--compare argmax` instead runs one engine with constrained greedy rows
   picked in C from the bitmask ("json_schema", the default) and masked by torch.where before the argmax
   ("json_schema_torch_argmax", TOKENYARD_MASKED_ARGMAX=torch), each against the same plain runs.

Writes bench/results/structured_outputs.json (structured_outputs_tpot.json with --only tpot)
through tokenyard.bench.results_io.RunRecorder.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Any, Iterator

import jsonschema
from tqdm import tqdm

from tokenyard.bench.json_schemas import PROMPTS, SCHEMAS
from tokenyard.bench.results_io import RunRecorder
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.runtime.llm import LLM
from tokenyard.engines.text.chat_template import apply_chat_template
from tokenyard.engines.weights.gguf_models import smollm2_path

# A schema whose every valid document is long (> 48 tokens): 8 required words of 4-12 letters.
LONG = {"type": "object", "properties": {"words": {"type": "array", "minItems": 8, "maxItems": 8, "items": {
    "type": "string", "pattern": "^[a-z]{4,12}$"}}}, "required": ["words"], "additionalProperties": False}


def make_llm(batch: int, cpu_compile: str = "off", overlap: bool = True) -> LLM:
    # cpu_compile off by default: the grammar's cost is measured on the eager decode step, whose
    # time does not depend on a compile cache; --cpu-compile auto measures the compiled step.
    return LLM(smollm2_path(), quantization="int4", quant_group_size=32, kv_cache_memory=512 << 20,
               max_num_seqs=batch, progress=False, cpu_compile=cpu_compile, grammar_mask_overlap=overlap)


def validity(llm: LLM, per_schema: int, max_tokens: int) -> dict[str, Any]:
    convs, params, names = [], [], []
    for name in sorted(SCHEMAS):
        for i in range(per_schema):
            convs.append([{"role": "user", "content": f"{PROMPTS[name]} Example {i + 1}."}])
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1000 + i,
                                         response_format={"type": "json_schema", "schema": SCHEMAS[name]}))
            names.append(name)
    t0 = time.perf_counter()
    results = llm.chat(convs, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    per: dict[str, dict[str, int]] = {n: {"valid": 0, "invalid": 0, "length": 0} for n in SCHEMAS}
    failures = []
    for name, res in zip(names, results):
        out = res.outputs[0]
        if out.finish_reason == "length":
            per[name]["length"] += 1
            continue
        try:
            jsonschema.validate(json.loads(out.text), SCHEMAS[name])
            per[name]["valid"] += 1
        except (ValueError, jsonschema.ValidationError) as e:
            per[name]["invalid"] += 1
            failures.append({"schema": name, "text": out.text[:200], "error": str(e)[:200]})
    total = {k: sum(p[k] for p in per.values()) for k in ("valid", "invalid", "length")}
    return {"generations": len(results), **total, "per_schema": per, "failures": failures[:10],
            "wall_s": round(wall, 1), "max_tokens": max_tokens}


def tpot_run(llm: LLM, batch: int, tokens: int, constrained: bool, round_no: int) -> dict[str, Any]:
    """Median decode step time while all `batch` requests are decoding: after the last prefill,
    before the first request finishes. Each such step gives every request one token, so it is
    the TPOT of a batch of that size."""
    engine, tok = llm.engine, llm.tokenizer
    fmt = {"type": "json_schema", "schema": LONG} if constrained else None
    for i in range(batch):
        text = apply_chat_template(tok, [{"role": "user", "content": f"List eight words about topic {i}, as JSON."}])
        engine.add_request(f"r{round_no}-{i}", tok.encode(text, add_special_tokens=False),
                           SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=not constrained,
                                          response_format=fmt))
    started: set[str] = set()
    finished = 0
    steady: list[float] = []
    finishes = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        was_steady = len(started) == batch and finished == 0
        for o in outs:
            if o.new_token_ids:
                started.add(o.request_id)
            if o.finished:
                finished += 1
                finishes.append(o.finish_reason)
        if was_steady and len(outs) == batch:
            steady.append(dt * 1e3)
    return {"tpot_ms_median": round(statistics.median(steady), 3), "steady_steps": len(steady),
            "finish_reasons": sorted(set(finishes))}


# (kind, engine, TOKENYARD_MASKED_ARGMAX): constrained runs are compared with the plain runs of the same engine
KINDS = {
    # --compare overlap: masks filled while the forward runs vs inline (two engines)
    "overlap": (("plain", "overlap", None), ("json_schema", "overlap", None), ("plain_inline", "inline", None),
                ("json_schema_inline", "inline", None)),
    # --compare argmax: greedy constrained rows picked in C from the bitmask vs masked by torch.where (one engine)
    "argmax": (("plain", "overlap", None), ("json_schema", "overlap", None),
               ("json_schema_torch_argmax", "overlap", "torch")),
}
BASELINE = {"json_schema": "plain", "json_schema_inline": "plain_inline", "json_schema_torch_argmax": "plain"}


def tpot(batch: int, tokens: int, repeats: int, cpu_compile: str, compare: str = "overlap") -> dict[str, Any]:
    kinds = KINDS[compare]
    llms = {"overlap": make_llm(batch, cpu_compile)}
    if compare == "overlap":
        llms["inline"] = make_llm(batch, cpu_compile, overlap=False)
    for llm in llms.values():
        tpot_run(llm, min(batch, 2), 4, True, -1)    # warm-up: compile the grammar, touch the weights
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k, _, _ in kinds}
    n = 0
    for r in tqdm(range(repeats), desc=f"TPOT batch {batch}"):
        for k in range(len(kinds)):
            kind, engine, argmax = kinds[(r + k) % len(kinds)]   # rotate: each kind takes each place in turn
            with _masked_argmax(argmax):
                runs[kind].append(tpot_run(llms[engine], batch, tokens, kind.startswith("json"), n))
            n += 1
    med = {k: statistics.median(x["tpot_ms_median"] for x in v) for k, v in runs.items()}
    pairs = [(c, BASELINE[c]) for c in runs if c in BASELINE]
    # per round, constrained over the same engine's plain run of that round
    ratios = {c: [round((a["tpot_ms_median"] / b["tpot_ms_median"] - 1) * 100, 1) for a, b in zip(runs[c], runs[p])]
              for c, p in pairs}
    return {"batch": batch, "tokens": tokens, "compare": compare, "tpot_ms": {k: round(v, 3) for k, v in med.items()},
            **{f"overhead{c[len('json_schema'):]}_pct": round((med[c] / med[p] - 1) * 100, 1) for c, p in pairs},
            "overhead_pct_per_round": ratios, "runs": runs}


@contextlib.contextmanager
def _masked_argmax(mode: str | None) -> Iterator[None]:
    """TOKENYARD_MASKED_ARGMAX set to mode for one run (None: as it was)."""
    old = os.environ.get("TOKENYARD_MASKED_ARGMAX")
    if mode is not None:
        os.environ["TOKENYARD_MASKED_ARGMAX"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENYARD_MASKED_ARGMAX", None)
        else:
            os.environ["TOKENYARD_MASKED_ARGMAX"] = old


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-schema", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--tpot-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="validity,tpot")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--cpu-compile", default="off", choices=("auto", "on", "off"))
    ap.add_argument("--batches", default="1,32", help="TPOT batch sizes, comma-separated")
    ap.add_argument("--compare", default="overlap", choices=sorted(KINDS),
                    help="overlap: masks while the forward runs vs inline; argmax: C masked argmax vs torch.where")
    ap.add_argument("--name", default="", help="results file name (default: structured_outputs[_tpot])")
    args = ap.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    # One file per part, so the parts can be re-run apart: validity -> structured_outputs.json,
    # tpot -> structured_outputs_tpot.json.
    rec = RunRecorder(args.name or ("structured_outputs_tpot" if args.only == "tpot" else "structured_outputs"))
    figures: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    only = set(args.only.split(","))
    if "tpot" in only:
        for batch in (int(b) for b in args.batches.split(",")):
            res = tpot(batch, args.tpot_tokens, args.repeats, args.cpu_compile, args.compare)
            print({k: v for k, v in res.items() if k != "runs"}, flush=True)
            runs.append({"part": "tpot", **res})
            figures[f"tpot_batch_{batch}"] = {**{f"{k}_ms": v for k, v in res["tpot_ms"].items()},
                                              **{k: v for k, v in res.items() if k.startswith("overhead") and k.endswith("_pct")}}
    if "validity" in only:
        res = validity(make_llm(32), args.per_schema, args.max_tokens)
        print({k: v for k, v in res.items() if k != "per_schema"}, flush=True)
        runs.append({"part": "validity", **res})
        figures["validity"] = {k: res[k] for k in ("generations", "valid", "invalid", "length")}
    import torch
    figures["torch_threads"] = torch.get_num_threads()
    figures["cpu_compile"] = args.cpu_compile
    rec.write(figures=figures, runs=runs)


if __name__ == "__main__":
    main()
