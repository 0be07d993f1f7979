"""The engines of a deployment, loaded and wrapped for the gateway.

Each engine gets an `EngineHandle`: its backend (an AsyncEngine stepping on a thread of this process,
an EngineProcess stepping in a child process of its own or linked to the core the supervisor started for
several workers, or a replica pool),
the tokenizer the gateway encodes prompts with, its prices. Engines whose tokenizer files are
byte-identical share one Tokenizer object, which lets the router reuse a prompt's ids across them (see routing.py).

Which engines step in a process of their own (`in_own_process`): none with `replicas` or `upstream`;
with `server.engine_process: true` every other one, with `false` none; by default ("auto") the torch
engines (those marked `embeddings: true` included: the core computes the vectors between its steps,
tokenyard/engines/serving/process_embeddings.py), while mock engines stay in-process (they cost no
compute worth a process, and the gateway's tests stay fast).
With `server.workers` > 1 every built-in engine without replicas runs in the one core the supervisor
started, whatever its type (each worker holding an engine of its own would not be one engine).
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenyard.engines.core.backend import EngineBackend
from tokenyard.engines.runtime.async_engine import AsyncEngine
from tokenyard.engines.serving.engine_process import EngineProcess, EngineRecipe
from tokenyard.gateway.config.deployment import EngineSpec, Prices

if TYPE_CHECKING:      # imported where a tokenizer is built: a replica's parent needs none (nor torch)
    from tokenyard.engines.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "tokenizer_config.json",
                   "generation_config.json", "chat_template.jinja")


@dataclass(slots=True)
class EngineHandle:
    name: str
    type: str
    engine: EngineBackend
    tokenizer: Tokenizer
    prices: Prices
    model_dir: Path
    created: int                  # unix seconds, for /v1/models


def tokenizer_fingerprint(model_dir: Path) -> str:
    """Equal for checkpoints whose tokenizers are byte-identical (they can share one Tokenizer). A GGUF
    file holds its tokenizer in its metadata: the file's identity stands in for it."""
    h = hashlib.sha256()
    if model_dir.is_file():
        st = model_dir.stat()
        h.update(f"gguf\0{model_dir.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        return h.hexdigest()
    for name in TOKENIZER_FILES:
        path = model_dir / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def in_own_process(spec: EngineSpec, engine_process: bool | None) -> bool:
    """Whether `spec` steps in an engine process by server.engine_process (None: auto; module docstring)."""
    if spec.upstream is not None or spec.replicas is not None:
        return False
    if engine_process is None:
        return spec.type == "torch"
    return engine_process


def load_engines(specs: dict[str, EngineSpec], engine_process: bool | None = None,
                 engine_sockets: dict[str, Path] | None = None) -> dict[str, EngineHandle]:
    """Load every engine (blocking: model weights are read here). Call from a worker thread.
    engine_process: server.engine_process (None: auto). engine_sockets: engine name -> the Unix socket
    of the core a supervisor started (a gateway worker links to it instead of building the engine)."""
    from tokenyard.engines.text.tokenizer import Tokenizer
    sockets = engine_sockets or {}
    tokenizers: dict[str, Tokenizer] = {}
    handles: dict[str, EngineHandle] = {}
    in_processes = [n for n, s in specs.items() if n not in sockets and in_own_process(s, engine_process)]
    if len(in_processes) > 1:
        # In-process engines take turns on one step thread; processes do not (tokenyard/engines/runtime/executor.py).
        log.warning("server.engine_process: engines %s each step in a process of their own, at the same time; "
                    "give each its share of the cores (OMP_NUM_THREADS) or they slow each other down",
                    ", ".join(in_processes))
    for name, spec in specs.items():
        if spec.upstream is not None:   # another OpenAI-compatible server: nothing to load here
            handles[name] = _upstream_handle(spec)
            continue
        fp = tokenizer_fingerprint(spec.model)
        tok = tokenizers.get(fp)
        if tok is None:
            tok = tokenizers[fp] = Tokenizer.from_dir(spec.model)
        if spec.replicas is not None and spec.replicas.disaggregated:   # prefill and decode replicas
            from tokenyard.gateway.backends.disaggregated import build_disaggregated
            engine = build_disaggregated(name, spec, _build, fp)
        elif spec.replicas is not None:   # remote and/or local replicas behind one pool
            from tokenyard.gateway.backends.replica_pool import build_pool
            engine = build_pool(name, spec, _build, fp)
        elif name in sockets:    # the supervisor's core, shared with the other workers; it restarts the core
            engine = EngineProcess(_recipe(spec), name, max_restart_attempts=_RELINK_ATTEMPTS, connect=sockets[name])
        elif name in in_processes:     # restarts its process from the recipe when a step fails
            engine = EngineProcess(_recipe(spec), name)
        else:
            # A failed engine (a step raised, a tensor-parallel worker died) is rebuilt from its spec.
            engine = AsyncEngine(_build(spec), name, factory=lambda spec=spec: _build(spec))
        handles[name] = EngineHandle(name, spec.type, engine, tok, spec.prices, spec.model, int(time.time()))
    return handles


# A worker links again to a core the supervisor restarts: backoff 0.5 s doubling to 30 s, about 4 minutes
# in all, time for a large model to load again.
_RELINK_ATTEMPTS = 12


def _upstream_handle(spec: EngineSpec) -> EngineHandle:
    """type: openai. Its prompts are counted with the tokenizer the deployment names, else estimated."""
    from tokenyard.engines.text.tokenizer import Tokenizer
    from tokenyard.gateway.backends.estimate_tokenizer import EstimateTokenizer
    from tokenyard.gateway.backends.upstream_engine import UpstreamEngine
    assert spec.upstream is not None
    tok: Any = Tokenizer.from_dir(spec.model) if spec.model is not None else EstimateTokenizer()
    return EngineHandle(spec.name, spec.type, UpstreamEngine(spec.name, spec.upstream), tok, spec.prices,
                        spec.model or Path(), int(time.time()))


def _recipe(spec: EngineSpec) -> EngineRecipe:
    return EngineRecipe(spec.type, spec.model, spec.options)


def _build(spec: EngineSpec):
    return _recipe(spec).build()
