#!/usr/bin/env bash
# Everything a GPU must show, one summary table at the end: kernel parity (fp32/fp16/bf16, int8,
# int4), kernel timings against the HBM roofline, CUDA-graph decode vs eager, tp2 vs tp1 (nccl,
# with 2 GPUs), W2 engine vs transformers. Imports engines/, kernels/ and bench/ only.
#   tokenyard/bench/gpu_check.sh [--out gpu_check.json] [--quick] [--no-engine]
#   tokenyard/bench/gpu_check.sh --dry-run     # the same code on the CPU at toy sizes (runs in `make test`)
cd "$(dirname "$0")/../.." || exit 2
for arg in "$@"; do
  # Triton reads this when its kernels are defined: set before Python starts, never inherited
  # by anything but this process.
  [ "$arg" = --dry-run ] && export TRITON_INTERPRET=1
done
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python}" -m tokenyard.bench.gpu_check "$@"
