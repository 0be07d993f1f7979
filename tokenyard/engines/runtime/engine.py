"""The engine behind one narrow, message-shaped interface.

    add_request(request_id, prompt_token_ids, params, priority)   validate and enqueue
    abort(request_id)                                             stop it at the next step
    step() -> list[StepOutput]                                    run one batch
    stats() -> EngineStats

add_request and abort may be called from any thread (the gateway's event loop); they only put
messages in an inbox. step() runs on one thread (tokenyard.engines.runtime.executor) and drains the inbox first,
so the scheduler's state is only ever touched by that thread.
"""
from __future__ import annotations

import bisect
import logging
import random
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tokenyard.engines.core.block_manager import BlockManager
from tokenyard.engines.core.config import EngineConfig
from tokenyard.engines.core.errors import EngineDeadError, RequestError
from tokenyard.engines.core.outputs import BATCH_BUCKETS, EngineStats, StepOutput
from tokenyard.engines.core.request_inbox import RequestInbox
from tokenyard.engines.core.sampling_params import ParamError, SamplingParams
from tokenyard.engines.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenyard.engines.core.sequence import Sequence
from tokenyard.engines.core.startup_phases import StartupPhases
from tokenyard.engines.core.structured_output import GrammarError, Grammars
from tokenyard.engines.model import kv_cache
from tokenyard.engines.model.attention import resolve_backend
from tokenyard.engines.model.cpu_allocator import keep_freed_memory
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.model.model_runner import ModelRunner
from tokenyard.engines.model.pooled_embedding import check_prompts, embed_prompts
from tokenyard.engines.model.runner_config import RunnerConfig
from tokenyard.engines.model.token_masks import PendingMasks
from tokenyard.engines.pp.pipeline_runner import uses_pipeline
from tokenyard.engines.quant.engine_model import load_engine_model, resolve_quantization
from tokenyard.engines.runtime.engine_sleep import EngineSleep
from tokenyard.engines.runtime.grammar_worker import GrammarBudget
from tokenyard.engines.runtime.mask_prefetch import MaskPrefetch
from tokenyard.engines.runtime.warm_up import warm_up
from tokenyard.engines.text.tokenizer import Tokenizer
from tokenyard.engines.tp.tensor_parallel import check_divisible, shard_model_

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise ValueError("pass either an EngineConfig or keyword options, not both")
        # Where building this engine's time goes (startup_phases.py); "other" = the rest of __init__.
        phases = self.startup_phases = StartupPhases()
        t_init = time.perf_counter()
        cfg = config or EngineConfig.from_options(options)
        cfg.validate()
        if cfg.quantization == "auto":
            # The checkpoint's own storage decides (a Q4_1 GGUF stays int4); the rest of the engine
            # (TP ranks, pipeline stages, engine processes) sees the resolved mode.
            with phases.phase("weights_read"):     # it reads the checkpoint's tensor headers (a GGUF: seconds)
                mode, group = resolve_quantization(model_dir, cfg.quantization, cfg.quant_group_size)
            cfg = replace(cfg, quantization=mode, quant_group_size=group)
            log.info("%s: quantization auto -> %s%s", Path(model_dir).name, mode,
                     f" (groups of {group})" if mode == "int4" else "")
        self.config = cfg
        self.device = cfg.torch_device()
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = cfg.torch_dtype(self.device)
        model_dir = Path(model_dir)
        mcfg = ModelConfig.from_dir(model_dir)
        max_len = cfg.max_model_len or mcfg.max_position_embeddings
        kv_cache.check_kv_cache_dtype(cfg.kv_cache_dtype, self.device, resolve_backend(cfg.attention_backend, self.device))
        budget = kv_cache.kv_budget_bytes(self.device, cfg.kv_cache_fraction, cfg.kv_cache_memory, cfg.kv_cache_cpu_default_bytes)
        num_blocks = kv_cache.num_blocks_for(mcfg, cfg.block_size, self.dtype, budget, cfg.kv_cache_dtype)
        # Per block, over all layers and (under tensor parallelism) all ranks: what the budget buys.
        self.kv_bytes_per_block = kv_cache.bytes_per_block(mcfg, cfg.block_size, self.dtype, cfg.kv_cache_dtype)
        capacity = num_blocks * cfg.block_size
        if max_len > capacity:
            log.warning("max_model_len %d exceeds the KV cache capacity of %d tokens; capping it", max_len, capacity)
            max_len = capacity
        self.max_model_len = max_len
        tp = cfg.tensor_parallel_size
        if tp > 1:
            check_divisible(mcfg, tp)  # before any worker starts
        self.micro = None   # pipeline parallelism: the micro-batch stepper (tokenyard.engines.pp)
        pipelined = uses_pipeline(cfg)
        if pipelined:
            # Pipeline stages, quantised TP, or ranks met through the torch.distributed
            # environment: every rank loads its own part; rank 0 keeps stage 0's.
            from tokenyard.engines.pp.pipeline_runner import start_pipeline
            self.runner = start_pipeline(cfg, model_dir, self.dtype, self.device, max_len, num_blocks)
            self.model, self.model_config = self.runner.model, self.runner.model_config
        else:
            # Plain, quantised at load (cfg.quantization), or a pre-quantised checkpoint as stored.
            with phases.phase("weights_read"):
                self.model, self.model_config = load_engine_model(model_dir, self.dtype, self.device, max_len,
                                                                  cfg.progress, mcfg, cfg.quantization,
                                                                  cfg.quant_group_size, phases)
        self.model_dir = model_dir
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.lora = self._build_lora() if cfg.lora_modules else None
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold,
                            watermark_blocks=max(1, num_blocks // 100), prefill_burst_tokens=cfg.prefill_burst_tokens,
                            max_adapters=cfg.max_loaded_adapters if self.lora is not None else 0),
            self.blocks)
        self._dead: str | None = None
        if pipelined:
            if cfg.pipeline_parallel_size > 1:
                from tokenyard.engines.pp.micro_batches import MicroBatcher
                self.micro = MicroBatcher(self, cfg.pipeline_parallel_size)
        elif tp > 1:
            self.runner = self._start_tensor_parallel(model_dir, num_blocks)
        else:
            self.runner = self._single_runner(num_blocks, phases)
        self.spec = self._build_speculation(num_blocks) if cfg.speculative_method != "none" else None
        self.kv_tier = None   # the second cache tier (host memory, then disk): engine option kv_offload_*
        if cfg.kv_offload:
            from tokenyard.engines.kv_transfer.tiered_store import TieredStore
            self.kv_tier = TieredStore(self, cfg.kv_offload_host_bytes, cfg.kv_offload_disk_path,
                                       cfg.kv_offload_disk_bytes)
        self._seed_rng = random.Random(cfg.seed)
        self._grammars: Grammars | None = None   # built by warm_grammars() or the first response_format request
        # What a schema may cost to compile (AsyncEngine's grammar gate holds requests to it).
        self.grammar_budget = GrammarBudget(float(cfg.grammar_compile_timeout_s), cfg.grammar_compile_memory_mb)
        self.grammar_model_dir: Path | None = model_dir   # whose tokenizer the grammar worker compiles for
        self._grammars_lock = threading.Lock()
        # Grammar masks filled while the forward runs (grammar_mask_overlap; mask_prefetch.py).
        self._mask_prefetch = MaskPrefetch(self.device) if cfg.grammar_mask_overlap else None
        self._inbox: RequestInbox[Sequence] = RequestInbox()
        self._arrivals = 0
        self._num_steps = 0
        self._num_grammar_closed = 0       # constrained replies the grammar_close_reserve ended
        self._last_step_tokens = 0
        self._last_step_seconds = 0.0
        # Load counters for utilisation: seconds spent in steps (busy fraction = its rate), tokens
        # computed for prompts and tokens emitted, and a histogram of sequences per step.
        self._busy_seconds = 0.0
        self._prefill_tokens = 0
        self._output_tokens = 0
        self._batch_counts = [0] * (len(BATCH_BUCKETS) + 1)
        self._sleep = EngineSleep(self)    # sleep(level) / wake(): engine_sleep.py
        with phases.phase("warm_up"):   # one tiny request, counters put back (warm_up.py)
            warm_up(self)
        phases.finish(time.perf_counter() - t_init)
        log.info("%s: engine built in %s", model_dir.name, phases.describe())

    # -- the interface ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | dict | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> None:
        """Queue a request. priority: lower is more urgent (ties: arrival order). cache_salt:
        prefix-cache entries are shared only between requests with the same salt."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead ({self._dead}); start a new one")
        params = self._check_params(params)
        prompt = self._check_prompt(prompt_token_ids)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestError(f"priority must be an integer, got {priority!r}")
        if not isinstance(request_id, str) or not request_id:
            raise RequestError("request_id must be a non-empty string")
        # A cache hit when the request was prepared (AsyncEngine.prepare: compiled off the event loop);
        # otherwise compiled here, in the caller's thread (offline use): a rejected schema fails now.
        # The closing reserve counts back from whichever limit comes first: max_tokens or the context.
        budget = min(params.max_tokens, self.max_model_len - len(prompt))
        constraint = self._grammar_set().constraint(params.response_format, budget, self.config.grammar_close_reserve) \
            if params.response_format else None
        if params.lora is not None and self.lora is None:
            raise ParamError(f"LoRA adapter {params.lora!r} requested, but this engine serves no adapters "
                             f"(lora_modules)", "lora", "lora_not_found")
        lora = self.lora

        def make() -> Sequence:  # under the inbox lock: arrival numbers and drawn seeds stay in order
            # The adapter's id is taken here, under the lock, so a run-time unload (unload_adapter) never
            # races a request naming it: either the request is live when the unload counts, or it is refused.
            lora_id = lora.id_of(params.lora) if lora is not None else 0
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            seq = Sequence(request_id, prompt, params, priority, self._arrivals, seed, self.eos_token_ids,
                           cache_salt=cache_salt, constraint=constraint, lora_id=lora_id)
            self._arrivals += 1
            return seq

        self._inbox.add(request_id, make)

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed and an "abort" output is emitted at the next step.
        Unknown or already finished ids are ignored (the race with completion is normal)."""
        self._inbox.abort(request_id)

    def has_unfinished(self) -> bool:
        return self._inbox.has_live

    def step(self) -> list[StepOutput]:
        if self.micro is not None:   # pipeline parallelism: batches overlap (tokenyard.engines.pp.micro_batches)
            return self.micro.step()
        if self._sleep.level:        # a request reached a sleeping engine: it wakes for it
            self._sleep.wake()
        outputs = [self._finish(seq, "abort", []) for seq in self._take_aborts()]
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.chunks:
            return outputs
        pending = self._prefetch_masks(batch)
        try:
            if self.spec is not None:
                results = [(r.new_tokens, r.num_computed) for r in self.spec.execute(batch)]
            else:
                tokens = iter(self.runner.execute(batch))
                results = [([next(tokens)] if c.samples else [], c.num_tokens) for c in batch.chunks]
        except Exception as exc:  # noqa: BLE001 - the step's state is unknown: fail everything
            return outputs + self._fail_all(exc)
        finally:
            if pending is not None:
                pending.wait()   # the fill is over before any constraint accepts a token
        return outputs + self._apply(batch, results, t0)

    def _prefetch_masks(self, batch: SchedulerOutput) -> PendingMasks | None:
        """Start filling the masks of the batch's constrained rows while the forward runs."""
        if self._mask_prefetch is None:
            return None
        cons = [c.seq.constraint for c in batch.chunks if c.samples and c.seq.constraint is not None]
        return self._mask_prefetch.start(cons, self.model_config.vocab_size) if cons else None

    def _take_aborts(self) -> list[Sequence]:
        """Queue the new requests; return the live sequences whose abort was asked for."""
        new, aborts = self._inbox.take()
        for seq in new:
            self.scheduler.add(seq)
        live = (self._inbox.get(rid) for rid in aborts)
        return [seq for seq in live if seq is not None and not seq.is_finished]

    def _apply(self, batch: SchedulerOutput, results: list[tuple[list[int], int]], t0: float) -> list[StepOutput]:
        """Apply a computed batch: per chunk (new tokens, tokens computed). Returns the outputs."""
        outputs: list[StepOutput] = []
        samples = [c.samples for c in batch.chunks]
        prefill = sum(c.num_tokens for c in batch.chunks if c.seq.num_computed_tokens < c.seq.num_prompt_tokens)
        for chunk, sampled, (new_tokens, num_computed) in zip(batch.chunks, samples, results):
            seq = chunk.seq
            seq.num_computed_tokens += num_computed
            if not sampled:
                self.blocks.cache_full_blocks(seq)
                continue
            # Several tokens when speculation accepted drafts; stop at the first that ends it.
            emitted: list[int] = []
            reason = None
            for tok in new_tokens:
                seq.token_ids.append(tok)
                emitted.append(tok)
                if seq.constraint is not None and not seq.constraint.accept(tok):
                    reason = "grammar"   # the mask should make this impossible
                    break
                reason = self._stop_reason(seq, tok)
                if reason is not None:
                    break
            if reason == "stop" and seq.constraint is not None and seq.constraint.closed_early:
                self._num_grammar_closed += 1
            # K/V is valid for every token but the last emitted one.
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            self.blocks.cache_full_blocks(seq)
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs, seq.pending_logprobs = seq.pending_logprobs, []
            if reason == "grammar":
                outputs.append(self._finish(seq, "error", emitted[:-1], f"token {emitted[-1]} breaks the grammar"))
            elif reason is not None:
                outputs.append(self._finish(seq, reason, emitted, logprobs=logprobs))
            else:
                outputs.append(StepOutput(seq.request_id, emitted, num_prompt_tokens=seq.num_prompt_tokens,
                                          num_cached_tokens=seq.num_cached_tokens, logprobs=logprobs))
        self._num_steps += 1
        self._last_step_tokens = batch.num_tokens
        self._last_step_seconds = time.perf_counter() - t0
        self._busy_seconds += self._last_step_seconds
        self._output_tokens += sum(len(o.new_token_ids) for o in outputs)
        self._prefill_tokens += prefill
        self._batch_counts[bisect.bisect_left(BATCH_BUCKETS, len(batch.chunks))] += 1
        return outputs

    def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """A unit vector per prompt (tokenyard/engines/model/pooled_embedding.py). It touches no KV block, so it
        runs between any two steps, on the step thread (AsyncEngine.embed). RequestError for bad prompts."""
        prompts = self.check_embed(prompts)
        if self._sleep.level:
            self._sleep.wake()
        return embed_prompts(self.model, prompts, self.config.max_num_batched_tokens).tolist()

    def check_embed(self, prompts: list[list[int]]) -> list[list[int]]:
        """The prompts as lists, or RequestError (any thread)."""
        if self.config.tensor_parallel_size > 1 or uses_pipeline(self.config):
            raise RequestError("embeddings are not supported with tensor or pipeline parallelism")
        return check_prompts(prompts, self.model_config.vocab_size, self.max_model_len)

    def stats(self) -> EngineStats:
        total = self.blocks.num_blocks
        free = self.blocks.num_free_blocks
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting) + self._inbox.num_new,
            num_free_blocks=free, num_total_blocks=total, kv_usage=(total - free) / total,
            block_size=self.config.block_size, num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_rate=self.blocks.hit_rate, prefix_cache_hit_tokens=self.blocks.hit_tokens,
            num_steps=self._num_steps, last_step_tokens=self._last_step_tokens,
            last_step_seconds=self._last_step_seconds, max_num_seqs=self.config.max_num_seqs,
            busy_seconds=self._busy_seconds, prefill_tokens=self._prefill_tokens, output_tokens=self._output_tokens,
            batch_size_counts=list(self._batch_counts),
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            kv_cache_dtype=kv_cache.kv_cache_dtype_name(self.config.kv_cache_dtype, self.dtype),
            kv_bytes_per_block=self.kv_bytes_per_block, num_grammar_closed=self._num_grammar_closed,
            **self._spec_stats(), **self._lora_stats())

    # -- LoRA adapters at run time (tokenyard/engines/lora/adapter_pool.py) ------------------------------
    def load_adapter(self, name: str, path: str | Path) -> dict:
        """Register a PEFT adapter while serving; on the step thread, between steps (AsyncEngine and the
        engine process call it there). AdapterError names the tensor that does not fit this base or pool."""
        if self.lora is None:
            from tokenyard.engines.lora.adapter_errors import AdapterUnsupported
            raise AdapterUnsupported("this engine serves no LoRA adapters: start it with at least one in "
                                     "lora_modules (that sizes its adapter pool) to load others at run time")
        return self.lora.register(name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter; AdapterConflict while requests (queued or running) use it, AdapterNotFound
        for an unknown name. Step thread, between steps."""
        from tokenyard.engines.lora.adapter_errors import AdapterConflict, AdapterNotFound
        if self.lora is None or name not in self.lora.ids:
            raise AdapterNotFound(f"no LoRA adapter {name!r} on this engine")
        adapter_id = self.lora.ids[name]
        busy = self._inbox.unless_live(lambda seq: seq.lora_id == adapter_id, lambda: self.lora.unregister(name))
        if busy:
            raise AdapterConflict(f"LoRA adapter {name!r} has {busy} request(s) in flight; unload it when they "
                                  f"finished")

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        return dict(lora_names=sorted(self.lora.ids), lora_resident=self.lora.resident,
                    lora_adapters=len(self.lora.ids), lora_loaded=len(self.lora.loaded),
                    lora_loads=self.lora.num_loads, lora_evictions=self.lora.num_evictions,
                    lora_eager_steps=getattr(self.runner, "num_lora_eager_steps", 0))

    def _spec_stats(self) -> dict:
        if self.spec is None:
            return {}
        st = self.spec.stats
        return dict(spec_proposer=st.proposer, spec_num_proposed=st.num_proposed,
                    spec_num_accepted=st.num_accepted, spec_acceptance_rate=st.acceptance_rate,
                    spec_mean_accepted_length=st.mean_accepted_length)

    def close(self) -> None:
        """Release what outlives the object: tensor-parallel workers; the second cache tier's host
        blocks go to its disk tier. Idempotent."""
        if self.kv_tier is not None:
            # After a failed step the KV is not trusted (_fail_all): nothing more goes to disk.
            self.kv_tier.close(flush=self._dead is None)
            self.kv_tier = None
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        prefetch = getattr(self, "_mask_prefetch", None)
        if prefetch is not None:
            prefetch.close()

    # -- sleep and wake (tokenyard/engines/runtime/engine_sleep.py) -----------------------------
    @property
    def sleep_level(self) -> int:
        """0 awake; 1 KV cache released; 2 weights dropped too."""
        return self._sleep.level

    def sleep(self, level: int) -> float:
        """Release the KV cache (1) and the weights (2); nothing may be in flight. Seconds taken."""
        return self._sleep.sleep(level)

    def wake(self) -> dict[str, float]:
        """Serve again; {phase: seconds} of the wake. A step on a sleeping engine wakes it itself."""
        return self._sleep.wake()

    @property
    def dead(self) -> str | None:
        """Why the engine failed, or None while it is healthy."""
        return self._dead

    # -- helpers ------------------------------------------------------------------------------
    def _single_runner(self, num_blocks: int, phases: StartupPhases) -> ModelRunner:
        """A fresh KV cache and the runner over it (at start, and when waking from sleep level 2)."""
        cfg = self.config
        with phases.phase("kv_allocation"):
            kv = kv_cache.allocate_kv_cache(self.model_config, num_blocks, cfg.block_size, self.dtype,
                                            self.device, cfg.kv_cache_dtype)
        # The runner captures CUDA graphs, builds the C decode step, compiles (and warms up) the CPU
        # decode graph and packs oneDNN weights, as the configuration asks.
        with phases.phase("compile"):
            return ModelRunner(self.model, kv, self.device, RunnerConfig(
                block_size=cfg.block_size, attention_backend=cfg.attention_backend, cuda_graphs=cfg.cuda_graphs,
                max_model_len=self.max_model_len, cuda_graph_max_batch=min(cfg.cuda_graph_max_batch, cfg.max_num_seqs),
                cpu_compile=cfg.cpu_compile, max_num_seqs=cfg.max_num_seqs, cpu_decode_step=cfg.cpu_decode_step,
                cpu_decode_step_max_batch=cfg.cpu_decode_step_max_batch,
                cpu_onednn_linear=cfg.cpu_onednn_linear, activation_quant=cfg.activation_quant), lora=self.lora)

    def _start_tensor_parallel(self, model_dir: Path, num_blocks: int) -> ModelRunner:
        from tokenyard.engines.model.kv_cache import allocate_kv_cache as alloc
        from tokenyard.engines.tp.tp_runner import TensorParallelRunner, start

        cfg = self.config
        dtype_name = str(self.dtype).removeprefix("torch.")
        spec = dict(world=cfg.tensor_parallel_size, backend="nccl" if self.device.type == "cuda" else "gloo",
                    model_dir=str(model_dir), dtype=dtype_name, device=self.device.type,
                    max_model_len=self.max_model_len, num_blocks=num_blocks, block_size=cfg.block_size,
                    kv_cache_dtype=cfg.kv_cache_dtype, attention_backend=cfg.attention_backend, timeout_s=float(cfg.tp_timeout_s))
        group = start(cfg.tensor_parallel_size, spec, float(cfg.tp_timeout_s))
        try:
            shard_model_(self.model, 0, cfg.tensor_parallel_size)
            kv = alloc(self.model.local_cfg, num_blocks, cfg.block_size, self.dtype, self.device, cfg.kv_cache_dtype)
            # CUDA graphs stay off under tensor parallelism (collectives inside captured graphs are
            # not wired up yet); decode runs eagerly on every rank.
            return TensorParallelRunner(group, self.model, kv, self.device, RunnerConfig(cfg.block_size, cfg.attention_backend))
        except BaseException:
            group.close()
            raise

    def _build_lora(self) -> "AdapterPool":  # noqa: F821 - imported inside (optional feature)
        """The adapter pool of lora_modules, each adapter checked against the base, attached to the model."""
        from tokenyard.engines.lora.adapter_pool import AdapterPool
        from tokenyard.engines.lora.lora_linear import attach

        cfg = self.config
        pool = AdapterPool(dict(cfg.lora_modules or {}), self.model_config, self.dtype, self.device,
                           cfg.max_loaded_adapters, cfg.max_lora_rank)
        attach(self.model, pool)
        return pool

    def _build_speculation(self, num_blocks: int) -> "SpeculativeDecoder":  # noqa: F821 - imported inside (optional feature)
        from tokenyard.engines.speculative.spec_decode import SpeculativeDecoder

        cfg = self.config
        if cfg.speculative_method == "ngram":
            from tokenyard.engines.speculative.ngram_proposer import NgramProposer
            proposer = NgramProposer(cfg.ngram_min, cfg.ngram_max)
        else:
            from tokenyard.engines.speculative.draft_proposer import DraftProposer
            # The draft gets as many (much smaller) blocks as the target, so it never runs out first.
            proposer = DraftProposer(cfg.draft_model, self.model_config, self.dtype, self.device, self.max_model_len,
                                     num_blocks, cfg.block_size, cfg.attention_backend, cfg.kv_cache_dtype)
        return SpeculativeDecoder(self.runner, self.blocks, proposer, cfg.num_speculative_tokens,
                                  cfg.spec_max_batch, self.max_model_len)

    def _fail_all(self, exc: Exception) -> list[StepOutput]:
        """A step raised: the KV and scheduler state of this step are unknown, so every in-flight
        request ends with an error and the engine refuses new work until it is replaced."""
        self._dead = f"{type(exc).__name__}: {exc}"
        log.error("engine step failed; failing all in-flight requests: %s", self._dead, exc_info=exc)
        live = self._inbox.clear()
        outs = []
        for seq in live:
            if seq in self.scheduler.running or seq in self.scheduler.waiting:
                self.scheduler.remove(seq)
            if self.spec is not None:
                self.spec.release(seq)
            seq.finish_reason = "error"
            outs.append(StepOutput(seq.request_id, [], finished=True, finish_reason="error",
                                   num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                                   error=self._dead))
        self.close()
        return outs

    def _finish(self, seq: Sequence, reason: str, new_tokens: list[int], error: str | None = None,
                logprobs: list | None = None) -> StepOutput:
        self.scheduler.remove(seq)
        if self.spec is not None:
            self.spec.release(seq)
        seq.finish_reason = reason
        self._inbox.done(seq.request_id)
        return StepOutput(seq.request_id, new_tokens, finished=True, finish_reason=reason,
                          num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                          error=error, logprobs=logprobs)

    def prepare_grammar(self, fmt: dict) -> None:
        """Compile a response format into the grammar cache (any thread; GrammarError when refused)."""
        self._grammar_set().compile(fmt)

    def warm_grammars(self) -> None:
        """Build the grammar set (the tokenizer's vocabulary for the compiler) ahead of the first request."""
        self._grammar_set()

    def _grammar_set(self) -> Grammars:
        """The engine's grammar compiler, built once from the model's tokenizer (thread-safe)."""
        with self._grammars_lock:
            if self._grammars is None:
                try:
                    self._grammars = Grammars.from_tokenizer(Tokenizer.from_dir(self.model_dir),
                                                             self.model_config.vocab_size, sorted(self.eos_token_ids))
                except GrammarError:
                    raise
                except Exception as e:  # noqa: BLE001 - no tokenizer files next to the weights, ...
                    raise GrammarError(f"response_format is unavailable on this engine: {e}") from e
            return self._grammars

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and tok in seq.eos_token_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if seq.constraint is not None and seq.constraint.is_terminated:
            return "stop"   # the document is complete (the grammar accepted a stop token)
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _check_params(self, params: SamplingParams | dict | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams or a dict, got {type(params).__name__}")
        params.validate()
        params.check_vocab(self.model_config.vocab_size)
        return params

    def _check_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise RequestError(f"prompt_token_ids must be a list of integers, got {type(prompt).__name__}")
        if not prompt:
            raise RequestError("prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise RequestError(f"prompt token {t!r} is not an integer id in [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt)} tokens but max_model_len is {self.max_model_len}: "
                f"it must be shorter to leave room for at least one output token")
        return list(prompt)
