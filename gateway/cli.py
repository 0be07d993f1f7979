"""The `tokenyard` command.

    tokenyard serve      until the HTTP gateway lands (issue 9): an offline demo of the engine
    tokenyard generate   stream one completion from a checkpoint to the terminal
    tokenyard demo       train / eval / plot the demo model pair
"""
from __future__ import annotations

import argparse
import sys
import time


def _serve(args: argparse.Namespace) -> int:
    # Interim demo: a random-weight Llama generated once into .tokenyard/, then a batch of
    # requests through the continuous-batching engine, with throughput printed.
    from bench.random_checkpoint import build_random_checkpoint
    from engines import LLM, SamplingParams

    model_dir = args.model or build_random_checkpoint(".tokenyard/demo-llama", "llama", hidden_size=256,
                                                      intermediate_size=768, num_hidden_layers=4,
                                                      num_attention_heads=8, num_key_value_heads=2,
                                                      vocab_size=4096)
    print(f"tokenyard: the HTTP gateway is not built yet; running an offline engine demo on {model_dir}")
    llm = LLM(model_dir, kv_cache_memory=256 << 20)
    import random
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 128))] for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests, {tokens} output tokens in {dt:.2f} s: {tokens / dt:.0f} tokens/s")
    print(f"first request's output ids: {outs[0].outputs[0].token_ids[:16]} ...")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenyard", description="Tokenyard: an LLM serving gateway")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start Tokenyard (for now: an offline engine demo)")
    serve.add_argument("--model", help="a Hugging Face checkpoint folder (default: a random demo Llama)")
    serve.add_argument("--requests", type=int, default=32)
    serve.add_argument("--max-tokens", type=int, default=32)
    serve.set_defaults(func=_serve)
    from engines import generate_cli
    gen = sub.add_parser("generate", help="stream a completion from a checkpoint to the terminal")
    generate_cli.add_arguments(gen)
    gen.set_defaults(func=generate_cli.run)
    from demo import cli as demo_cli
    demo = sub.add_parser("demo", help="train, evaluate and plot the demo model pair")
    demo_cli.add_arguments(demo)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
