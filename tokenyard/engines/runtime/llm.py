"""Offline generation in the shape vLLM users know: LLM(model_dir).generate(prompts, params)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any
from typing import Sequence as Seq

from tqdm import tqdm

from tokenyard.engines.core.errors import CheckpointError, RequestError
from tokenyard.engines.core.outputs import CompletionOutput, RequestOutput
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.runtime.engine import Engine
from tokenyard.engines.text.chat_template import apply_chat_template
from tokenyard.engines.text.text_stream import TextStream
from tokenyard.engines.text.tokenizer import Tokenizer

Prompt = str | Seq[int]


class LLM:
    """Prompts are strings (encoded with the checkpoint's tokenizer) or lists of token ids.

    A checkpoint without tokenizer files still serves token-id prompts; text needs a tokenizer.
    close() (or a `with` block) releases what outlives the object: a tensor- or pipeline-parallel
    engine's workers and its process group, of which a process holds one at a time, so a second
    such LLM can start only once the first is closed.

    LoRA adapters: LLM(base, lora_modules={"sql": "path/to/adapter"}) serves them beside the base;
    generate(..., lora="sql") runs every prompt with that adapter, lora=[name or None per prompt]
    mixes them in one batch (tokenyard/engines/lora).
    """

    def __init__(self, model: str | Path, **engine_options: Any) -> None:
        self.engine = Engine(model, **engine_options)
        self._closed = False
        try:
            self.tokenizer: Tokenizer | None = Tokenizer.from_dir(model)
        except CheckpointError:
            self.tokenizer = None
        self._counter = 0

    def close(self) -> None:
        """Stop the engine's workers (tensor and pipeline parallelism). Idempotent; the LLM
        generates nothing after it."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None,
                 lora: str | Seq[str | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; one output per prompt, in order. lora: an adapter name for every
        prompt, or one name (or None: the base) per prompt; it replaces the params' own lora."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        params = self._per_prompt(sampling_params, len(prompts))
        if lora is not None:
            names = [lora] * len(prompts) if isinstance(lora, str) else list(lora)
            if len(names) != len(prompts):
                raise RequestError(f"got {len(names)} lora names for {len(prompts)} prompts")
            params = [replace(p, lora=name) for p, name in zip(params, names)]
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise RequestError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        token_prompts = [self._tokens(p) for p in prompts]
        return self._run(token_prompts, [p if isinstance(p, str) else None for p in prompts], params, priorities,
                         use_tqdm)

    def chat(self, conversations: Seq[dict] | Seq[Seq[dict]], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the checkpoint's chat template (or the documented fallback) and generate."""
        tok = self._need_tokenizer()
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # a single conversation
        texts = [apply_chat_template(tok, list(c), add_generation_prompt=add_generation_prompt) for c in conversations]
        params = self._per_prompt(sampling_params, len(texts))
        # The template already wrote BOS and friends into the text: no second BOS.
        ids = [tok.encode(t, add_special_tokens=False) for t in texts]
        return self._run(ids, texts, params, [0] * len(ids), use_tqdm)

    def embed(self, texts: Prompt | Seq[Prompt]) -> list[list[float]]:
        """One embedding per prompt, in order: the final hidden states mean-pooled over the prompt's
        tokens and L2-normalised (Engine.embed). Strings are encoded as generate() encodes them (with
        the tokenizer's BOS where it adds one); token-id lists are used as they are."""
        if self._closed:
            raise RequestError("this LLM is closed; make a new one")
        if isinstance(texts, str) or (texts and isinstance(texts[0], int)):
            texts = [texts]  # a single prompt
        return self.engine.embed([self._tokens(t) for t in texts])

    # -- internals ----------------------------------------------------------------------------
    def _run(self, token_prompts: list[list[int]], texts: list[str | None], params: list[SamplingParams],
             priorities: list[int], use_tqdm: bool) -> list[RequestOutput]:
        if self._closed:
            raise RequestError("this LLM is closed; make a new one")
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        streams: dict[str, TextStream] = {}
        try:
            for prompt, text, p, prio in zip(token_prompts, texts, params, priorities):
                rid = f"gen-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, prompt, p, prio)
                ids.append(rid)
                results[rid] = RequestOutput(rid, list(prompt), [CompletionOutput(0, [], None)], prompt=text)
                if self.tokenizer is not None:
                    streams[rid] = TextStream(self.tokenizer, p, prompt)
        except Exception:
            for rid in ids:  # nothing half-submitted stays behind in the engine
                self.engine.abort(rid)
            self._drain()
            raise
        pending = set(ids)
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step():
                    res = results.get(out.request_id)
                    if res is None or out.request_id not in pending:
                        continue
                    comp = res.outputs[0]
                    res.num_cached_tokens = out.num_cached_tokens
                    stream = streams.get(out.request_id)
                    if stream is None:
                        comp.token_ids.extend(out.new_token_ids)
                        done, reason = out.finished, out.finish_reason
                    else:
                        stream.feed(out)
                        comp.token_ids[:] = stream.token_ids
                        comp.text = stream.text
                        done, reason = stream.finished, stream.finish_reason
                        if stream.needs_abort:
                            self.engine.abort(out.request_id)
                    if done:
                        comp.finish_reason = reason
                        res.finished = True
                        pending.discard(out.request_id)
                        bar.update(1)
        self._drain()  # requests stopped by a stop string are still being aborted
        return [results[rid] for rid in ids]

    def _per_prompt(self, sampling_params: Any, n: int) -> list[SamplingParams]:
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            return [sampling_params or SamplingParams()] * n
        params = list(sampling_params)
        if len(params) != n:
            raise RequestError(f"got {len(params)} sampling_params for {n} prompts")
        return params

    def _tokens(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self._need_tokenizer().encode(prompt, add_special_tokens=True)
        return list(prompt)

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError(f"{self.engine.model_dir} has no tokenizer files: pass prompts as token ids")
        return self.tokenizer

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()
