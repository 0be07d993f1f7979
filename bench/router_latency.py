"""Decision latency of the learned router per request, features included.

    python -m bench.router_latency [--artifact router_models/artifacts/demo_router.json]
                                   [--prompts router_models/data/test.jsonl] [--rounds 5]

Times what the gateway does for model "auto" once the prompt is counted: join the message
contents (prompt_text), extract the hashed features, score with the numpy scorer, compare with
the threshold (gateway.routing.learned_router.LearnedRouter.decide). One request at a time, each timed
with perf_counter_ns (wall) and thread_time_ns (CPU of this thread), over every test prompt:
one cold round first (the n-gram caches emptied, so every word is new), then warm rounds.
Wall-clock percentiles include being descheduled when the machine is busy (`load` is printed);
CPU-time percentiles are the cost of the decision itself.
Tokenisation is not included: the gateway tokenises every request once anyway (limits, bill).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from gateway.routing.learned_router import LearnedRouter, RouterSettings, prompt_text
from router_models.runtime import features
from router_models.training.train import read_jsonl

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", default=str(ROOT / "router_models" / "artifacts" / "demo_router.json"))
    ap.add_argument("--prompts", default=str(ROOT / "router_models" / "data" / "test.jsonl"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the numbers as JSON here too")
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/router_latency.json")
    args = ap.parse_args(argv)
    from bench.results_io import RunRecorder
    rec = RunRecorder("router_latency")
    t0 = time.perf_counter()
    router = LearnedRouter.from_settings(RouterSettings(artifact=Path(args.artifact)), "small", "large")
    load_ms = (time.perf_counter() - t0) * 1e3
    rows = read_jsonl(args.prompts)
    requests = [(r["messages"], int(r["prompt_tokens"])) for r in rows]
    router.decide("warm up numpy", 3)
    features._bucket.cache_clear()
    features._char_buckets.cache_clear()
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    rounds = []
    for _ in range(1 + args.rounds):
        w_ns, c_ns = [], []
        for messages, tokens in requests:
            w, c = wall(), cpu()
            router.decide(prompt_text(messages), tokens)
            c_ns.append(cpu() - c)
            w_ns.append(wall() - w)
        rounds.append((np.array(w_ns) / 1e3, np.array(c_ns) / 1e3))
    cold_w, cold_c = rounds[0]
    warm_w = np.concatenate([r[0] for r in rounds[1:]])
    warm_c = np.concatenate([r[1] for r in rounds[1:]])
    result = {"prompts": len(requests), "warm_decisions": len(warm_w), "artifact_load_ms": round(load_ms, 2),
              "warm_wall_us": _pct(warm_w), "warm_cpu_us": _pct(warm_c),
              "cold_wall_us": _pct(cold_w), "cold_cpu_us": _pct(cold_c),
              "load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
              "python": platform.python_version(), "machine": platform.machine()}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if not args.no_results:
        rec.write({k: result[k] for k in ("prompts", "warm_decisions", "artifact_load_ms", "warm_wall_us",
                                          "warm_cpu_us", "cold_wall_us", "cold_cpu_us")},
                  [{"round": i, "wall_us": _pct(w), "cpu_us": _pct(c)} for i, (w, c) in enumerate(rounds)])
    return 0


def _pct(us: np.ndarray) -> dict[str, float]:
    return {"mean": round(float(us.mean()), 1), "p50": round(float(np.percentile(us, 50)), 1),
            "p99": round(float(np.percentile(us, 99)), 1), "max": round(float(us.max()), 1)}


if __name__ == "__main__":
    raise SystemExit(main())
