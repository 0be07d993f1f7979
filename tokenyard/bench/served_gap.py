"""Where the W2 engine loses throughput behind the gateway: the same 96 requests at once, straight
into the engine and then over HTTP, with the gateway process's CPU split by thread.

    .venv/bin/python -m tokenyard.bench.served_gap [--rounds 2] [--variants default "spin20k:TOKENYARD_STEP_SPIN=20000"]

Each round runs, interleaved:
- `engine`: the engine alone in this process (tokenyard/bench/served_steps.py's closed loop, all requests at
  once): the ceiling;
- one gateway per variant (`name` or `name:ENV=value,ENV=value`: environment for the gateway
  process only), the peer benchmark's Tokenyard server (tokenyard/bench/peers/peer_bench.py: W2 fp32, the
  engine's defaults, prefix caching off, EOS banned), started fresh, warmed up with 4 requests, then
  the 96 streamed over HTTP by the same aiohttp client, which runs in this process on the same cores.

For every run: useful output tok/s, TTFT and ITL p50/p99, the engine's steps and seconds in steps
(the gateway's /metrics), the machine's busy share, this process's CPU seconds (the client; for
`engine`, the engine) and per thread of the engine's process its CPU seconds and its seconds
runnable but waiting for a core (schedstat; the main thread runs the event loop; the busiest others
are the step thread, the C step's pool worker and torch's OpenMP worker, told apart by their CPU).
Two cores and four busy threads: the question is which of them takes the engine's cores.
Raw output: bench/results/<--results-name, default served_gap>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
from pathlib import Path
from typing import Any, Iterator

import torch

from tokenyard.bench.peers import peer_bench as pb
from tokenyard.bench.peers.models import w2_checkpoint
from tokenyard.bench.results_io import RunRecorder
from tokenyard.bench.served_steps import closed_loop
from tokenyard.bench.workloads import W2_MODEL, w2


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`name` or `name:KEY=value,KEY=value` -> (name, environment overrides)."""
    name, _, rest = text.partition(":")
    if not name:
        raise ValueError(f"variant {text!r} has no name")
    env: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"variant {text!r}: {item!r} is not KEY=value")
        env[key] = value
    return name, env


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (an engine stepped in a child process: server.engine_process)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (t / "children").read_text().split())
        except OSError:
            continue   # it ended meanwhile
    return out


def thread_cpu(pid: int) -> dict[int, tuple[str, float, float, int]]:
    """Per thread of `pid` and its child processes: its kernel name, seconds on a CPU, seconds runnable
    but waiting for one (/proc/<pid>/task/<tid>/schedstat) and its process. Wall time minus both is
    time it was blocked (a lock, a futex, I/O, or asleep)."""
    out: dict[int, tuple[str, float, float, int]] = {}
    for p in process_tree(pid):
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for t in tasks:
            try:
                comm = (t / "comm").read_text().strip()
                run_ns, wait_ns, _ = (t / "schedstat").read_text().split()
            except (OSError, ValueError):
                continue   # the thread ended between listing and reading
            out[int(t.name)] = (comm, int(run_ns) / 1e9, int(wait_ns) / 1e9, p)
    return out


def thread_deltas(before: dict[int, tuple[str, float, float, int]], after: dict[int, tuple[str, float, float, int]],
                  main_tid: int) -> list[dict[str, Any]]:
    """The threads that ran in between, busiest first: CPU seconds and run-queue wait seconds."""
    rows = []
    for tid, (name, run, wait, pid) in after.items():
        _, run0, wait0, _ = before.get(tid, (name, 0.0, 0.0, pid))
        if run - run0 > 0.01:
            rows.append({"tid": tid, "pid": pid, "name": name, "main": tid == main_tid,
                         "cpu_s": round(run - run0, 3), "runqueue_s": round(wait - wait0, 3)})
    return sorted(rows, key=lambda r: -r["cpu_s"])


def engine_counters(server: pb.Server) -> dict[str, float]:
    """The gateway engine's step counters from /metrics: steps, seconds in steps, prompt tokens computed."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    req = urllib.request.Request(server.base_url + "/metrics", headers=server.headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    want = {"tokenyard_engine_batch_size_count": "steps", "tokenyard_engine_busy_seconds_total": "step_s",
            "tokenyard_engine_prefill_tokens_total": "prefill_tokens"}
    out = {v: 0.0 for v in want.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in want:
                out[want[sample.name]] += sample.value
    return out


def describe_threads(threads: list[dict[str, Any]], n: int = 5) -> str:
    return ", ".join(f"{'main' if t['main'] else t['tid']} {t['cpu_s']:.1f}+{t['runqueue_s']:.1f}q"
                     for t in threads[:n])


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@contextlib.contextmanager
def environment(overrides: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def gateway_run(cfg: pb.Config, env: dict[str, str], reqs: list[tuple[list[int], int]], threads: int,
                log_dir: Path) -> dict[str, Any]:
    with environment(env), pb.tokenyard_gateway(cfg, log_dir, threads) as server:
        pid = server.info["pid"]
        pb.run_load(server, reqs[:4], 4)                     # warm-up: first-call costs stay out
        c0 = engine_counters(server)
        before, stat0, client0 = thread_cpu(pid), pb._cpu_stat(), self_cpu()
        figures = pb.run_load(server, reqs, len(reqs))
        after, stat1, client1 = thread_cpu(pid), pb._cpu_stat(), self_cpu()
        c1 = engine_counters(server)
    threads = thread_deltas(before, after, pid)
    steps = {k: c1[k] - c0[k] for k in c0}
    return {**figures, **steps, "step_share": steps["step_s"] / figures["duration_s"],
            "busy": pb.cpu_busy_fraction(stat0, stat1), "client_cpu_s": client1 - client0,
            "gateway_cpu_s": sum(t["cpu_s"] for t in threads),   # with its engine process, if any
            # its child processes: the engine's with server.engine_process, and the embedded redis-server
            "engine_process_cpu_s": sum(t["cpu_s"] for t in threads if t["pid"] != pid),
            "event_loop_cpu_s": next((t["cpu_s"] for t in threads if t["main"]), 0.0), "threads": threads}


def engine_run(llm: Any, reqs: list, concurrency: int) -> dict[str, Any]:
    stat0, cpu0, before = pb._cpu_stat(), self_cpu(), thread_cpu(os.getpid())
    r = closed_loop(llm, reqs, concurrency)
    stat1, cpu1, after = pb._cpu_stat(), self_cpu(), thread_cpu(os.getpid())
    return {"useful_output_tok_s": r["output_tok_s"], "duration_s": r["wall_s"], "ttft_p50_ms": r["ttft_p50_ms"],
            "ttft_p99_ms": r["ttft_p99_ms"], "itl_p50_ms": r["itl_p50_ms"], "itl_p99_ms": r["itl_p99_ms"],
            "decode_steps": r["decode_steps"], "decode_step_p50_ms": r["decode_step_p50_ms"],
            "mixed_steps": r["mixed_steps"], "mixed_step_p50_ms": r["mixed_step_p50_ms"],
            "steps": r["decode_steps"] + r["mixed_steps"], "step_s": r["step_s"], "step_share": r["step_s"] / r["wall_s"],
            "busy": pb.cpu_busy_fraction(stat0, stat1), "engine_cpu_s": cpu1 - cpu0,
            "threads": thread_deltas(before, after, os.getpid())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["default"],
                    help="gateway variants: name or name:ENV=value,ENV=value (environment of the gateway process)")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine-alone run")
    ap.add_argument("--results-name", default="served_gap")
    args = ap.parse_args()
    variants = dict(parse_variant(v) for v in args.variants)
    torch.set_num_threads(args.threads)
    rec = RunRecorder(args.results_name)
    model_dir = w2_checkpoint()
    mode = {"fp32_default": dict(dtype="float32")}
    cfg = pb.Config("w2", model_dir, model_dir, mode, "fp32_default", requests=args.requests, slots=[],
                    kv_cache_memory=1 << 30, vocab_size=W2_MODEL["vocab_size"],
                    describe="W2 random Llama 30.9M, fp32, the engine's defaults")
    workload = w2(args.requests, vocab_size=W2_MODEL["vocab_size"])
    reqs = [(list(r.prompt_token_ids), r.output_len) for r in workload]
    log_dir = pb.pm.ROOT / "bench" / "out" / "served_gap"
    llm = None
    if not args.no_engine:
        from tokenyard.engines import LLM
        llm = LLM(model_dir, dtype="float32", kv_cache_memory=1 << 30, max_num_seqs=128, progress=False,
                  enable_prefix_caching=False)
        closed_loop(llm, workload[:4], 4)
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        if llm is not None:
            r = engine_run(llm, workload, len(workload))
            runs.append({"round": rnd, "run": "engine", **r})
            print(f"round {rnd + 1} engine alone: {r['useful_output_tok_s']:.0f} tok/s, busy {r['busy']:.2f}, "
                  f"engine CPU {r['engine_cpu_s']:.1f} s of {r['duration_s']:.1f} s, {r['steps']} steps "
                  f"{r['step_s']:.1f} s ({describe_threads(r['threads'])}); decode steps "
                  f"{r['decode_steps']} p50 {r['decode_step_p50_ms']:.1f} ms, mixed {r['mixed_steps']} "
                  f"p50 {r['mixed_step_p50_ms']:.0f} ms", flush=True)
        for name, env in variants.items():
            r = gateway_run(cfg, env, reqs, args.threads, log_dir)
            runs.append({"round": rnd, "run": name, "env": env, **r})
            top = describe_threads(r["threads"])
            print(f"round {rnd + 1} gateway {name}: {r['useful_output_tok_s']:.0f} tok/s in {r['duration_s']:.1f} s, "
                  f"TTFT p50 {r['ttft_p50_ms']:.0f} p99 {r['ttft_p99_ms']:.0f}, ITL p50 {r['itl_p50_ms']:.0f} "
                  f"p99 {r['itl_p99_ms']:.0f} ms, {r['steps']:.0f} steps {r['step_s']:.1f} s ({r['prefill_tokens']:.0f} prompt "
                  f"tokens), busy {r['busy']:.2f}, client CPU {r['client_cpu_s']:.1f} s, "
                  f"gateway CPU {r['gateway_cpu_s']:.1f} s (threads, CPU+run-queue s: {top})",
                  flush=True)
    names = (["engine"] if llm is not None else []) + list(variants)
    keys = ("useful_output_tok_s", "duration_s", "steps", "step_s", "step_share",
            "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "busy",
            "client_cpu_s", "gateway_cpu_s", "event_loop_cpu_s", "engine_cpu_s")
    figures = {"requests": len(reqs), "threads": args.threads, "variants": variants,
               "median": {n: {k: statistics.median(r[k] for r in runs if r["run"] == n)
                              for k in keys if all(k in r for r in runs if r["run"] == n)} for n in names}}
    rec.write(figures, runs=runs)
    for n, m in figures["median"].items():
        print(f"median {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()))


if __name__ == "__main__":
    main()
