"""The engine's greedy output is identical with the Triton attention path (interpreted on the
CPU) and the torch path."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import pytest

from engines import Engine, SamplingParams
from tests.engine_helpers import random_prompts, run_to_completion

pytest.importorskip("triton")


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_triton_and_torch_paths_agree(checkpoint_dir, name):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET was set to something else before this module loaded")
    prompts = random_prompts(4, 3, 40, 512, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        eng = Engine(checkpoint_dir(name), attention_backend=backend, kv_cache_memory=2 << 20,
                     max_num_batched_tokens=32, progress=False)
        eng.add_request("r0", prompts[0], params)
        eng.step()  # later arrivals land mid-prefill/decode: mixed chunk + decode batches
        for i, p in enumerate(prompts[1:], start=1):
            eng.add_request(f"r{i}", p, params)
        outs[backend] = run_to_completion(eng)
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert outs["triton"] == outs["torch"]


def test_padded_cuda_graph_path_matches_torch(checkpoint_dir):
    """The CUDA-graph decode path (static buffers, batches padded up the size ladder, padding
    rows writing to slot -1) run eagerly gives the torch path's greedy tokens."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET was set to something else before this module loaded")
    prompts = random_prompts(5, 3, 30, 512, seed=21)  # 5 decoders pad up to the size-8 graph
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = {}
    for backend, graphs in (("torch", "off"), ("triton", "padded")):
        eng = Engine(checkpoint_dir("llama"), attention_backend=backend, cuda_graphs=graphs,
                     kv_cache_memory=2 << 20, max_num_batched_tokens=64, progress=False)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        outs[backend] = run_to_completion(eng)
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
        if graphs == "padded":
            assert eng.runner.num_graph_steps >= 5  # decode steps really took the graph path
            assert eng.runner.graphs.bucket(5) == 8
    assert outs["triton"] == outs["torch"]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_match_eager_on_gpu(checkpoint_dir):
    prompts = random_prompts(6, 3, 30, 512, seed=22)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for graphs in ("off", "on"):
        eng = Engine(checkpoint_dir("llama"), device="cuda", dtype="float32", cuda_graphs=graphs,
                     cuda_graph_max_batch=8, kv_cache_memory=8 << 20, progress=False)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        outs[graphs] = run_to_completion(eng)
    assert outs["on"] == outs["off"]


def test_gpu_decode_script_dry_run():
    """bench/gpu_decode.py (the GPU check's eager-vs-graphs decode) runs end to end on a tiny
    model, so the script cannot rot between GPU sessions; graph and eager logits agree."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET was set to something else before this module loaded")
    from bench import gpu_decode

    results = gpu_decode.run([1, 3], context=20, steps=2, bandwidth_bytes_per_ms=5e7, dry_run=True)
    assert [(r.batch, r.mode) for r in results] == [(1, "eager"), (1, "cuda graphs"), (3, "eager"),
                                                     (3, "cuda graphs")]
    assert all(r.max_logit_diff < 1e-5 and r.tokens_per_s > 0 for r in results)
