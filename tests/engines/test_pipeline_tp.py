"""Tensor x pipeline parallelism (tensor_parallel_size=2 x pipeline_parallel_size=2: four gloo
processes on the CPU): the same logits and greedy tokens as one process, on Qwen2 (q/k/v biases,
tied embeddings: the embedding lives on stage 0, the tied LM head on stage 1)."""
from __future__ import annotations

import pytest

from tests.engine_helpers import random_prompts, run_to_completion
from tests.engines.test_tensor_parallel import runner_logits
from tokenyard.engines import Engine, SamplingParams

OPTS = dict(dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=64, progress=False, tp_timeout_s=30.0)
LOGIT_TOL = 1e-4   # relative, as the tensor-parallel parity test


@pytest.mark.timeout(120)
def test_tp2_pp2_matches_single_process(checkpoint_dir):
    path = checkpoint_dir("qwen2")
    prompts = random_prompts(5, 4, 40, 512, seed=51)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    logits, tokens = {}, {}
    for tp, pp in ((1, 1), (2, 2)):
        eng = Engine(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **OPTS)
        try:
            if pp == 2:
                assert eng.runner.layout.world == 4 and len(eng.runner.workers.procs) == 3
            logits[pp] = runner_logits(eng, prompts[0])
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, params)
            tokens[pp] = run_to_completion(eng)
            assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
        finally:
            eng.close()
    err = (logits[2] - logits[1]).abs().max() / logits[1].abs().max()
    assert logits[2].shape == logits[1].shape and err <= LOGIT_TOL, f"relative logit error {err:.2e}"
    assert tokens[2] == tokens[1]
