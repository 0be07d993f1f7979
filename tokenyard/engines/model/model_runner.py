"""Turns a scheduled batch into flat model inputs, runs one forward, and samples."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenyard import knobs
from tokenyard.engines.core.scheduler import SchedulerOutput
from tokenyard.engines.core.sequence import Sequence
from tokenyard.engines.model import onednn_linear
from tokenyard.engines.model.attention import AttentionMetadata, resolve_backend
from tokenyard.engines.model.compiled_decoder import CompiledDecoder, compiler_error
from tokenyard.engines.model.cuda_graph_runner import CudaGraphDecoder
from tokenyard.engines.model.model import CausalLM
from tokenyard.engines.model.native_decoder import NativeDecoder, unsupported
from tokenyard.engines.model.runner_config import RunnerConfig
from tokenyard.engines.model.sampler import LogitAdjust, sample

log = logging.getLogger(__name__)

# cpu_compile "auto" compiles models from this size on (parameters). Compiling costs start-up
# time (tens of seconds cold, a few warm); below this the engines are test and demo models.
AUTO_COMPILE_MIN_PARAMS = 20_000_000
# cpu_decode_step_max_batch 0 ("auto"): the C step takes decode batches up to these sizes. Measured
# on the W2 model, 2 threads, AMD EPYC Zen 3 (bench/RESULTS.md, native CPU decode step): against
# eager torch it is faster at every batch measured (1.8x at 96), so alone it takes them all. Against
# the compiled graph it was faster up to 16 (2.3x at 1, 1.2x at 16) and slower from 32 (0.82-0.97x)
# until its products of 16+ tokens moved to packed panels (tokenyard/kernels/cpu_matvec_panel.c); since then
# it is ahead there too (1.07x at 32, 1.23x at 96), so the graph is worth compiling only for larger
# batches on machines where that has not been measured (AVX-512): beside it the C step keeps 1..16.
NATIVE_MAX_BATCH_ALONE = 256
NATIVE_MAX_BATCH_WITH_GRAPH = 16
# cpu_onednn_linear "auto" packs the eager linears when oneDNN's product beats F.linear (MKL) by at
# least this much on the decoder's largest projection at ONEDNN_PROBE_ROWS rows (a 512-token step).
# On a Zen 4 VM the probe said 1.18-1.40x while W2's mixed steps got 20-25% shorter (smaller products
# gain more: 1.2-2.7x at 8-96 rows; bench/RESULTS.md), so a small edge on the probe is already worth
# the second weight copy; below 1.05 it is within the probe's noise.
ONEDNN_MIN_SPEEDUP = 1.05
ONEDNN_PROBE_ROWS = 512


def _env_override(mode: str, knob: Callable[[], str]) -> str:
    """A knob's "auto" replaced by the environment's "on" or "off" (tokenyard/knobs.py) when that is set."""
    return knob() if mode == "auto" else mode


@dataclass(slots=True)
class StepInputs:
    """One step's flat model inputs as plain lists: cheap to send to tensor-parallel workers."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    logits_rows: list[int]
    adapters: list[int] = field(default_factory=list)   # per chunk: LoRA adapter id, 0 = base (empty: all base)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 config: RunnerConfig, lora: Any = None) -> None:
        """lora: the engine's tokenyard.engines.lora.adapter_pool.AdapterPool, or None (no adapters); typed
        loosely because lora sits above model in the engine's layers."""
        block_size, cuda_graphs, max_model_len = config.block_size, config.cuda_graphs, config.max_model_len
        max_num_seqs, cpu_decode_step_max_batch = config.max_num_seqs, config.cpu_decode_step_max_batch
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.attention_backend = resolve_backend(config.attention_backend, device)
        self.sliding_window = model.cfg.sliding_window
        self.graphs: CudaGraphDecoder | None = None
        mode = cuda_graphs
        if mode == "auto":
            mode = "on" if device.type == "cuda" and self.attention_backend == "triton" else "off"
        if mode != "off":
            if self.attention_backend != "triton":
                raise ValueError("cuda_graphs needs attention_backend triton (padding rows rely on its slot -1 skip)")
            width = -(-max_model_len // block_size)
            try:
                self.graphs = CudaGraphDecoder(model, kv_caches, block_size, width, config.cuda_graph_max_batch, device,
                                               capture=mode == "on")
            except Exception:  # noqa: BLE001 - a capture failure must not take the engine down
                if cuda_graphs != "auto":
                    raise
                # "auto" promised speed, not graphs: serve eagerly and say so.
                log.warning("CUDA graph capture failed; decoding eagerly (set cuda_graphs: on to make this an error)",
                            exc_info=True)
                self.graphs = None
        self.compiled: CompiledDecoder | None = None
        self.native: NativeDecoder | None = None
        self.cpu_compile_mode = "off"
        self.cpu_decode_step_mode = "off"
        # what the quantised products' inputs are in decode steps the C step runs: "int8" (batches of
        # 1..7 rounded per 32-block, W8A8 / W4A8), "fp32", or "n/a" (no C step, or no quantised weights)
        self.activation_quant = "n/a"
        if self.graphs is None:
            wanted = cpu_decode_step_max_batch or NATIVE_MAX_BATCH_ALONE
            self.native = self._native_decoder(config.cpu_decode_step, max_model_len, min(wanted, max_num_seqs or wanted),
                                               config.activation_quant)
        if config.activation_quant == "on" and self.activation_quant != "int8":
            raise ValueError("activation_quant is on but " + (
                "the C decode step does not run here (see cpu_decode_step)" if self.native is None else
                "the model has no int8 or int4 projections" if not self.native.quantised else
                "this machine's build has no int8-input products (they need AVX2)"))
        if self.graphs is None:
            # The compiled graph serves the batches the C step leaves: none when the C step takes every
            # batch the engine can schedule and is the faster path for all of them (a set max_batch, or
            # under auto at most NATIVE_MAX_BATCH_WITH_GRAPH sequences), so nothing is compiled then.
            covered = self.native is not None and self.native.max_batch >= (max_num_seqs or 1) and (
                bool(cpu_decode_step_max_batch) or self.native.max_batch <= NATIVE_MAX_BATCH_WITH_GRAPH)
            if not covered:
                self.compiled = self._compiled_decoder(config.cpu_compile, max_model_len, max_num_seqs)
            if self.native is not None and self.compiled is not None and not cpu_decode_step_max_batch:
                # "auto" (0): beside the compiled graph the C step keeps only the batches where it is faster
                self.native.max_batch = min(self.native.max_batch, NATIVE_MAX_BATCH_WITH_GRAPH)
        self.cpu_onednn_linear_mode = "off"
        self.onednn_speedup: float | None = None     # what "auto" measured (None: not measured)
        self.num_onednn_linears = 0
        if self.graphs is None:
            self._pack_linears(config.cpu_onednn_linear)
        self.num_graph_steps = 0
        self.num_compiled_steps = 0
        self.num_native_steps = 0
        # LoRA adapters (tokenyard/engines/lora): steps with an adapter request run the eager forward, which
        # adds the adapters' products; CUDA graphs, the C decode step and the compiled decode graph
        # serve base-only steps. lora_eager_steps counts decode steps that left a fast path for that.
        self.lora = lora
        self.num_lora_eager_steps = 0

    def _native_decoder(self, mode: str, max_model_len: int, max_batch: int,
                        activation_quant: str = "auto") -> NativeDecoder | None:
        """The C decode step per the cpu_decode_step knob (EngineConfig); None for the torch paths.
        "auto" uses it where it applies (see auto_compiles: the same size rule) and says why not, once,
        when it cannot be built; "on" makes every obstacle an error."""
        mode = _env_override(mode, knobs.cpu_decode_step)
        self.cpu_decode_step_mode = mode
        if mode == "off" or (mode == "auto" and not self.auto_compiles()):
            return None
        if self.device.type != "cpu" or self.attention_backend != "torch":
            problem = "it needs a CPU device and the torch attention backend"
        else:
            problem = unsupported(self.model, self.kv_caches)
        if problem is not None:
            if mode == "on":
                raise ValueError(f"cpu_decode_step is on but {problem}")
            log.info("decode steps run in torch: the C decode step does not apply (%s)", problem)
            return None
        try:
            native = NativeDecoder(self.model, self.kv_caches, self.block_size, max_model_len, max_batch,
                                   torch.get_num_threads(), int8_inputs=activation_quant != "off")
        except (RuntimeError, ValueError):
            if mode == "on":
                raise
            log.warning("the C decode step is unavailable; decode steps run in torch", exc_info=True)
            return None
        if native.quantised:
            self.activation_quant = "int8" if native.int8_inputs else "fp32"
        log.info("decode steps of 1..%d sequences run in the C decode step (%d threads; ready in %.1f s, "
                 "weights in %s pages; quantised products' inputs: %s)", native.max_batch, native.step.threads,
                 native.ready_seconds, "2 MiB" if native.arena.huge else "ordinary",
                 {"int8": "int8 at batches 1..7 (activation_quant)", "fp32": "fp32"}.get(self.activation_quant, "n/a"))
        return native

    def _compiled_decoder(self, mode: str, max_model_len: int, max_num_seqs: int) -> CompiledDecoder | None:
        """The compiled CPU decode path per the cpu_compile knob (EngineConfig), warmed up; None
        for eager decoding. "auto" compiles where it pays (see auto_compiles); a failure is then a
        warning, and under "on" an error."""
        mode = _env_override(mode, knobs.cpu_compile)
        self.cpu_compile_mode = mode
        if mode == "off" or (mode == "auto" and not self.auto_compiles()):
            return None
        if self.device.type != "cpu" or self.attention_backend != "torch" or self.model.layers[0].tp_enabled:
            if mode == "on":
                raise ValueError("cpu_compile needs a CPU device, the torch attention backend and no tensor parallelism")
            return None
        problem = compiler_error()
        if problem is not None:
            if mode == "on":
                raise RuntimeError(f"cpu_compile is on but {problem}")
            log.warning("decoding eagerly: %s (set cpu_compile: off to silence this)", problem)
            return None
        width = -(-max_model_len // self.block_size)
        try:
            dec = CompiledDecoder(self.model, self.kv_caches, self.block_size, width, max_num_seqs or 1)
            seconds = dec.warm_up()
        except Exception:  # noqa: BLE001 - "auto" promised speed, not a compiler: serve eagerly and say so
            if mode == "on":
                raise
            log.warning("compiling the CPU decode step failed; decoding eagerly (set cpu_compile: on to make "
                        "this an error)", exc_info=True)
            return None
        log.info("CPU decode step compiled in %.1f s (batch 1 and 2..%d; inductor cache %s)", seconds,
                 dec.max_batch, dec.cache_dir)
        return dec

    def _pack_linears(self, mode: str) -> None:
        """The eager fp32 linears on oneDNN's packed weights per the cpu_onednn_linear knob
        (EngineConfig; tokenyard/engines/model/onednn_linear.py). "auto" measures first and packs only where
        it pays; "on" packs or raises."""
        mode = _env_override(mode, knobs.cpu_onednn_linear)
        self.cpu_onednn_linear_mode = mode
        if mode == "off":
            return
        eligible = [m for m in self.model.modules() if onednn_linear.eligible(m)]
        problem = None
        if self.device.type != "cpu" or self.model.layers[0].tp_enabled:
            problem = "it needs a CPU device and no tensor parallelism"
        elif not onednn_linear.available():
            problem = "this torch build has no oneDNN linear ops"
        elif not eligible:
            problem = "the model has no fp32 linear layers"
        if problem is not None:
            if mode == "on":
                raise ValueError(f"cpu_onednn_linear is on but {problem}")
            return
        if mode == "auto":
            if not self._large_model():
                return
            # the decoder's largest projection: every prompt token goes through it. A quantised decoder whose
            # only fp32 layer is the LM head (one row a sequence in eager steps) is left alone: its copy
            # would cost more memory than the quantised weights for a small share of a step.
            in_layers = [m for m in self.model.layers.modules() if onednn_linear.eligible(m)]
            if not in_layers:
                return
            big = max(in_layers, key=lambda m: m.weight.numel())
            self.onednn_speedup = onednn_linear.measured_speedup(big.in_features, big.out_features, ONEDNN_PROBE_ROWS)
            if self.onednn_speedup < ONEDNN_MIN_SPEEDUP:
                log.info("eager linears stay on F.linear: oneDNN's packed product was %.2fx on %dx%d at %d rows "
                         "(auto packs from %.2fx)", self.onednn_speedup, big.out_features, big.in_features,
                         ONEDNN_PROBE_ROWS, ONEDNN_MIN_SPEEDUP)
                return
        self.num_onednn_linears = onednn_linear.pack_linears(self.model, ONEDNN_PROBE_ROWS)
        log.info("eager linears on oneDNN's packed weights: %d layers, %.0f MiB more memory%s",
                 self.num_onednn_linears, onednn_linear.packed_bytes(self.model) / 2**20,
                 "" if self.onednn_speedup is None else f" (measured {self.onednn_speedup:.2f}x F.linear)")

    def auto_compiles(self) -> bool:
        """What cpu_compile "auto" decides: compile on a CPU for models of at least
        AUTO_COMPILE_MIN_PARAMS parameters."""
        if self.device.type != "cpu" or self.attention_backend != "torch":
            return False
        return self._large_model()

    def _large_model(self) -> bool:
        """The size from which the "auto" CPU paths (compile, oneDNN packing) are worth their start-up."""
        return sum(p.numel() for p in self.model.parameters()) >= AUTO_COMPILE_MIN_PARAMS

    def execute(self, batch: SchedulerOutput) -> list[int]:
        """Run the batch; return one sampled token per chunk that reaches its sequence's end."""
        inputs, sampled = self.prepare(batch)
        # Pure decode (one token per sequence, each sampled) may take one of the decode-only paths.
        n = len(inputs.ids)
        decode = n == len(sampled) == len(batch.chunks)
        if decode and any(inputs.adapters) and any(p is not None for p in (self.graphs, self.native, self.compiled)):
            self.num_lora_eager_steps += 1
            decode = False   # adapters are applied by the eager forward only
        width = max(len(t) for t in inputs.tables) if decode else 0
        if self.graphs is not None and decode and self.graphs.can_run(n, width):
            logits = self.graphs.run(inputs.ids, inputs.positions, inputs.slots, inputs.seq_lens, inputs.tables)
            self.num_graph_steps += 1
            return self._sample(logits, sampled)
        if self.native is not None and decode and self.native.can_run(n, width):
            logits = self.native.run(inputs.ids, inputs.positions, inputs.slots, inputs.seq_lens, inputs.tables)
            self.num_native_steps += 1
            # Sample on this thread alone: a parallel torch op here (argmax over [B, vocab] goes parallel
            # from 32k elements) leaves torch's OpenMP worker spinning for a while after it, on a core the
            # C step's own threads need for the next step (batch 8 on W2: 20 ms a step instead of 10).
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return self._sample(logits, sampled)
            finally:
                torch.set_num_threads(threads)
        if self.compiled is not None and decode and self.compiled.can_run(n, width):
            try:
                logits = self.compiled.run(inputs.ids, inputs.positions, inputs.slots, inputs.seq_lens, inputs.tables)
            except Exception:  # noqa: BLE001 - under "auto", a compiled step that fails falls back for good
                if self.cpu_compile_mode == "on":
                    raise
                # Rerunning the step eagerly is safe: it writes the same K/V slots again.
                log.error("compiled decode step failed; decoding eagerly from now on", exc_info=True)
                self.compiled = None
                return self._sample(self.forward(inputs), sampled)
            self.num_compiled_steps += 1
            return self._sample(logits, sampled)
        logits = self.forward(inputs)
        if not sampled:
            return []
        return self._sample(logits, sampled)

    def prepare(self, batch: SchedulerOutput) -> tuple[StepInputs, list[Sequence]]:
        bs = self.block_size
        inputs = StepInputs([], [], [], [], [], [], [])
        sampled: list[Sequence] = []
        for chunk in batch.chunks:
            seq = chunk.seq
            start = seq.num_computed_tokens
            end = start + chunk.num_tokens
            table = seq.block_table
            inputs.ids.extend(seq.token_ids[start:end])
            inputs.positions.extend(range(start, end))
            inputs.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            inputs.query_lens.append(chunk.num_tokens)
            inputs.seq_lens.append(end)
            inputs.tables.append(table)
            inputs.adapters.append(seq.lora_id)
            if chunk.samples:
                inputs.logits_rows.append(len(inputs.ids) - 1)
                sampled.append(seq)
        return inputs, sampled

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """One eager forward; fp32 logits for inputs.logits_rows."""
        dev = self.device
        meta = AttentionMetadata.build(inputs.slots, inputs.query_lens, inputs.seq_lens, inputs.tables,
                                       self.block_size, self.sliding_window, dev, self.attention_backend)
        if self.lora is not None and any(inputs.adapters):
            # every token row of a chunk is its sequence's adapter's
            self.lora.begin_step([a for a, n in zip(inputs.adapters, inputs.query_lens) for _ in range(n)])
        try:
            return self.model(torch.tensor(inputs.ids, dtype=torch.long, device=dev),
                              torch.tensor(inputs.positions, dtype=torch.long, device=dev), meta, self.kv_caches,
                              torch.tensor(inputs.logits_rows, dtype=torch.long, device=dev))
        finally:
            if self.lora is not None:
                self.lora.end_step()

    @staticmethod
    def _sample(logits: torch.Tensor, sampled: list) -> list[int]:
        return sample_sequences(logits, sampled)


def adjustment(seq: Sequence) -> LogitAdjust | None:
    """The penalties and bias of one sequence's next token, or None when it has neither."""
    p = seq.params
    if not p.adjusts_logits:
        return None
    return LogitAdjust(p.presence_penalty, p.frequency_penalty, p.logit_bias, seq.output_token_ids)


def sample_sequences(logits: torch.Tensor, sampled: list[Sequence]) -> list[int]:
    """One token per row of logits [S, V], row i for sampled[i]'s next output token."""
    adjust = [adjustment(s) for s in sampled]
    tokens = sample(
            logits,
            greedy=[s.params.temperature == 0.0 for s in sampled],
            temperature=[s.params.temperature for s in sampled],
            top_k=[s.params.top_k for s in sampled],
            top_p=[s.params.top_p for s in sampled],
            seeds=[s.seed for s in sampled],
            indices=[s.num_output_tokens for s in sampled],
            constraints=[s.constraint for s in sampled],
            adjustments=adjust if any(a is not None for a in adjust) else None,
        )
    record_logprobs(logits, sampled, tokens)
    return tokens


def record_logprobs(logits: torch.Tensor, sampled: list[Sequence], tokens: list[int]) -> None:
    """For the sequences that asked, the model's log_softmax of the logits the sampler started from
    (raw: before penalties, bias, masks and temperature): the picked token's and the top k."""
    rows = [i for i, s in enumerate(sampled) if s.params.logprobs is not None]
    if not rows:
        return
    dev = logits.device
    lp = torch.log_softmax(logits[torch.tensor(rows, dtype=torch.long, device=dev)].float(), dim=-1)
    picked = torch.tensor([tokens[i] for i in rows], dtype=torch.long, device=dev)
    chosen = lp.gather(1, picked[:, None])[:, 0].tolist()
    k = min(max(sampled[i].params.logprobs for i in rows), lp.shape[-1])
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(rows):
        n = sampled[i].params.logprobs
        sampled[i].pending_logprobs.append([tokens[i], chosen[j], [list(p) for p in zip(top_i[j][:n], top_v[j][:n])]])
