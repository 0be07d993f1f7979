"""One request's output as text: the consumer side of the engine's token stream.

The engine emits token ids (StepOutput); whoever reads them (LLM.generate, the CLI, the
gateway) turns them into text deltas here. Stop strings are decided here too: when one
completes, the stream ends with finish_reason "stop" and `needs_abort` tells the reader to
abort the request in the engine (as vLLM's front end does), so at most one extra step runs.
"""
from __future__ import annotations

from tokenyard.engines.core.outputs import StepOutput
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.text.detokenizer import IncrementalDetokenizer
from tokenyard.engines.text.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop,
                                             skip_special_tokens=True,
                                             include_stop_str_in_output=params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.needs_abort = False   # stopped by a stop string while the engine still runs it
        self.num_cached_tokens = 0

    @property
    def text(self) -> str:
        return self._detok.text

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._detok.stop_reason

    def feed(self, out: StepOutput) -> str:
        """Take one step's output; return the text delta it releases (maybe "")."""
        if self.finished:
            return ""
        self.num_cached_tokens = out.num_cached_tokens
        parts = []
        for tok in out.new_token_ids:
            self.token_ids.append(tok)
            parts.append(self._detok.add(tok))
            if self._detok.stopped:
                self.finished, self.finish_reason = True, "stop"
                self.needs_abort = not out.finished
                return "".join(parts)
        if out.finished:
            parts.append(self._detok.finish())
            self.finished, self.finish_reason = True, out.finish_reason
        return "".join(parts)
