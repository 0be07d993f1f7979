"""Engine configuration: one dataclass, every default safe on a CPU."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from tokenyard.kernels.kv_cache_dtypes import KV_CACHE_DTYPES

if TYPE_CHECKING:   # torch is imported where a device or dtype is made: checking a config needs none
    import torch

# dtype option -> torch's name for it
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
           "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


@dataclass(slots=True)
class EngineConfig:
    """Knobs of one engine (documented in the README's configuration section).

    dtype: "auto" is float32 on CPU and bfloat16 on CUDA.
    device: "auto" picks CUDA when available.
    block_size: tokens per KV block.
    kv_cache_memory: bytes for the KV cache; when None, kv_cache_fraction of free device memory
      (CUDA) or of kv_cache_cpu_default_bytes (CPU, where "free memory" is shared with everything).
    kv_cache_dtype: "auto" (the model's dtype), "int8" or "fp8_e4m3": how K/V are stored. The
      quantised dtypes keep one fp32 scale per (token, kv head) beside the codes and compute in
      the model's dtype; the block count follows kv_cache_memory, so they hold about 2x the
      blocks of bf16 (3.8x of fp32). A dtype the device cannot store is an error at start-up.
    max_num_seqs: most sequences in one step. max_num_batched_tokens: token budget of one step;
      prefills longer than what is left are split over steps (chunked prefill).
    prefill_burst_tokens: the step budget instead, while BURST_MIN_PROMPTS (4) or more prompts wait
      for their prefill (0 or <= max_num_batched_tokens: off). A queue of prompts is waiting time
      that only prefill throughput shortens, and a step's decode rows cost the same beside a big
      chunk as beside a small one; with one or two prompts pending, short steps keep the running
      streams' inter-token gaps short (scheduler.py). Off by default: on served W2 it did not
      measurably beat the plain 512 budget (bench/RESULTS.md).
    max_model_len: longest sequence (prompt + output); defaults to the model's
      max_position_embeddings (capped by Mistral's sliding window is not needed: it is masked).
    enable_prefix_caching: reuse the KV of full blocks whose prefix was computed before.
    long_prefill_token_threshold: cap on one request's prefill chunk per step (0: only the budget).
    attention_backend: "auto" (triton on CUDA, torch elsewhere), "torch" or "triton" (forces
      either; triton on a CPU needs TRITON_INTERPRET=1 and is for testing only).
    seed: seeds the per-request seeds drawn for requests that bring none.
    cuda_graphs: "auto" (on with CUDA and the triton backend), "on" or "off": decode steps of up to
      cuda_graph_max_batch sequences replay captured CUDA graphs; prefill always runs eagerly.
      "padded" runs the graphs' static, padded path eagerly (tests on CPU, needs triton attention).
    cpu_compile: "off" (default), "auto" or "on": on a CPU (torch attention, no tensor parallelism),
      decode steps of up to max_num_seqs sequences run through torch.compile (inductor's C++
      backend): one graph for every batch size, compiled at start-up (logged with its time), its
      C++ build cached on disk (TORCHINDUCTOR_CACHE_DIR, else ~/.cache/tokenyard/inductor); float
      linear weights are repacked for oneDNN, a second copy in memory. Prefill, mixed and verify
      steps stay eager. "auto" compiles models of at least 20M parameters and decodes eagerly, with
      a warning, when there is no C++ compiler or compiling fails; "on" compiles any model and makes
      those errors. Off by default until it is measured on a quiet machine at 2 threads
      (bench/RESULTS.md). The environment variable TOKENYARD_CPU_COMPILE (auto, on, off) replaces
      "auto" when set (the test suite sets it to off in tests/conftest.py: it builds dozens of
      short-lived engines).
    cpu_decode_step: "auto" (default), "on" or "off": decode steps of up to cpu_decode_step_max_batch
      sequences run as one call into a C kernel (tokenyard/kernels/cpu_decode_step.c: the whole decoder, its
      own threads, weights read in place; tokenyard/engines/model/native_decoder.py says which models
      qualify: fp32 on a CPU with an fp32 KV cache, fp32 / int8 / int4 projections). Larger decode
      batches, prefill and verify steps keep the torch paths (cpu_compile's graph for the larger
      decode batches when that is on). "auto" uses it for CPU models of at least 20M parameters that
      qualify and falls back to torch, with a warning, when no C compiler builds it; "on" uses it
      for any model and makes those errors. The environment variable TOKENYARD_CPU_DECODE_STEP
      (auto, on, off) replaces "auto" when set. int4 weights are copied once into the kernel's
      order (0.5 byte a weight plus fp32 scale and minimum per group). Logits match the eager
      forward to fp32 rounding; for int8/int4 models the kernel keeps fp32 activations where torch's
      packed ops round them to bf16, except at batches 1..7 under activation_quant (int8 inputs).
    cpu_decode_step_max_batch: the largest decode batch (1..256) the C step takes; 0 (default): 16
      when cpu_compile's graph serves the larger batches (from about 32 sequences its oneDNN GEMMs
      are faster), else every batch the engine schedules (the C step beats eager torch at every
      batch measured, up to 96; bench/RESULTS.md). Nothing is compiled when the C step takes every
      batch (max_num_seqs <= 16 under auto, or a max_batch >= max_num_seqs).
    activation_quant: "auto" (default), "on" or "off": whether the C decode step rounds the inputs of
      int8 and int4 products to int8 (per 32 inputs, one fp32 scale: llama.cpp's Q8 activations) for
      decode batches of 1..7 sequences, so that an int8 "weight-only" model runs W8A8 there and an
      int4 one W4A8 (integer dot products: about 2x the fp32-input decode speed on SmolLM2's int4).
      "auto" does where the C step runs a quantised model on an AVX2 or AVX-512 build, as before this
      knob; "off" keeps fp32 inputs (a second build of the C step); "on" makes it an error at
      start-up when it cannot happen (no C step: see cpu_decode_step, no quantised projections, or
      no AVX2). Its measured cost in quality (perplexity, demo-task accuracy, SmolLM2 greedy
      agreement) and gain in speed are in bench/RESULTS.md ("Activation quantisation").
      Other paths are unaffected: prefill, larger decode batches and tensor-parallel ranks run
      torch's packed ops, which round the inputs to bf16. The start-up log line of the C step says
      which it is; ModelRunner.activation_quant holds it ("int8", "fp32" or "n/a").
    cpu_onednn_linear: "auto" (default), "on" or "off": the steps torch runs eagerly on a CPU
      (prefill, mixed prefill + decode, decode batches the C step does not take) multiply fp32
      linear layers by a copy of their weights packed for oneDNN instead of calling F.linear
      (MKL); a second copy of those weights in memory (tokenyard/engines/model/onednn_linear.py). "auto"
      times both products on the decoder's largest projection at 512 rows at start-up and packs
      when oneDNN is at least 1.05x faster (on an AVX-512 Zen 4 VM the probe said 1.18-1.40x;
      AVX2-only machines are unmeasured, hence the probe; bench/RESULTS.md), for CPU models of at
      least 20M parameters whose decoder layers are fp32 (a quantised decoder keeps its fp32 LM
      head on F.linear). "on" packs on any CPU model and raises where it cannot. Quantised layers
      are left as they are. Results equal F.linear's to fp32 rounding. TOKENYARD_CPU_ONEDNN_LINEAR
      (auto, on, off) replaces "auto" when set.
    tensor_parallel_size: ranks the model is split over (heads and MLP by rank, vocabulary for the
      embedding and LM head); N > 1 starts N - 1 worker processes (gloo on CPU, nccl on CUDA).
      Combines with quantization: each rank keeps its slice of the single-process quantised
      weights and their scales (tokenyard/engines/quant/tp_shard.py).
    pipeline_parallel_size: stages the decoder layers are split into (contiguous runs; the
      embedding on the first, the final norm and LM head on the last); each stage is a process
      (tensor_parallel_size processes under TP: tp x pp ranks in all), activations go stage to
      stage by point-to-point ops, and up to P micro-batches of disjoint sequences are in flight
      (tokenyard/engines/pp). Rank 0 schedules and samples. With MASTER_ADDR, MASTER_PORT, WORLD_SIZE and
      RANK set (torchrun, a Kubernetes job), any multi-rank engine meets its ranks there instead
      of spawning them (docs/kubernetes.md). Speculative decoding is refused with P > 1; CUDA
      graphs and cpu_compile stay off on pipeline ranks.
    speculative_method: "none", "ngram" (prompt lookup) or "draft" (draft_model proposes).
    num_speculative_tokens: tokens proposed per sequence and step (k).
    draft_model: checkpoint folder of the draft; it must share the target's tokenizer.
    ngram_min / ngram_max: the shortest / longest suffix that prompt lookup tries to match.
    spec_max_batch: steps with more decoding sequences than this run without speculation (past
      it the step is no longer bound by reading weights, so verifying k extra rows stops paying).
    tp_timeout_s: how long a collective or a worker's start-up may take before the engine is
      declared dead (a killed worker is usually detected at once: its sockets close).
    kv_offload_host_bytes / kv_offload_disk_path / kv_offload_disk_bytes: the second cache tier
      (tokenyard/engines/kv_transfer/tiered_store.py): prefix blocks evicted from the KV pool are kept
      in host memory up to kv_offload_host_bytes, least recently used spilling to content-addressed
      files under kv_offload_disk_path (bounded by kv_offload_disk_bytes; kept across restarts, shared
      by replicas of the same model and layout), and come back on a prefix hit. Off by default (host
      0 and no path); needs enable_prefix_caching and a single-process engine.
    lora_modules: {name: adapter folder} of PEFT LoRA adapters (adapter_config.json +
      adapter_model.safetensors) served on this base; a request names one with SamplingParams.lora
      (tokenyard/engines/lora). Each is read and checked against the base at start-up. Not with
      tensor or pipeline parallelism.
    max_loaded_adapters: slots of the adapter pool: the most adapters held in memory at once and in
      one step; the others are read again from disk when needed, replacing the least recently used.
    max_lora_rank: the largest adapter rank accepted (1..256); the pool is sized at the largest rank
      among lora_modules.
    grammar_compile_timeout_s / grammar_compile_memory_mb: what one response_format schema may cost
      to compile (wall seconds; MiB above the compiler process's footprint) before the request is
      refused with a 400 naming response_format (tokenyard/engines/runtime/grammar_worker.py).
    grammar_close_reserve: the last this many tokens of a constrained request's max_tokens are spent
      closing its JSON: the mask keeps only the tokens that end strings, arrays and objects (or a
      comma towards a required key) wherever the grammar allows one, so a small model that loops
      inside a value still returns a complete, valid document instead of running out of tokens
      (tokenyard/engines/core/structured_output.py). 0 turns it off.
    grammar_mask_overlap: fill a step's grammar masks on a thread of their own while its forward runs
      (tokenyard/engines/runtime/mask_prefetch.py) rather than between the forward and the sample.
      The tokens are the same either way; False fills them inline.
    """

    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_fraction: float = 0.9
    kv_cache_cpu_default_bytes: int = 2 * 1024**3
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    prefill_burst_tokens: int = 0
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    attention_backend: str = "auto"
    seed: int = 0
    progress: bool = True
    quantization: str = "auto"
    quant_group_size: int = 128
    cuda_graphs: str = "auto"
    cuda_graph_max_batch: int = 128
    cpu_compile: str = "off"
    cpu_decode_step: str = "auto"
    cpu_decode_step_max_batch: int = 0
    activation_quant: str = "auto"
    cpu_onednn_linear: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tp_timeout_s: float = 60.0
    speculative_method: str = "none"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    spec_max_batch: int = 2
    grammar_compile_timeout_s: float = 5.0
    grammar_compile_memory_mb: int = 1024
    grammar_close_reserve: int = 64
    kv_offload_host_bytes: int = 0
    kv_offload_disk_path: str | None = None
    kv_offload_disk_bytes: int = 4 * 1024**3
    lora_modules: dict[str, str] | None = None
    max_loaded_adapters: int = 4
    max_lora_rank: int = 64
    grammar_mask_overlap: bool = True

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        cfg = cls(**options)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.prefill_burst_tokens, int) or isinstance(self.prefill_burst_tokens, bool) \
                or self.prefill_burst_tokens < 0:
            raise ValueError(f"prefill_burst_tokens must be an integer >= 0 (0: off), got {self.prefill_burst_tokens!r}")
        if not isinstance(self.grammar_compile_timeout_s, (int, float)) or not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be seconds > 0, got {self.grammar_compile_timeout_s!r}")
        if not isinstance(self.grammar_close_reserve, int) or isinstance(self.grammar_close_reserve, bool) \
                or self.grammar_close_reserve < 0:
            raise ValueError(f"grammar_close_reserve must be an integer >= 0 (tokens), got {self.grammar_close_reserve!r}")
        if not isinstance(self.grammar_mask_overlap, bool):
            raise ValueError(f"grammar_mask_overlap must be true or false, got {self.grammar_mask_overlap!r}")
        if not isinstance(self.grammar_compile_memory_mb, int) or self.grammar_compile_memory_mb < 16:
            raise ValueError(f"grammar_compile_memory_mb must be an integer >= 16, got {self.grammar_compile_memory_mb!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory!r}")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.cuda_graphs not in ("auto", "on", "off", "padded"):
            raise ValueError(f"cuda_graphs must be auto, on, off or padded, got {self.cuda_graphs!r}")
        if self.cpu_compile not in ("auto", "on", "off"):
            raise ValueError(f"cpu_compile must be auto, on or off, got {self.cpu_compile!r}")
        if self.cpu_onednn_linear not in ("auto", "on", "off"):
            raise ValueError(f"cpu_onednn_linear must be auto, on or off, got {self.cpu_onednn_linear!r}")
        if self.cpu_decode_step not in ("auto", "on", "off"):
            raise ValueError(f"cpu_decode_step must be auto, on or off, got {self.cpu_decode_step!r}")
        if self.activation_quant not in ("auto", "on", "off"):
            raise ValueError(f"activation_quant must be auto, on or off, got {self.activation_quant!r}")
        if self.activation_quant == "on" and (self.cpu_decode_step == "off" or self.tensor_parallel_size > 1
                                              or self.pipeline_parallel_size > 1):
            raise ValueError("activation_quant on needs the C decode step, which cpu_decode_step off, tensor "
                             "parallelism and pipeline parallelism leave out")
        if not isinstance(self.cpu_decode_step_max_batch, int) or isinstance(self.cpu_decode_step_max_batch, bool) \
                or not 0 <= self.cpu_decode_step_max_batch <= 256:
            raise ValueError(f"cpu_decode_step_max_batch must be an integer in 0..256 (0: auto), "
                             f"got {self.cpu_decode_step_max_batch!r}")
        if not isinstance(self.cuda_graph_max_batch, int) or self.cuda_graph_max_batch <= 0:
            raise ValueError(f"cuda_graph_max_batch must be a positive integer, got {self.cuda_graph_max_batch!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size <= 0:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if not isinstance(self.pipeline_parallel_size, int) or isinstance(self.pipeline_parallel_size, bool) \
                or self.pipeline_parallel_size <= 0:
            raise ValueError(f"pipeline_parallel_size must be a positive integer, got {self.pipeline_parallel_size!r}")
        if self.pipeline_parallel_size > 1 and self.speculative_method != "none":
            raise ValueError(f"speculative_method {self.speculative_method} is not supported with "
                             f"pipeline_parallel_size > 1 (verification would need the draft's tokens back "
                             f"before the next micro-batch): use one or the other")
        if not isinstance(self.tp_timeout_s, (int, float)) or self.tp_timeout_s <= 0:
            raise ValueError(f"tp_timeout_s must be a positive number of seconds, got {self.tp_timeout_s!r}")
        if self.speculative_method not in ("none", "ngram", "draft"):
            raise ValueError(f"speculative_method must be none, ngram or draft, got {self.speculative_method!r}")
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method draft needs draft_model (a checkpoint folder)")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}")
        if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int) and 1 <= self.ngram_min <= self.ngram_max):
            raise ValueError(f"need integers 1 <= ngram_min <= ngram_max, got {self.ngram_min!r}, {self.ngram_max!r}")
        if not isinstance(self.spec_max_batch, int) or self.spec_max_batch < 1:
            raise ValueError(f"spec_max_batch must be a positive integer, got {self.spec_max_batch!r}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len!r}")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"quantization must be auto, none, int8 or int4, got {self.quantization!r}")
        self._validate_offload()
        if self.lora_modules is not None:
            if not isinstance(self.lora_modules, dict) or not all(
                    isinstance(k, str) and k and ":" not in k and isinstance(v, str) and v
                    for k, v in self.lora_modules.items()):
                raise ValueError(f"lora_modules must map adapter names (non-empty, without ':') to adapter folders, "
                                 f"got {self.lora_modules!r}")
            if self.lora_modules and (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1):
                raise ValueError("lora_modules is not supported with tensor or pipeline parallelism")
            # The tier keys blocks by the adapter's slot id, which is not stable across restarts or replicas.
            if self.lora_modules and self.kv_offload:
                raise ValueError("lora_modules cannot be combined with the second KV cache tier (kv_offload_*) yet")
        if not isinstance(self.max_loaded_adapters, int) or isinstance(self.max_loaded_adapters, bool) \
                or self.max_loaded_adapters < 1:
            raise ValueError(f"max_loaded_adapters must be a positive integer, got {self.max_loaded_adapters!r}")
        if not isinstance(self.max_lora_rank, int) or isinstance(self.max_lora_rank, bool) \
                or not 1 <= self.max_lora_rank <= 256:
            raise ValueError(f"max_lora_rank must be an integer in 1..256, got {self.max_lora_rank!r}")
        if self.quant_group_size not in (32, 64, 128) or isinstance(self.quant_group_size, bool):
            raise ValueError(f"quant_group_size must be 32, 64 or 128, got {self.quant_group_size!r}")

    @property
    def kv_offload(self) -> bool:
        """True when the second cache tier is on (host bytes or a disk path)."""
        return self.kv_offload_host_bytes > 0 or bool(self.kv_offload_disk_path)

    def _validate_offload(self) -> None:
        for name in ("kv_offload_host_bytes", "kv_offload_disk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer number of bytes >= 0, got {value!r}")
        path = self.kv_offload_disk_path
        if path is not None and (not isinstance(path, str) or not path):
            raise ValueError(f"kv_offload_disk_path must be a folder path (a non-empty string), got {path!r}")
        if path and self.kv_offload_disk_bytes <= 0:
            raise ValueError("kv_offload_disk_bytes must be > 0 when kv_offload_disk_path is set")
        if self.kv_offload and not self.enable_prefix_caching:
            raise ValueError("kv_offload_host_bytes / kv_offload_disk_path need enable_prefix_caching")
        if self.kv_offload and (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1):
            raise ValueError("kv_offload_host_bytes / kv_offload_disk_path need tensor_parallel_size and "
                             "pipeline_parallel_size 1 (the KV of other ranks is not reachable from here)")

    def torch_device(self) -> torch.device:
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """"auto": bfloat16 on CUDA; float32 on a CPU, the activations the C decode step and the oneDNN
        linears take with float, int8 and int4 weights alike (bfloat16 there skips the C step: about
        a third of the decode speed on SmolLM2's int4, bench/RESULTS.md)."""
        import torch
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, _DTYPES[self.dtype])
