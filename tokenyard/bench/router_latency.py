"""Decision latency of the learned router per request, features included, up to 8k-token prompts.

    python -m tokenyard.bench.router_latency [--artifact tokenyard/router_models/artifacts/demo_router.json]
                                   [--prompts tokenyard/router_models/data/test.jsonl] [--rounds 3]
                                   [--long 1024,2048,4096,8192] [--long-requests 300]

Times what the gateway does for model "auto" once the prompt is counted: join the message
contents (prompt_text), extract the features, score with the numpy scorer, compare with the
threshold (tokenyard.gateway.routing.learned_router.LearnedRouter.decide). One request at a time, each timed
on its own with perf_counter_ns (wall) and thread_time_ns (CPU of this thread):
- the test prompts (demo-sized), `--rounds` times over;
- long prompts of about N tokens for each N in --long: a document made of other test prompts
  (fresh text per request) followed by one test prompt's question; the token count is the sum of
  the pieces' counts.
Every request is timed cold: any per-text cache of the feature module is emptied before it
(version 2 keeps none: vectorised hashing over a bounded window of the prompt's last characters;
`cache_free` in the output records that; the same harness on version 1's code empties its n-gram
LRU caches). Wall-clock percentiles
include being descheduled when the machine is busy (`load_avg` is recorded); CPU-time
percentiles are the cost of the decision itself.
Tokenisation is not included: the gateway tokenises every request once anyway (limits, bill).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import numpy as np

from tokenyard.gateway.routing.learned_router import LearnedRouter, RouterSettings, prompt_text
from tokenyard.router_models.runtime import features
from tokenyard.router_models.training.train import read_jsonl

ROOT = Path(__file__).resolve().parent.parent.parent


def _caches() -> list:
    """Per-text caches of the feature module (version 1 had n-gram LRU caches; version 2 none)."""
    return [v for v in vars(features).values() if callable(getattr(v, "cache_clear", None))]


def _time(router: LearnedRouter, requests: list[tuple[list[dict], int]]) -> tuple[np.ndarray, np.ndarray]:
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    w_ns, c_ns = [], []
    caches = _caches()
    for messages, tokens in requests:
        for cache in caches:          # every request cold, outside the timed part
            cache.cache_clear()
        w, c = wall(), cpu()
        router.decide(prompt_text(messages), tokens)
        c_ns.append(cpu() - c)
        w_ns.append(wall() - w)
    return np.array(w_ns) / 1e3, np.array(c_ns) / 1e3


def long_requests(rows: list[dict], tokens: int, count: int, seed: int) -> list[tuple[list[dict], int]]:
    """`count` prompts of at least `tokens` tokens: other test prompts as a document, then a question."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        parts, n = [], 0
        while n < tokens:
            r = rng.choice(rows)
            parts.append(r["prompt"])
            n += int(r["prompt_tokens"])
        q = rng.choice(rows)
        messages = [{"role": "system", "content": "Use the document below.\n" + "\n".join(parts)}, *q["messages"]]
        out.append((messages, n + int(q["prompt_tokens"])))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", default=str(ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router.json"))
    ap.add_argument("--prompts", default=str(ROOT / "tokenyard" / "router_models" / "data" / "test.jsonl"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long", default="1024,2048,4096,8192", help="token sizes of the long prompts")
    ap.add_argument("--long-requests", type=int, default=300, help="requests per long size")
    ap.add_argument("--features", choices=("native", "numpy"), default="native",
                    help="the feature row's path: the C kernel (tokenyard/router_models/runtime/native.py; numpy when it "
                         "cannot be built) or numpy alone (TOKENYARD_ROUTER_NATIVE=0)")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here too")
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/router_latency.json")
    ap.add_argument("--results-name", default="router_latency",
                    help="raw output bench/results/<name>.json (another name for another code version)")
    args = ap.parse_args(argv)
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder(args.results_name)
    if args.features == "numpy":
        os.environ["TOKENYARD_ROUTER_NATIVE"] = "0"
    t0 = time.perf_counter()
    router = LearnedRouter.from_settings(RouterSettings(artifact=Path(args.artifact)), "small", "large")
    load_ms = (time.perf_counter() - t0) * 1e3
    rows = read_jsonl(args.prompts)
    requests = [(r["messages"], int(r["prompt_tokens"])) for r in rows]
    router.decide("warm up numpy", 3)
    cache_free = not _caches()
    path = "native" if features.compiled(router.scorer.spec).kernel is not None else "numpy"
    runs = []
    demo = [_time(router, requests) for _ in range(args.rounds)]
    for i, (w, c) in enumerate(demo):
        runs.append({"prompts": "test split", "round": i, "requests": len(w), "wall_us": _pct(w), "cpu_us": _pct(c)})
    demo_w = np.concatenate([w for w, _ in demo])
    demo_c = np.concatenate([c for _, c in demo])
    by_size = {}
    for size in (int(x) for x in args.long.split(",") if x):
        reqs = long_requests(rows, size, args.long_requests, seed=size)
        w, c = _time(router, reqs)
        chars = [len(prompt_text(m)) for m, _ in reqs]
        by_size[str(size)] = {"requests": len(w), "mean_tokens": round(float(np.mean([n for _, n in reqs])), 1),
                              "mean_chars": round(float(np.mean(chars)), 1), "wall_us": _pct(w), "cpu_us": _pct(c)}
        runs.append({"prompts": f"long, ~{size} tokens", **by_size[str(size)]})
    result = {"features_path": path, "prompts": len(requests), "decisions": len(demo_w),
              "artifact_load_ms": round(load_ms, 2),
              "window_chars": getattr(router.scorer.spec, "window", None), "cache_free": cache_free,
              "wall_us": _pct(demo_w), "cpu_us": _pct(demo_c), "long": by_size,
              "load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
              "python": platform.python_version(), "machine": platform.machine()}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if not args.no_results:
        keys = ("features_path", "prompts", "decisions", "artifact_load_ms", "window_chars", "cache_free",
                "wall_us", "cpu_us", "long")
        rec.write({k: result[k] for k in keys}, runs)
    return 0


def _pct(us: np.ndarray) -> dict[str, float]:
    return {"mean": round(float(us.mean()), 1), "p50": round(float(np.percentile(us, 50)), 1),
            "p99": round(float(np.percentile(us, 99)), 1), "max": round(float(us.max()), 1)}


if __name__ == "__main__":
    raise SystemExit(main())
