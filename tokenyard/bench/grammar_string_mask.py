"""Per-token mask cost of JSON string grammars on SmolLM2's vocabulary (xgrammar), at a string's start and deep in it.

    python -m tokenyard.bench.grammar_string_mask [--reps 20] [--budget-s 2]

Why: a bounded string written as a repeat of a character-or-escape rule (`char{0, 512}`, char ::= [...] | "\\" escape;
the rewrite of a0873a5) made xgrammar 0.2.9 fill a mask in 150 ms at a string's start and 1.8 s at 100+ characters,
on the engine's step, for the whole batch (bench/RESULTS.md, structured parse()). Measured here, each on the
49,152-token vocabulary (RAW bytes, as tokenyard.engines.core.structured_output.Grammars builds it):
- shipped: what Grammars compiles now (tokenyard.engines.core.json_grammar) for a schema with one string property:
  no maxLength (at the opening quote, 116 and 250 characters in, and 0 and 100 characters past a `\\n` written
  after 100; plus the slowest of the positions 0, 4, 8, ... 252, "worst"), maxLength 512 and maxLength 16;
- shipped, inside lists: 12 items into a list of objects and into an enum list (strings inside the item cap);
- reference forms, written out as EBNF: xgrammar's recursive string rule, a plain character class repeat
  `[^"\\\\\\x00-\\x1f]{0, 512}`, and the slow alternation repeat.
For each: the mask fill time (median and max of `reps` fills, or as many as `budget-s` allows) after the opening
quote and after 300 characters of plain text (8 for maxLength 16) unless said above; 116 characters in was the old
512-character run's slowest point (1.2-2.9 ms here: xgrammar's unrolled part of a `{0, n}` repeat ends at 127).
Writes bench/results/grammar_string_mask.json.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import time
from typing import Any

import torch

from tokenyard.bench.results_io import RunRecorder
from tokenyard.engines.core.structured_output import Grammars
from tokenyard.engines.text.tokenizer import Tokenizer
from tokenyard.engines.weights.gguf_models import smollm2_path

TEXT = ("The quick brown fox jumps over the lazy dog while a small model keeps writing its answer. " * 8)
_CHAR = '[^\\0-\\x1f\\"\\\\]'
_ESCAPE = 'esc ::= (([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'
# Reference string grammars (root: an opening quote, then the string's rule through its closing quote).
FORMS = {
    "recursive (xgrammar's own rule)":
        f'root ::= "\\"" sub\nsub ::= ("\\"" | {_CHAR} sub | "\\\\" esc sub)\n{_ESCAPE}\n',
    "class repeat {0, 512}":
        f'root ::= "\\"" {_CHAR}{{0, 512}} "\\""\n',
    "alternation repeat {0, 512} (a0873a5, slow)":
        f'root ::= "\\"" ch{{0, 512}} "\\""\nch ::= ({_CHAR} | "\\\\" esc)\n{_ESCAPE}\n',
}
_MEMBERS = {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}, "role": {"type": "string"}},
                                      "required": ["name", "role"]}}
# Strings deep in a bounded list (the item-count repeat around them), 12 items in: a list of objects (a member's
# name, at its start) and an enum list (after ", ").
LISTS = {
    "shipped, 13th member's name in a list of objects":
        ({"type": "object", "properties": {"members": _MEMBERS}, "required": ["members"]},
         '{"members": [' + ", ".join(['{"name": "Ann", "role": "dev"}'] * 12) + ', {"name": "'),
    "shipped, 13th item of an enum list":
        ({"type": "object", "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}},
          "required": ["colours"]},
         '{"colours": [' + ", ".join(['"red"'] * 12) + ", "),
}
SHIPPED = {"no maxLength": {"type": "string"}, "maxLength 512": {"type": "string", "maxLength": 512},
           "maxLength 16": {"type": "string", "maxLength": 16}}


def _fill_times(matcher: Any, bitmask: torch.Tensor, reps: int, budget_s: float) -> list[float]:
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (not times or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure(xgr: Any, compiled: Any, prefix: str, depths: list[int], vocab_size: int, reps: int,
            budget_s: float) -> list[dict[str, Any]]:
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    rows = []
    for depth in depths:
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(prefix + TEXT[:depth]), (prefix, depth)
        times = _fill_times(m, bitmask, reps, budget_s)
        allowed = int(sum(bin(w & 0xFFFFFFFF).count("1") for w in bitmask[0].tolist()))
        rows.append({"chars_in": depth, "fills": len(times), "median_ms": statistics.median(times),
                     "max_ms": max(times), "allowed_tokens": allowed})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20, help="mask fills per point (fewer when --budget-s runs out)")
    ap.add_argument("--budget-s", type=float, default=2.0, help="seconds per point before stopping early")
    args = ap.parse_args()
    rec = RunRecorder("grammar_string_mask")
    torch.set_num_threads(1)
    path = smollm2_path()
    tok = Tokenizer.from_dir(path)
    stops = list(tok.eos_token_ids)
    token_bytes = [tok.id_to_bytes(i) for i in range(tok.vocab_size)]
    grammars = Grammars(token_bytes, tok.vocab_size, stops)
    xgr = grammars._xgr
    info = xgr.TokenizerInfo(token_bytes, xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=stops)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    runs: list[dict[str, Any]] = []
    for label, string_schema in SHIPPED.items():
        schema = {"type": "object", "properties": {"s": string_schema}, "required": ["s"], "additionalProperties": False}
        compiled = grammars.compile({"type": "json_schema", "schema": schema})
        if "maxLength" not in string_schema:
            rows = measure(xgr, compiled, '{"s": "', [0, 116, 250], tok.vocab_size, args.reps, args.budget_s)
            after = measure(xgr, compiled, '{"s": "' + TEXT[:100] + "\\n", [0, 100], tok.vocab_size, args.reps,
                            args.budget_s)
            every = measure(xgr, compiled, '{"s": "', list(range(0, 256, 4)), tok.vocab_size, 3, args.budget_s)
            runs.append({"grammar": f"shipped, {label}", "rows": rows})
            runs.append({"grammar": f"shipped, {label}, past an escape", "rows": after})
            runs.append({"grammar": f"shipped, {label}, worst of 0-252", "rows": [max(every, key=lambda r: r["median_ms"])]})
            continue
        depths = [0, 8] if string_schema.get("maxLength", 10**9) < 300 else [0, 300]
        runs.append({"grammar": f"shipped, {label}", "rows": measure(xgr, compiled, '{"s": "', depths, tok.vocab_size,
                                                                    args.reps, args.budget_s)})
    for label, (schema, prefix) in LISTS.items():
        compiled = grammars.compile({"type": "json_schema", "schema": schema})
        runs.append({"grammar": label, "rows": measure(xgr, compiled, prefix, [0], tok.vocab_size, args.reps,
                                                       args.budget_s)})
    for label, ebnf in FORMS.items():
        compiled = compiler.compile_grammar(ebnf)
        runs.append({"grammar": label, "ebnf": ebnf,
                     "rows": measure(xgr, compiled, '"', [0, 300], tok.vocab_size, args.reps, args.budget_s)})
    for run in runs:
        for row in run["rows"]:
            print(f"{run['grammar']:<46} {row['chars_in']:>4} chars in: median {row['median_ms']:9.3f} ms, "
                  f"max {row['max_ms']:9.3f} ms ({row['fills']} fills, {row['allowed_tokens']} tokens allowed)")
    figures = {f"{run['grammar']} @ {row['chars_in']}": round(row["median_ms"], 4) for run in runs for row in run["rows"]}
    rec.write(figures, runs, xgrammar_version=importlib.metadata.version("xgrammar"), vocab_size=tok.vocab_size,
              unit="ms per mask fill (median)")


if __name__ == "__main__":
    main()
