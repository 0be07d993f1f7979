"""Quantised KV blocks (kv_cache_dtype int8) along the engine's other execution paths: tensor-
parallel ranks (each stores its own kv heads, codes and scales) and the CUDA-graph runner's
padded path (Triton kernels, interpreted on a CPU); the compiled CPU decode step is tested in
tests/engines/test_compiled_decode.py (it compiles, which is slow). Each is compared
with the plain eager torch path on the same kv_cache_dtype: quantisation is deterministic, so the
greedy tokens must be identical.
"""
from __future__ import annotations

import pytest

from tests.engine_helpers import random_prompts, run_to_completion
from tokenyard.engines import Engine, SamplingParams
from tokenyard.kernels import kv_quant

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_tensor_parallel_ranks_store_their_own_quantised_heads(checkpoint_dir):
    prompts = random_prompts(3, 4, 30, 512, seed=6)
    tokens = {}
    for tp in (1, 2):
        eng = Engine(checkpoint_dir("llama"), tensor_parallel_size=tp, kv_cache_dtype="int8", dtype="float32",
                     kv_cache_memory=4 << 20, max_num_batched_tokens=64, progress=False, tp_timeout_s=30.0)
        try:
            if tp == 2:   # rank 0 holds one of the two kv heads, codes and scales
                k_cache = eng.runner.kv_caches[0][0]
                assert isinstance(k_cache, kv_quant.QuantizedCache) and k_cache.shape[0] == 1
                assert k_cache.scale.shape == k_cache.shape[:2]
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, GREEDY)
            tokens[tp] = run_to_completion(eng)
        finally:
            eng.close()
    assert tokens[2] == tokens[1]


def test_padded_cuda_graph_path_reads_quantised_blocks(checkpoint_dir):
    """The CUDA-graph decode path (static buffers, padding rows writing to slot -1), run eagerly
    with the Triton kernels, gives the torch path's greedy tokens on an int8 cache."""
    pytest.importorskip("triton")
    prompts = random_prompts(3, 3, 20, 512, seed=21)   # 3 decoders pad up to the size-4 graph
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend, graphs in (("torch", "off"), ("triton", "padded")):
        eng = Engine(checkpoint_dir("llama"), attention_backend=backend, cuda_graphs=graphs, dtype="float32",
                     kv_cache_dtype="int8", kv_cache_memory=2 << 20, max_num_batched_tokens=64, progress=False)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        outs[backend] = run_to_completion(eng)
        if graphs == "padded":
            assert eng.runner.num_graph_steps >= 5
    assert outs["triton"] == outs["torch"]

