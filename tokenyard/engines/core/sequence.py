"""One request's state inside the engine: its tokens, how many have KV computed, its blocks."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tokenyard.engines.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: int                 # engine-wide arrival counter: breaks priority ties, FIFO
    seed: int                    # always set: the caller's seed, or one drawn at arrival
    eos_token_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0    # prompt tokens served from the prefix cache
    cache_salt: str | None = None  # keeps a tenant's prefix cache private
    lora_id: int = 0              # the LoRA adapter it runs with (tokenyard/engines/lora); 0: the base model
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of registered full blocks
    # Grammar state of a response_format request (structured_output.Constraint), advanced by the
    # engine with every appended token; kept through preemption, as the output tokens are.
    constraint: Any = None
    # Log probabilities of sampled tokens the engine has not emitted yet (params.logprobs set):
    # [token id, logprob, [[id, logprob], ...]] per token, filled by the sampler, taken by the engine.
    pending_logprobs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Lower sorts first: more urgent priority, then earlier arrival."""
        return (self.priority, self.arrival)
