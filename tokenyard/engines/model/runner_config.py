"""What a ModelRunner is built with: the decode paths the engine asked for (EngineConfig's knobs,
resolved per engine) and the sizes they are built for."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RunnerConfig:
    """ModelRunner's settings. The defaults are the plain eager runner that draft models and
    tensor-parallel workers use: torch attention, no CUDA graphs, no compiled or C decode step."""

    block_size: int
    attention_backend: str = "torch"    # resolved against the device by attention.resolve_backend
    cuda_graphs: str = "off"            # auto | on | off (EngineConfig.cuda_graphs)
    max_model_len: int = 0              # sizes the graphs' and C step's block tables
    cuda_graph_max_batch: int = 0       # largest batch the CUDA graphs capture
    cpu_compile: str = "off"            # auto | on | off; TOKENYARD_CPU_COMPILE replaces auto
    max_num_seqs: int = 0               # largest batch the scheduler forms (0: unknown)
    cpu_decode_step: str = "off"        # auto | on | off; TOKENYARD_CPU_DECODE_STEP replaces auto
    cpu_decode_step_max_batch: int = 0  # 0: auto (see model_runner.NATIVE_MAX_BATCH_*)
    activation_quant: str = "auto"      # auto | on | off: the C step's int8 inputs (EngineConfig.activation_quant)
    cpu_onednn_linear: str = "off"      # auto | on | off; TOKENYARD_CPU_ONEDNN_LINEAR replaces auto
