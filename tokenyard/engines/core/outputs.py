"""Message-shaped results of the engine: plain data, so they can cross a thread, process or host."""
from __future__ import annotations

from dataclasses import dataclass, field

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)   # upper bounds of the batch-size histogram


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request: the new token ids since the last step."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None   # "stop", "length", "abort", or "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # When the request asked for logprobs: one [token id, logprob, [[id, logprob], ...]] per new token,
    # the model's log_softmax (see SamplingParams.logprobs).
    logprobs: list | None = None
    # finish_reason "error" caused by the request itself (a remote replica refused its parameters):
    # the gateway answers it as a 400 naming error_param, not as an engine failure.
    bad_request: bool = False
    error_param: str | None = None
    error_code: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None
    text: str = ""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt: str | None = None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    block_size: int
    num_preemptions: int
    prefix_cache_hit_rate: float      # prompt tokens served from the cache / prompt tokens admitted
    prefix_cache_hit_tokens: int
    num_steps: int
    last_step_tokens: int
    last_step_seconds: float
    max_num_seqs: int
    max_num_batched_tokens: int
    spec_proposer: str | None = None        # "ngram" or "draft" when speculation is on
    spec_num_proposed: int = 0
    spec_num_accepted: int = 0
    spec_acceptance_rate: float = 0.0       # accepted / proposed draft tokens
    spec_mean_accepted_length: float = 0.0  # tokens emitted per verification (1 .. k+1)
    # Load, as counters since start: seconds spent in steps (busy fraction = their rate), prompt tokens
    # computed, output tokens emitted, and steps by sequences per step (counts per BATCH_BUCKETS
    # upper bound, the last for larger batches).
    busy_seconds: float = 0.0
    prefill_tokens: int = 0
    output_tokens: int = 0
    batch_size_counts: list[int] = field(default_factory=list)
    # What the KV cache stores ("float32", "bfloat16", ..., "int8", "fp8_e4m3") and the bytes of one
    # block over all layers, K and V, scales included (0: not reported, e.g. a mock or remote engine).
    kv_cache_dtype: str = ""
    kv_bytes_per_block: int = 0
    # Constrained replies the grammar_close_reserve ended (a closing mask narrowed a choice), since start.
    num_grammar_closed: int = 0
    # LoRA adapters (EngineConfig.lora_modules): registered, held in the pool now, reads into the pool
    # and evictions from it since start, and decode steps that ran the eager torch forward instead of
    # a fast path (CUDA graphs, the C decode step, the compiled graph) because an adapter was in them.
    lora_adapters: int = 0
    lora_loaded: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0
    lora_eager_steps: int = 0
    # The adapters' names a request may use now (start-up and run-time loads), and those in a pool slot now
    # (a replica pool prefers a replica that holds the request's adapter: tokenyard/gateway/backends/replica_pool.py).
    lora_names: list[str] = field(default_factory=list)
    lora_resident: list[str] = field(default_factory=list)
