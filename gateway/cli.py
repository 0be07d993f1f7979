"""The `tokenyard` command.

    tokenyard serve      until the HTTP gateway lands (issue 9): an offline demo of the engine
    tokenyard generate   stream one completion from a checkpoint to the terminal
    tokenyard demo       train / eval / plot the demo model pair
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEMO_LARGE = Path(__file__).resolve().parent.parent / "models" / "demo-large"


def _serve(args: argparse.Namespace) -> int:
    # Interim demo until the gateway exists: task-suite chats through the continuous-batching
    # engine on the committed demo model, with throughput and accuracy printed.
    from engines import LLM, SamplingParams

    from demo import task_suite

    model_dir = args.model or str(DEMO_LARGE)
    print(f"tokenyard: the HTTP gateway is not built yet; running an offline chat demo on {model_dir}")
    llm = LLM(model_dir, kv_cache_memory=256 << 20)
    items = task_suite.generate_items("test", args.requests, seed=1)
    t0 = time.perf_counter()
    outs = llm.chat([list(it.messages) for it in items], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    right = sum(it.check(o.outputs[0].text) for it, o in zip(items, outs))
    for it, o in list(zip(items, outs))[:8]:
        print(f"  {it.messages[-1]['content']!r} -> {o.outputs[0].text!r}")
    print(f"{len(outs)} requests, {tokens} output tokens in {dt:.2f} s ({tokens / dt:.0f} tokens/s), "
          f"{right}/{len(outs)} answers right")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenyard", description="Tokenyard: an LLM serving gateway")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start Tokenyard (for now: an offline engine demo)")
    serve.add_argument("--model", help="a Hugging Face checkpoint folder (default: models/demo-large)")
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
