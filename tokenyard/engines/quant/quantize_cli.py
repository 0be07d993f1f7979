"""`tokenyard quantize`: write a weight-only quantised copy of a checkpoint folder.

    tokenyard quantize --model DIR --mode int8|int4 [--group-size 128] [--no-lm-head] --out DIR

The output is device-neutral (tokenyard/engines/quant/quantization.py describes the format) and loads in any
engine as it is: `Engine(out_dir)` detects it from config.json and repacks for its backend.
"""
from __future__ import annotations

import argparse
import sys
import time

from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.quant.quantization import LM_HEAD_DEFAULT, save_quantized


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint folder to quantise")
    ap.add_argument("--mode", required=True, choices=("int8", "int4"),
                    help="int8: symmetric per output channel; int4: asymmetric per group along K")
    ap.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128), help="int4 group size (default 128)")
    ap.add_argument("--lm-head", action=argparse.BooleanOptionalAction, default=LM_HEAD_DEFAULT,
                    help=f"quantise the LM head too (default: {'yes' if LM_HEAD_DEFAULT else 'no'})")
    ap.add_argument("--out", required=True, help="output folder (created)")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        out = save_quantized(args.model, args.out, args.mode, args.group_size, lm_head=args.lm_head)
    except (ValueError, CheckpointError) as e:
        print(f"tokenyard quantize: {e}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({args.mode}{f', group {args.group_size}' if args.mode == 'int4' else ''}, "
          f"{size / 2**20:.1f} MiB of weights) in {time.perf_counter() - t0:.1f} s")
    return 0
