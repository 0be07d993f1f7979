"""Sleep and wake of one engine core (tokenyard/engines/core/sleep_level.py says what the levels mean).

    engine.sleep(1)          # the KV cache's memory is released; weights, runner and compiled code stay
    engine.sleep(2)          # the weights and the runner go too
    phases = engine.wake()   # {phase: seconds}: kv_allocation, weights_read, compile, ... as at start

Level 1 keeps every KV tensor object and releases its storage (resize to 0 bytes; a CPU cache on
anonymous pages has them dropped in place, madvise DONTNEED, and keeps its address), so the model,
the runner and the compiled CPU decode graph, which hold those objects, are untouched; waking
gives the storage back (zeroed). Paths that baked the storage's address in are renewed at wake:
CUDA graphs captured again from the same settings, the C decode step restarted over the arena
that holds its weights (only the KV addresses are read again). The prefix cache is emptied: its blocks'
contents are gone. Level 2 drops the runner and the model; waking loads the weights again through
the engine's own load path (load_engine_model: whatever cache that path has, it uses) and builds a
fresh runner, so a level-2 wake costs the engine's start-up without the process start.

The engine must have nothing in flight (RequestError otherwise: the caller drains it first).
Engines that run on several ranks or with speculation cannot sleep (SleepUnsupported).
"""
from __future__ import annotations

import gc
import logging
import time
from typing import Any

import torch

from tokenyard.engines.core.block_pool import BlockPool
from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.core.sleep_level import SleepUnsupported, check_sleep_level
from tokenyard.engines.core.startup_phases import StartupPhases
from tokenyard.engines.model.cpu_allocator import discard_pages, release_freed_memory, resident_bytes
from tokenyard.engines.model.cuda_graph_runner import CudaGraphDecoder
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.model.native_decoder import NativeDecoder
from tokenyard.engines.pp.pipeline_runner import uses_pipeline
from tokenyard.engines.quant.engine_model import load_engine_model
from tokenyard.kernels.kv_quant import QuantizedCache

log = logging.getLogger(__name__)


def kv_tensors(caches: list) -> list[tuple[torch.Tensor, float]]:
    """Every tensor of a KV cache with the value it is (re)filled with: codes and K/V 0, scales 1."""
    out: list[tuple[torch.Tensor, float]] = []
    for layer in caches:
        for c in layer:
            if isinstance(c, QuantizedCache):
                out += [(c.data, 0.0), (c.scale, 1.0)]
            else:
                out.append((c, 0.0))
    return out


def kv_resident_bytes(caches: list) -> int:
    """Bytes of the KV tensors in memory now: a resizable storage's size (0 once released), and of a
    mapped one (a CPU cache on anonymous pages) its pages resident (mincore)."""
    total = 0
    for t, _ in kv_tensors(caches):
        storage = t.untyped_storage()
        total += storage.nbytes() if storage.resizable() else resident_bytes(t.data_ptr(), storage.nbytes())
    return total


class EngineSleep:
    """The sleep state of one Engine and the two transitions."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine      # tokenyard.engines.runtime.engine.Engine (not imported: it imports this)
        self.level = 0
        self._kv_bytes: list[int] = []
        self._rebuild_graphs: dict[str, Any] | None = None
        self._native: NativeDecoder | None = None      # the C decode step while its KV storage is released
        self.last_sleep_s = 0.0
        self.last_wake_s = 0.0
        self.last_wake_phases: dict[str, float] = {}

    def unsupported(self) -> str | None:
        e = self.engine
        if e.micro is not None or uses_pipeline(e.config) or e.config.tensor_parallel_size > 1:
            return "sleep is not supported with tensor or pipeline parallelism"
        if e.spec is not None:
            return "sleep is not supported with speculative decoding"
        if e.dead is not None:
            return f"the engine is dead ({e.dead})"
        return None

    def sleep(self, level: int) -> float:
        """Release memory per `level`; deeper than the current level only (a lighter one is a no-op).
        Returns the seconds it took."""
        level = check_sleep_level(level)
        problem = self.unsupported()
        if problem is not None:
            raise SleepUnsupported(problem)
        e = self.engine
        if e.has_unfinished() or e.scheduler.running or e.scheduler.waiting:
            raise RequestError("the engine has requests in flight; drain it before it sleeps")
        if level <= self.level:
            return 0.0
        t0 = time.perf_counter()
        if self.level == 0:
            self._release_kv()
        if level == 2:
            self._release_weights()
        self.level = level
        gc.collect()
        if e.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_freed_memory()
        self.last_sleep_s = time.perf_counter() - t0
        log.info("engine %s asleep at level %d (%.3f s)", e.model_dir.name, level, self.last_sleep_s)
        return self.last_sleep_s

    def wake(self) -> dict[str, float]:
        """Back to serving; {phase: seconds} of what the wake did (empty when it was awake)."""
        if self.level == 0:
            return {}
        e = self.engine
        t0 = time.perf_counter()
        phases = StartupPhases()
        if self.level == 2:
            mcfg = ModelConfig.from_dir(e.model_dir)
            cfg = e.config
            with phases.phase("weights_read"):
                e.model, e.model_config = load_engine_model(e.model_dir, e.dtype, e.device, e.max_model_len, False,
                                                            mcfg, cfg.quantization, cfg.quant_group_size, phases)
            e.runner = e._single_runner(e.blocks.num_blocks, phases)
        else:
            self._restore_kv(phases)
        self.level = 0
        self.last_wake_s = time.perf_counter() - t0
        phases.finish(self.last_wake_s)
        self.last_wake_phases = phases.as_dict()
        log.info("engine %s awake in %s", e.model_dir.name, phases.describe())
        return self.last_wake_phases

    # -- level 1 ------------------------------------------------------------------------------
    def _release_kv(self) -> None:
        e = self.engine
        runner = e.runner
        # Paths holding the storage's address: rebuilt at wake from the same settings.
        g = runner.graphs
        if g is not None:
            self._rebuild_graphs = dict(block_size=g.block_size, max_blocks_per_seq=g.width, max_batch=g.max_batch,
                                        device=g.device, capture=g.capture)
            runner.graphs = None
        n = runner.native
        if n is not None:
            # Its step (threads, buffers) ends; the decoder and its arena stay (the weights live there).
            n.close()
            self._native = n
            runner.native = None
        self._kv_bytes = []
        for t, _ in kv_tensors(runner.kv_caches):
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if storage.resizable():
                storage.resize_(0)
                self._kv_bytes.append(nbytes)
            else:   # a CPU cache on anonymous pages (kv_cache.py): dropped in place, zeros when touched again
                discard_pages(t.data_ptr(), nbytes)
                self._kv_bytes.append(-1)
        # The prefix cache's blocks held K/V that is gone: an empty pool in the same manager (whose hooks a
        # second cache tier may hold: kv_transfer/tiered_store.py), its eviction hook carried over.
        blocks = e.blocks
        hook = blocks.pool.on_evict
        blocks.pool = BlockPool(blocks.num_blocks)
        blocks.pool.on_evict = hook

    def _restore_kv(self, phases: StartupPhases) -> None:
        runner = self.engine.runner
        with phases.phase("kv_allocation"):
            for (t, fill), nbytes in zip(kv_tensors(runner.kv_caches), self._kv_bytes):
                if nbytes >= 0:
                    t.untyped_storage().resize_(nbytes)
                    t.fill_(fill)
        with phases.phase("compile"):
            if self._rebuild_graphs is not None:
                g = self._rebuild_graphs
                runner.graphs = CudaGraphDecoder(runner.model, runner.kv_caches, g["block_size"],
                                                 g["max_blocks_per_seq"], g["max_batch"], g["device"],
                                                 capture=g["capture"])
            if self._native is not None:     # the same KV tensor objects: only their addresses changed
                self._native.reopen()
                runner.native = self._native
        self._rebuild_graphs, self._native = None, None

    # -- level 2 ------------------------------------------------------------------------------
    def _release_weights(self) -> None:
        e = self.engine
        runner = e.runner
        if runner is not None and runner.native is not None:
            runner.native.close()
        self._native = None
        # Nothing else holds the model or the cache: dropping both frees the weights (the C step's
        # arena with them) and the KV tensors whose storage level 1 already released.
        e.runner = None
        e.model = None
        self._rebuild_graphs = None
        self._kv_bytes = []
