#!/usr/bin/env bash
# One command for a GPU box: kernel correctness + timings. Args pass through (e.g. --out x.json).
cd "$(dirname "$0")/.." && PYTHONPATH=. exec "${PYTHON:-python}" -m bench.gpu_check "$@"
