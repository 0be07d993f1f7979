"""LLM.close() and `with LLM(...)`: a second tensor-parallel LLM in one process starts once the
first is closed, without reaching into llm.engine (issue 45.10)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.engines.test_tensor_parallel import OPTS
from tokenyard.engines import LLM, RequestError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_two_tensor_parallel_llms_in_sequence_with_blocks(checkpoint_dir):
    outputs = []
    for _ in range(2):
        with LLM(checkpoint_dir("llama"), tensor_parallel_size=2, **OPTS) as llm:
            assert dist.is_initialized()
            outputs.append(llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        assert not dist.is_initialized()   # the workers and the process group are gone
    assert len(outputs[0]) == 4 and outputs[0] == outputs[1]


def test_close_is_idempotent_and_a_closed_llm_refuses_work(checkpoint_dir):
    llm = LLM(checkpoint_dir("llama"), tensor_parallel_size=2, **OPTS)
    llm.close()
    llm.close()
    assert not dist.is_initialized()
    with pytest.raises(RequestError, match="closed"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    with LLM(checkpoint_dir("llama"), **OPTS) as one:   # a single-process LLM closes as well
        assert one.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    one.close()
