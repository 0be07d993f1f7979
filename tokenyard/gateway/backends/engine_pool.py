"""The engines of a deployment, loaded and wrapped for the gateway.

Each engine gets an `EngineHandle`: its backend (an AsyncEngine stepping on a thread of this process,
an EngineProcess stepping in a child process when `server.engine_process` is on, or a replica pool),
the tokenizer the gateway encodes prompts with, its prices. Engines whose tokenizer files are
byte-identical share one Tokenizer object, which lets the router reuse a prompt's ids across them (see routing.py).
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenyard.engines.core.backend import EngineBackend
from tokenyard.engines.runtime.async_engine import AsyncEngine
from tokenyard.engines.serving.engine_process import EngineProcess, EngineRecipe
from tokenyard.engines.text.tokenizer import Tokenizer
from tokenyard.gateway.config.deployment import EngineSpec, Prices

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


def load_engines(specs: dict[str, EngineSpec], engine_process: bool = False) -> dict[str, EngineHandle]:
    """Load every engine (blocking: model weights are read here). Call from a worker thread.
    engine_process: step each engine without replicas in a child process of its own."""
    tokenizers: dict[str, Tokenizer] = {}
    handles: dict[str, EngineHandle] = {}
    in_processes = [n for n, s in specs.items() if engine_process and s.replicas is None]
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
        elif engine_process:     # restarts its process from the recipe when a step fails
            engine = EngineProcess(_recipe(spec), name)
        else:
            # A failed engine (a step raised, a tensor-parallel worker died) is rebuilt from its spec.
            engine = AsyncEngine(_build(spec), name, factory=lambda spec=spec: _build(spec))
        handles[name] = EngineHandle(name, spec.type, engine, tok, spec.prices, spec.model, int(time.time()))
    return handles


def _upstream_handle(spec: EngineSpec) -> EngineHandle:
    """type: openai. Its prompts are counted with the tokenizer the deployment names, else estimated."""
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
