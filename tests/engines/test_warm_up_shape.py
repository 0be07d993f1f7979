"""The warm-up request's shape (warm_up.py): several prompt tokens and decode steps, never a full KV
block (no prefix-cache entry left behind), never past the context."""
from __future__ import annotations

import pytest

from tokenyard.engines.runtime import warm_up


def test_the_default_shape_is_a_multi_token_prompt_and_several_decode_steps() -> None:
    assert warm_up.request_shape(16, 8192) == (warm_up.PROMPT_TOKENS, warm_up.MAX_TOKENS)
    assert warm_up.PROMPT_TOKENS >= 4 and warm_up.MAX_TOKENS >= 4


@pytest.mark.parametrize("block_size,max_model_len", [(16, 8192), (8, 8192), (4, 100), (2, 100), (16, 6), (16, 3)])
def test_the_shape_fills_no_block_and_fits_the_context(block_size: int, max_model_len: int) -> None:
    n_prompt, n_out = warm_up.request_shape(block_size, max_model_len)
    assert n_prompt >= 1 and n_out >= 1
    if min(block_size - 1, max_model_len) >= 3:    # room for a decode step: the warm-up runs one
        assert n_out >= 2
    if block_size > 2:                     # a 2-token block cannot hold prompt + output below it
        assert n_prompt + n_out <= block_size - 1
    if max_model_len >= 2:
        assert n_prompt + n_out <= max_model_len

