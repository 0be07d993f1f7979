"""Offline generation in the shape vLLM users know: LLM(model_dir).generate(prompts, params)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence as Seq

from tqdm import tqdm

from .engine import Engine
from .errors import RequestError
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | Path, **engine_options: Any) -> None:
        self.engine = Engine(model, **engine_options)
        self._counter = 0

    def generate(self, prompts: Seq[Seq[int]] | Seq[int],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (lists of token ids); one output per prompt, in order."""
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise RequestError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise RequestError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        ids = []
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, p, prio in zip(prompts, params, priorities):
                rid = f"gen-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, prompt, p, prio)
                ids.append(rid)
                results[rid] = RequestOutput(rid, list(prompt), [CompletionOutput(0, [], None)])
        except Exception:
            for rid in ids:  # nothing half-submitted stays behind in the engine
                self.engine.abort(rid)
            self._drain(set(ids))
            raise
        pending = set(ids)
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step():
                    res = results.get(out.request_id)
                    if res is None:
                        continue
                    comp = res.outputs[0]
                    comp.token_ids.extend(out.new_token_ids)
                    res.num_cached_tokens = out.num_cached_tokens
                    if out.finished:
                        comp.finish_reason = out.finish_reason
                        res.finished = True
                        pending.discard(out.request_id)
                        bar.update(1)
        return [results[rid] for rid in ids]

    def _drain(self, ids: set[str]) -> None:
        while self.engine.has_unfinished():
            for out in self.engine.step():
                ids.discard(out.request_id)
