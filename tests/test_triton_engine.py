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
