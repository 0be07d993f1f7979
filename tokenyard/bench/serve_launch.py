"""Start and stop the servers a serving benchmark drives, and the files they need.

Full runs start each server as its own process (`tokenyard serve` for the gateway,
`python -m tokenyard.bench.static_batch_server` for the baseline), one at a time, so the load generator's
event loop never shares a GIL with a torch step and the two servers never share the CPU. Tests
serve an app on a thread instead (`serve_app_in_thread`), which starts in well under a second.

Every launcher is a zero-argument callable returning a context manager that yields an
`Endpoint`; the scenarios only see endpoints, so they run the same either way.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
OUT = ROOT / "bench" / "out"


@dataclass(slots=True)
class Endpoint:
    """A running server the load generator can reach."""

    name: str
    base_url: str                                   # http://127.0.0.1:PORT
    api_key: str | None
    model: str = "auto"                             # the `model` the requests name (an engine, or auto)
    batch_api_key: str | None = None                # a key whose admission class is "batch" (gateway only)
    deployment: Path | None = None                  # the gateway's deployment file (prices, engines)
    info: dict[str, Any] = field(default_factory=dict)


Launcher = Callable[[], AbstractContextManager[Endpoint]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_gateway(config: Path, env: dict[str, str], port: int, timeout_s: float = 60) -> subprocess.Popen:
    """`tokenyard serve --config config --port port`, output discarded, returned once /ready says
    200 (killed if it never does)."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenyard.cli.main", "serve", "--config", str(config),
                             "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s, proc)
    except BaseException:
        proc.kill()
        raise
    return proc


def wait_ready(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None, path: str = "/ready") -> None:
    """Poll until GET path answers 200 (model loading can take a while on a busy CPU)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server at {base_url} exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base_url + path, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server at {base_url} was not ready after {timeout_s:.0f} s")
        time.sleep(0.2)


def stop_processes(*procs: subprocess.Popen | None, grace_s: float = 10) -> None:
    """SIGTERM each process still running (None skipped), SIGKILL after grace_s."""
    for p in procs:
        if p is not None:
            _stop(p, grace_s)


def _stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)            # the gateway drains, then exits 0
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def gateway_process(config: Path, name: str = "gateway", model: str = "auto", ready_timeout_s: float = 600,
                    batch_key: bool = False, log_dir: Path = OUT / "logs") -> Launcher:
    """`tokenyard serve --config config` on a free port with a fresh development key; with
    batch_key, also a key of admission class "batch" made with `tokenyard keys create`."""

    @contextmanager
    def launch() -> Iterator[Endpoint]:
        port, key = free_port(), "bench-" + secrets.token_hex(12)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        env = {**os.environ, "TOKENYARD_DEV_KEY": key}
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "tokenyard.cli.main", "serve", "--config", str(config),
                                     "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, ready_timeout_s, proc)
            ep = Endpoint(name, url, key, model, deployment=config, info={"log": str(log_path)})
            if batch_key:
                ep.batch_api_key = create_key(config, _redis_url_from_log(log_path), "bench-batch", "batch")
            yield ep
        finally:
            _stop(proc)

    return launch


def static_process(model: Path, batch_size: int, name: str = "static-batch", ready_timeout_s: float = 600,
                   batch_timeout_ms: float = 50.0, log_dir: Path = OUT / "logs") -> Launcher:
    """`python -m tokenyard.bench.static_batch_server` on a free port with a fresh key."""

    @contextmanager
    def launch() -> Iterator[Endpoint]:
        port, key = free_port(), "bench-" + secrets.token_hex(12)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        env = {**os.environ, "TOKENYARD_API_KEY": key}
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "tokenyard.bench.static_batch_server", "--model", str(model),
                                     "--port", str(port), "--batch-size", str(batch_size),
                                     "--batch-timeout-ms", str(batch_timeout_ms)],
                                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, ready_timeout_s, proc, path="/health")
            yield Endpoint(name, url, key, "static-batch", info={"log": str(log_path), "batch_size": batch_size})
        finally:
            _stop(proc, grace_s=10)

    return launch


def _redis_url_from_log(log_path: Path) -> str | None:
    m = re.search(r"redis at (\S+)", log_path.read_text())
    return m.group(1) if m else None


def create_key(config: Path, redis_url: str | None, tenant: str, priority: str) -> str:
    """A new API key through `tokenyard keys create` (the way an operator makes one)."""
    cmd = [sys.executable, "-m", "tokenyard.cli.main", "keys", "--config", str(config)]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    cmd += ["create", "--tenant", tenant, "--priority", priority, "--rpm", "0", "--tpm", "0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"`tokenyard keys create` failed: {done.stderr.strip()[-300:]}")
    return done.stdout.split()[0]


@contextmanager
def serve_app_in_thread(app: Any, name: str, api_key: str | None, model: str = "auto",
                        **info: Any) -> Iterator[Endpoint]:
    """Serve an ASGI app with uvicorn on a thread and a free port (tests)."""
    import uvicorn
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start")
        time.sleep(0.01)
    try:
        yield Endpoint(name, f"http://127.0.0.1:{port}", api_key, model, info=info)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


# --- deployment variants -------------------------------------------------------------------------

def derive_deployment(src: Path, dst: Path, engine_options: dict[str, Any] | None = None,
                      only_engines: list[str] | None = None, bench_friendly: bool = True) -> Path:
    """Write a copy of a deployment file with paths made absolute (it moves to another folder),
    `engine_options` set on every torch engine, and optionally only some engines kept.

    bench_friendly turns off per-tenant rate limits and the per-tenant concurrency cap, which a
    single benchmark tenant would otherwise hit long before the engine saturates."""
    doc = yaml.safe_load(Path(src).read_text())
    base = Path(src).resolve().parent
    # A Redis of the benchmark's own: never share keys and usage with a gateway someone else runs.
    doc["redis_dir"] = str(OUT / "redis")
    # One key prefix per derived deployment: a policy one scenario imported into Redis must not
    # become the policy of record for another scenario's (differently shaped) deployment.
    doc["redis_prefix"] = "bench-" + re.sub(r"[^A-Za-z0-9._-]", "-", Path(dst).stem)[:48] + ":"
    engines = doc.get("engines") or {}
    if only_engines is not None:
        engines = {k: v for k, v in engines.items() if k in only_engines}
        routing = doc.get("routing") or {}
        for role in ("small", "large"):
            if routing.get(role) not in engines:
                routing.pop(role, None)
    for spec in engines.values():
        for key in ("model", "draft_model"):
            if spec.get(key) and not str(spec[key]).startswith("package:"):   # package: refs are not paths
                spec[key] = str((base / spec[key]).resolve())
        if spec.get("type", "torch") == "torch" and engine_options:
            spec.update(engine_options)
    doc["engines"] = engines
    # The router artifact and the policy file are paths too; both name the small and large
    # engines, so a deployment cut down to fewer engines runs without them (plain routing).
    router = doc.get("router") or {}
    roles = [(doc.get("routing") or {}).get(r) for r in ("small", "large")]
    two_engines = all(r in engines for r in roles) and len(engines) >= 2
    if router.get("artifact"):
        router["artifact"] = str((base / router["artifact"]).resolve())
    if doc.get("policy"):
        doc["policy"] = str((base / doc["policy"]).resolve())
    if not two_engines:
        doc.pop("router", None)
        doc.pop("policy", None)
    if bench_friendly:
        doc.setdefault("rate_limits", {})["enabled"] = False
        doc.setdefault("admission", {})["max_concurrent_per_tenant"] = 0
    server = doc.setdefault("server", {})
    server["access_log"] = False
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dst


def serving_checkpoint(out_dir: Path, tokenizer_from: Path = ROOT / "models" / "demo-large",
                       seed: int = 0, std: float = 0.05, **shape: Any) -> Path:
    """A random Llama that a server can tokenise for: the given shape (default W2's) with the
    vocabulary, special ids and tokenizer files of `tokenizer_from` (the demo tokenizer, 1,962
    tokens), since W2's own random checkpoint has ids but no tokenizer."""
    import json

    from tokenyard.bench.random_checkpoint import build_random_checkpoint
    from tokenyard.bench.workloads import W2_MODEL
    gen = json.loads((tokenizer_from / "generation_config.json").read_text())
    cfg = json.loads((tokenizer_from / "config.json").read_text())
    dims = {**W2_MODEL, **shape, "vocab_size": cfg["vocab_size"], "bos_token_id": gen["bos_token_id"],
            "eos_token_id": gen["eos_token_id"], "pad_token_id": gen.get("pad_token_id", 0)}
    build_random_checkpoint(out_dir, "llama", seed=seed, std=std, **dims)
    for f in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_from / f).is_file():
            shutil.copy(tokenizer_from / f, out_dir / f)
    return out_dir
