import os
import sys
from pathlib import Path

import pytest
import torch

# Tests live in sub-folders by area (tests/engines, tests/gateway, ...); the shared helpers
# (gateway_helpers.py, engine_helpers.py, ...) stay here and are imported by name.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tests.triton_mode  # noqa: F401  first: compiled Triton kernels on CUDA, the interpreter elsewhere

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Engines' cpu_compile "auto" would compile every 20M+ model at start-up: a suite builds dozens of
# short-lived engines, for which compiling costs far more than it saves. The compiled path has its
# own tests (tests/engines/test_compiled_decode.py), which set the variable back to auto or ask for "on".
os.environ.setdefault("TOKENYARD_CPU_COMPILE", "off")
# The prepared-weights cache would make a test's load depend on what earlier tests (or runs) stored
# and write into ~/.cache: off for the suite; tests/engines/test_prepared_cache.py turns it on in
# folders of its own.
os.environ.setdefault("TOKENYARD_WEIGHT_CACHE", "off")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

# Small random checkpoints covering each architecture feature the engine must match.
CHECKPOINTS = {
    "llama": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, rope_scaling=LLAMA3_SCALING),
    "llama_mha": dict(arch="llama", num_attention_heads=4, num_key_value_heads=4, seed=3),
    "mistral": dict(arch="mistral", num_attention_heads=4, num_key_value_heads=1, sliding_window=24, seed=1),
    "qwen2": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, seed=2),
}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    from tokenyard.bench.random_checkpoint import build_random_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            spec = dict(CHECKPOINTS[name])
            arch = spec.pop("arch")
            made[name] = build_random_checkpoint(root / name, arch, **spec)
        return made[name]

    return get
