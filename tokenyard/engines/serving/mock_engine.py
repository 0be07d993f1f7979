"""A model-free engine with the same message-shaped interface as `Engine`.

It exists so that the gateway, admission and spend can be tested fast and so that the gateway's
own overhead can be measured without a forward pass in the way. What it generates is fixed:
the tokens of `reply` (encoded once with the tokenizer of the checkpoint folder it is given,
so the gateway's detokeniser sees real ids, including multi-byte characters split over
tokens), cycled to `output_len` tokens when that is set, then the tokenizer's EOS. Sampling
options (temperature, seed, ...) are validated like the real engine's but do not change the
text, so streamed and non-streamed results are always equal.

Timing: the first token of a request is due `ttft_ms` after it arrives, then one token every
`token_ms`. `step()` sleeps until the earliest due token (at most `max_sleep_ms`, so aborts
are seen quickly), the way a real step spends time in the forward pass; every request that is
due gets one token per step, as in continuous batching.

Sleep and wake (tokenyard/engines/core/sleep_level.py) are simulated too: sleep(level) needs nothing
in flight and records the level; a wake (by call, or by the first step after a request arrived)
sleeps `wake_ms` as a real one loads.

KV accounting is simulated (blocks of `block_size` tokens out of `num_blocks`), so stats()
looks like the real engine's and "back to idle" can be checked the same way.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.core.outputs import BATCH_BUCKETS, EngineStats, StepOutput
from tokenyard.engines.core.request_inbox import RequestInbox
from tokenyard.engines.core.sampling_params import ParamError, SamplingParams
from tokenyard.engines.core.sleep_level import check_sleep_level
from tokenyard.engines.core.structured_output import GrammarError
from tokenyard.engines.text.tokenizer import Tokenizer

DEFAULT_REPLY = "Tokenyard mock reply: the quick brown fox jumps over the lazy dog. café ✓ 日本語"


@dataclass(slots=True)
class MockConfig:
    """Knobs of a mock engine (deployment YAML keys of an engine with `type: mock`)."""

    ttft_ms: float = 0.0          # time from arrival to the first token
    token_ms: float = 0.0         # time between later tokens
    reply: str = DEFAULT_REPLY    # the text generated (encoded with the folder's tokenizer)
    output_len: int = 0           # tokens before EOS; 0: the reply once
    max_model_len: int = 4096
    block_size: int = 16
    num_blocks: int = 4096
    max_num_seqs: int = 256
    max_sleep_ms: float = 20.0    # longest sleep inside one step (bounds abort latency)
    cached_tokens: int = 0        # prompt tokens reported as prefix-cache hits (at most the prompt): billing tests
    wake_ms: float = 0.0          # how long waking from sleep takes (either level)
    # LoRA adapter names it answers to (the folders are not read): a request for one gets "[NAME] " before
    # the reply, so tests can see which adapter a request reached; an unknown name is refused as the real engine does.
    # Adapters loaded at run time (load_adapter) have their adapter_config.json read and checked (rank at most
    # 64), not their tensors.
    lora_modules: dict[str, str] | None = None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "MockConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown mock engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        cfg = cls(**options)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("ttft_ms", "token_ms", "max_sleep_ms", "wake_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name in ("max_model_len", "block_size", "num_blocks", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.cached_tokens, int) or isinstance(self.cached_tokens, bool) or self.cached_tokens < 0:
            raise ValueError(f"cached_tokens must be an integer >= 0, got {self.cached_tokens!r}")
        if not isinstance(self.output_len, int) or self.output_len < 0:
            raise ValueError(f"output_len must be an integer >= 0, got {self.output_len!r}")
        if not isinstance(self.reply, str) or not self.reply:
            raise ValueError("reply must be a non-empty string")
        if self.lora_modules is not None and (not isinstance(self.lora_modules, dict) or not all(
                isinstance(k, str) and k and ":" not in k for k in self.lora_modules)):
            raise ValueError(f"lora_modules must map adapter names (non-empty, without ':') to folders, "
                             f"got {self.lora_modules!r}")


class _MockSeq:
    __slots__ = ("request_id", "num_prompt_tokens", "params", "num_out", "due", "target", "reply")

    def __init__(self, request_id: str, num_prompt_tokens: int, params: SamplingParams, due: float,
                 target: int, reply: list[int]) -> None:
        self.reply = reply
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.params = params
        self.num_out = 0
        self.due = due
        self.target = target


class MockEngine:
    """add_request / abort / step / stats / has_unfinished, like tokenyard.engines.Engine."""

    # Its step sleeps instead of computing: it must not hold the shared torch thread.
    uses_torch_executor = False

    def __init__(self, model_dir: str | Path, config: MockConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise ValueError("pass either a MockConfig or keyword options, not both")
        self.config = cfg = config or MockConfig.from_options(options)
        cfg.validate()
        self.model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.max_model_len = cfg.max_model_len
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self._replies = {name: self._reply_ids(cfg.reply if name is None else f"[{name}] {cfg.reply}")
                         for name in [None, *(cfg.lora_modules or {})]}
        self._reply = self._replies[None]
        self._eos = self.tokenizer.eos_token_id
        self._vocab = self.tokenizer.vocab_size
        self._inbox: RequestInbox[_MockSeq] = RequestInbox()
        self._running: dict[str, _MockSeq] = {}
        self._num_steps = 0
        self._busy_seconds = 0.0
        self._output_tokens = 0
        self._batch_counts = [0] * (len(BATCH_BUCKETS) + 1)
        self._last_step_tokens = 0
        self._last_step_seconds = 0.0
        self.sleep_level = 0

    # -- LoRA adapters at run time (as tokenyard.engines.Engine.load_adapter / unload_adapter) --------------
    def load_adapter(self, name: str, path: str | Path) -> dict:
        from tokenyard.engines.lora.adapter_config import read_adapter_config
        from tokenyard.engines.lora.adapter_errors import AdapterConflict, check_adapter_name

        check_adapter_name(name)
        if name in self._replies:
            raise AdapterConflict(f"LoRA adapter {name!r} is already loaded; unload it first to replace it")
        cfg = read_adapter_config(path)           # AdapterError names the key
        self._replies[name] = self._reply_ids(f"[{name}] {self.config.reply}")
        return {"name": name, "path": str(path), "rank": cfg.rank, "alpha": cfg.alpha,
                "modules": list(cfg.target_modules), "bytes": 0, "seconds": 0.0}

    def unload_adapter(self, name: str) -> None:
        from tokenyard.engines.lora.adapter_errors import AdapterConflict, AdapterNotFound

        if name is None or name not in self._replies:
            raise AdapterNotFound(f"no LoRA adapter {name!r} on this engine")
        busy = self._inbox.unless_live(lambda seq: seq.params.lora == name, lambda: self._replies.pop(name))
        if busy:
            raise AdapterConflict(f"LoRA adapter {name!r} has {busy} request(s) in flight; unload it when they "
                                  f"finished")

    def sleep(self, level: int) -> float:
        level = check_sleep_level(level)
        if self._inbox.has_live or self._running:
            raise RequestError("the engine has requests in flight; drain it before it sleeps")
        self.sleep_level = max(self.sleep_level, level)
        return 0.0

    def wake(self) -> dict[str, float]:
        if not self.sleep_level:
            return {}
        time.sleep(self.config.wake_ms / 1000)
        self.sleep_level = 0
        return {"other": self.config.wake_ms / 1000}

    def _reply_ids(self, text: str) -> list[int]:
        reply = self.tokenizer.encode(text, add_special_tokens=False)
        n = self.config.output_len or len(reply)
        return [reply[i % len(reply)] for i in range(n)]

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | dict | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> None:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        else:
            params.validate()
        if not isinstance(request_id, str) or not request_id:
            raise RequestError("request_id must be a non-empty string")
        if params.response_format is not None:   # its canned text could not honour a grammar
            raise GrammarError("response_format is not supported by the mock engine (its reply is canned text)")
        if params.logprobs is not None:   # its canned text has no distribution to report
            raise ParamError("'logprobs' is not supported by the mock engine (its reply is canned text)", "logprobs",
                             code="unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty", "logit_bias"):
            if getattr(params, name):   # its canned text has no logits to adjust
                raise ParamError(f"'{name}' is not supported by the mock engine (its reply is canned text)", name,
                                 code="unsupported_parameter")
        if params.lora is not None and params.lora not in self._replies:
            raise ParamError(f"unknown LoRA adapter {params.lora!r}; this engine serves: "
                             f"{', '.join(self._adapters()) or 'none'}", "lora", "lora_not_found")
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise RequestError("prompt is empty: at least one token is needed")
        if any(not isinstance(t, int) or not 0 <= t < self._vocab for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {self._vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(prompt_token_ids)} tokens but max_model_len is {self.max_model_len}")
        room = self.max_model_len - len(prompt_token_ids)
        target = min(params.max_tokens, room)
        due = time.monotonic() + self.config.ttft_ms / 1000

        def make() -> _MockSeq:     # under the inbox lock, as the real engine's (an unload cannot slip between)
            reply = self._replies.get(params.lora)
            if reply is None:
                raise ParamError(f"unknown LoRA adapter {params.lora!r}", "lora", "lora_not_found")
            return _MockSeq(request_id, len(prompt_token_ids), params, due, target, reply)

        self._inbox.add(request_id, make)

    def abort(self, request_id: str) -> None:
        self._inbox.abort(request_id)

    def has_unfinished(self) -> bool:
        return self._inbox.has_live

    def step(self) -> list[StepOutput]:
        if self.sleep_level:
            self.wake()
        outputs: list[StepOutput] = []
        new, aborts = self._inbox.take()
        for seq in new:
            self._running[seq.request_id] = seq
        for rid in aborts:
            seq = self._running.get(rid)
            if seq is not None:
                outputs.append(self._finish(seq, "abort", []))
        if not self._running:
            return outputs
        t0 = time.perf_counter()
        now = time.monotonic()
        earliest = min(s.due for s in self._running.values())
        if earliest > now:  # the "forward pass": wait for the next due token
            time.sleep(min(earliest - now, self.config.max_sleep_ms / 1000))
            now = time.monotonic()
        n = 0
        for seq in list(self._running.values())[:self.config.max_num_seqs]:
            if seq.due > now:
                continue
            n += 1
            tok, reason = self._next_token(seq)
            seq.num_out += 1
            seq.due = max(seq.due + self.config.token_ms / 1000, now) if self.config.token_ms else now
            if reason is not None:
                outputs.append(self._finish(seq, reason, [tok]))
            else:
                outputs.append(StepOutput(seq.request_id, [tok], num_prompt_tokens=seq.num_prompt_tokens,
                                          num_cached_tokens=self._cached(seq)))
        self._num_steps += 1
        self._last_step_tokens = n
        self._last_step_seconds = time.perf_counter() - t0
        # The same load counters as the real engine (its "forward pass" is the sleep above).
        self._busy_seconds += self._last_step_seconds
        self._output_tokens += n
        if n:
            self._batch_counts[bisect.bisect_left(BATCH_BUCKETS, n)] += 1
        return outputs

    def stats(self) -> EngineStats:
        cfg = self.config
        used = sum(-(-(s.num_prompt_tokens + s.num_out) // cfg.block_size) for s in self._running.values())
        used = min(used, cfg.num_blocks)
        waiting = self._inbox.num_new
        return EngineStats(
            num_running=len(self._running), num_waiting=waiting, num_free_blocks=cfg.num_blocks - used,
            num_total_blocks=cfg.num_blocks, kv_usage=used / cfg.num_blocks, block_size=cfg.block_size,
            num_preemptions=0, prefix_cache_hit_rate=0.0, prefix_cache_hit_tokens=0, num_steps=self._num_steps,
            last_step_tokens=self._last_step_tokens, last_step_seconds=self._last_step_seconds,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_seqs,
            busy_seconds=self._busy_seconds, output_tokens=self._output_tokens,
            batch_size_counts=list(self._batch_counts), lora_names=self._adapters(), lora_resident=self._adapters(),
            lora_adapters=len(self._adapters()))

    def _adapters(self) -> list[str]:
        return sorted(n for n in self._replies if n is not None)

    def _next_token(self, seq: _MockSeq) -> tuple[int, str | None]:
        i = seq.num_out
        if i >= len(seq.reply) and not seq.params.ignore_eos and self._eos is not None:
            return self._eos, "stop"
        tok = seq.reply[i % len(seq.reply)]
        if tok in seq.params.stop_token_ids:
            return tok, "stop"
        if i + 1 >= seq.target:
            return tok, "length"
        return tok, None

    def _finish(self, seq: _MockSeq, reason: str, new_tokens: list[int]) -> StepOutput:
        self._running.pop(seq.request_id, None)
        self._inbox.done(seq.request_id)
        return StepOutput(seq.request_id, new_tokens, finished=True, finish_reason=reason,
                          num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=self._cached(seq))

    def _cached(self, seq: _MockSeq) -> int:
        return min(self.config.cached_tokens, seq.num_prompt_tokens)
