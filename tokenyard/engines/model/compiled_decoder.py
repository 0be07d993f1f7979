"""Pure-decode steps on the CPU through torch.compile (inductor's C++ backend).

A batch-1 decode step of a small model is a few hundred tiny ops; eagerly, the Python and
dispatch cost of each op, not the arithmetic, sets the step time (W2's 30.9M model: ~7 ms eager
for a step whose weights llama.cpp reads in 1.6 ms). Compiling the whole decode forward into one
graph removes that: inductor fuses the pointwise and reduction ops into generated C++ loops and
calls oneDNN/MKL for the matmuls. Prefill chunks, mixed and speculative verify steps stay eager:
their shapes vary every step and their big matmuls hide the per-op cost anyway.

Shapes. One graph serves every decode step of 1..max_batch sequences: the batch size n and the
block-table width W are dynamic sizes (the CPU analogue of the CUDA-graph ladder in
cuda_graph_runner.py, with no padding rows and no ladder of captures). torch would specialise a
size of 1, which would cost a second compile, so a batch of one runs as two identical rows (same
token, position and slot: both write the same K/V to the same slot), and a one-block table is
padded with block 0 (masked). The graph is compiled at start-up (`warm_up`), never in the middle
of serving: a step whose guards the warm-up did not cover runs eagerly instead of compiling
(stance "eager_on_recompile").

Weights. The graph is compiled with inductor's freezing: the weights become constants, which lets
it repack every linear layer's weight once for oneDNN. Measured on this VM's CPU (AMD EPYC,
bench/RESULTS.md), oneDNN's packed fp32 matrix-vector product reads the weights ~1.7x faster than
the MKL call that eager linear layers make, and weight reads are most of a small-batch decode step.
The repacked copy costs memory: the linear layers' weights are held twice (the eager path keeps
the originals). Quantised layers (tokenyard/engines/quant) keep their packed int4/int8 ops.

Attention reads the paged cache through `tokenyard.kernels.paged_attention_torch.decode_attention` (see its
docstring for what was measured and why that form).

Cache. Inductor keeps generated code and compiled libraries on disk: here under
$TORCHINDUCTOR_CACHE_DIR when set, else $XDG_CACHE_HOME/tokenyard/inductor (~/.cache/...), so a
restart skips the C++ compiler. Its whole-graph caches (FX graph, AOT autograd) refuse frozen
graphs (oneDNN-packed weights cannot be pickled), so a warm start still traces and lowers the
model: bench/RESULTS.md has cold and warm start times.

Fallback: `compiler_error()` says why inductor cannot run (no C++ compiler); the runner then
decodes eagerly with a warning, or raises when the knob says "on".
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from tokenyard.engines.model.model import CausalLM
from tokenyard.kernels import paged_attention_torch as torch_path

log = logging.getLogger(__name__)

_MIN_WIDTH = 2   # blocks per table row: keeps W off size 1, which torch would specialise


def cache_dir() -> Path:
    """Where inductor's on-disk caches live: $TORCHINDUCTOR_CACHE_DIR when the user set it, else
    $XDG_CACHE_HOME/tokenyard/inductor (default ~/.cache/tokenyard/inductor). Inductor's own
    default is a folder under /tmp, which a reboot empties; it also writes that default into the
    environment the first time anything asks, so a value equal to it counts as unset."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env and os.path.abspath(env) != os.path.abspath(_inductor_default()):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenyard" / "inductor"


def _inductor_default() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    return default_cache_dir()


def compiler_error() -> str | None:
    """None when inductor's CPU backend can build code here, else why not."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - any failure to find a compiler means "no compiler"
        return f"no C++ compiler for torch.compile's CPU backend ({type(exc).__name__}: {exc})"
    return None


class CompiledDecoder:
    """Runs pure-decode steps (one new token per sequence) of up to max_batch sequences through
    compiled graphs; `can_run` says whether a step qualifies."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_blocks_per_seq: int, max_batch: int) -> None:
        if model.embed_tokens.weight.device.type != "cpu":
            raise ValueError("CompiledDecoder is the CPU decode path")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.width = max(_MIN_WIDTH, max_blocks_per_seq)
        self.max_batch = max(1, max_batch)
        self.sliding_window = model.cfg.sliding_window
        self.compile_seconds = 0.0
        # A step the warm-up's guards do not cover runs eagerly rather than compiling mid-serving
        # (tests set "fail_on_recompile" to prove their steps never need that).
        self.stance = "eager_on_recompile"
        self.cache_dir = cache_dir()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir)   # read by inductor at each lookup
        self._compiled = torch.compile(self._step, fullgraph=True, dynamic=False)

    # The traced function: embedding, layers, final norm and LM head for one token per row.
    def _step(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
              seq_lens: torch.Tensor) -> torch.Tensor:
        model = self.model
        h = model.embed_tokens(ids)
        for layer, (k_cache, v_cache) in zip(model.layers, self.kv_caches):
            q, k, v = layer.qkv(h, positions, model.rotary)
            torch_path.write_kv_slots(k_cache, v_cache, k, v, slots)
            o = torch_path.decode_attention(q, k_cache, v_cache, tables, seq_lens, self.block_size, layer.scale,
                                            self.sliding_window)
            h = layer.finish(h, o)
        return model.lm_head(model.norm(h)).float()

    def can_run(self, n: int, max_blocks: int) -> bool:
        return 0 < n <= self.max_batch and max_blocks <= self.width

    def warm_up(self) -> float:
        """Compile the graph now (never in the middle of serving); returns the seconds it took.

        The dummy step writes K/V into the first slot of block 0 before any request has run: every
        slot is written by its own sequence before anything reads it."""
        t0 = time.perf_counter()
        args = self._tensors([3], [0], [0], [1], [[0] * _MIN_WIDTH], _MIN_WIDTH)
        for t in args:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        # "maybe": the graph may bound a size below what we would declare (SmolLM2's int4 graph
        # guards the table width at <= 256 blocks while its KV holds 364); a step outside the
        # guards then runs eagerly instead of the compile failing.
        torch._dynamo.maybe_mark_dynamic(args[3], 1)
        # Freezing makes the weights constants of the graph, which lets inductor repack the linear
        # layers' weights once for oneDNN (at batch 1 its fp32 matrix-vector product reads them
        # about 1.7x faster than the MKL call eager linear layers make; bench/RESULTS.md).
        from torch._inductor import config as inductor_config  # here: importing inductor costs seconds

        with torch.inference_mode(), inductor_config.patch(freezing=True):
            self._compiled(*args)
        self.compile_seconds = time.perf_counter() - t0
        return self.compile_seconds

    @staticmethod
    def _tensors(ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
                 tables: list[list[int]], width: int) -> tuple[torch.Tensor, ...]:
        if len(ids) == 1:
            # Batch 1 runs as two identical rows: one graph then serves every batch size (torch
            # specialises size 1, which would need a second compile). Both rows compute the same
            # K/V and write it to the same slot; the matmuls read each weight once either way.
            ids, positions, slots, seq_lens, tables = ids * 2, positions * 2, slots * 2, seq_lens * 2, tables * 2
        long = torch.long
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=long)
        return (torch.tensor(ids, dtype=long), torch.tensor(positions, dtype=long), torch.tensor(slots, dtype=long),
                table, torch.tensor(seq_lens, dtype=long))

    def run(self, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """One decode token per sequence; returns fp32 logits [n, vocab]."""
        width = max(_MIN_WIDTH, max(len(t) for t in tables))
        args = self._tensors(ids, positions, slots, seq_lens, tables, width)
        with torch.inference_mode(), torch.compiler.set_stance(self.stance):
            return self._compiled(*args)[:len(ids)]
