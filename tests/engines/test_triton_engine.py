"""The engine's greedy output is identical with the Triton attention path and the torch path, in
fp32: Triton compiled on a GPU, interpreted on the CPU elsewhere (tests/triton_mode.py)."""
import pytest

from tests.engine_helpers import random_prompts, run_to_completion
from tests.triton_mode import INTERPRETED
from tokenyard.engines import Engine, SamplingParams

pytest.importorskip("triton")


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_triton_and_torch_paths_agree(checkpoint_dir, name):
    prompts = random_prompts(4, 3, 40, 512, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        eng = Engine(checkpoint_dir(name), attention_backend=backend, dtype="float32", kv_cache_memory=2 << 20,
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
    prompts = random_prompts(5, 3, 30, 512, seed=21)  # 5 decoders pad up to the size-8 graph
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = {}
    for backend, graphs in (("torch", "off"), ("triton", "padded")):
        eng = Engine(checkpoint_dir("llama"), attention_backend=backend, cuda_graphs=graphs, dtype="float32",
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


def test_gpu_decode_script_dry_run_static_buffer_path_matches_eager():
    """tokenyard/bench/gpu_decode.py (the GPU check's eager-vs-graphs decode) runs end to end on a tiny fp32
    model on the CPU, so the script cannot rot between GPU sessions. Nothing is captured here (no
    GPU): its "cuda graphs" rows run CudaGraphDecoder's static-buffer, padded path eagerly, which
    must give the plain eager path's logits; graph replay itself is checked on a GPU only."""
    if not INTERPRETED:
        pytest.skip("kernels compile for CUDA in this run; tokenyard/bench/gpu_check.sh runs the real decode check here")
    from tokenyard.bench import gpu_decode

    results = gpu_decode.run([1, 3], context=20, steps=2, bandwidth_bytes_per_ms=5e7, dry_run=True)
    assert [(r.batch, r.mode) for r in results] == [(1, "eager"), (1, gpu_decode.UNCAPTURED), (3, "eager"),
                                                     (3, gpu_decode.UNCAPTURED)]
    assert all(r.max_logit_diff < 1e-5 and r.same_tokens and r.tokens_per_s > 0 for r in results)
