"""`tokenyard router judge`: the large engine grades a sample of the small engine's answers to kept
prompts, and each verdict becomes a label (source "judge"), like an external judge's imported file.

    tokenyard router judge --tenant acme --sample 50 --gateway http://127.0.0.1:8000 --key $ADMIN_KEY

For each of up to --sample prompts of the tenant that were kept for feedback (deployment
`router_learning`), routed to the small engine and not labelled yet (chosen at random, --seed), it
asks the gateway, by its ordinary chat API and with the operator's key (so the calls are admitted,
limited and billed as the operator's): the small engine's answer, the large engine's answer, then
the grader (default: the large engine) whether the small answer is as good as the large one, with a
fixed prompt (GRADING) whose reply must start with "yes" or "no". yes -> label 1 (the small engine is
enough), no -> 0; any other reply is counted as unparsed and stores nothing. The kept prompt is the
text the router scored (a conversation's message contents joined by newlines), sent as one user message.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from tokenyard.cli.router_redis import store_of, with_redis

GRADING = ("You grade answers.\n\nQuestion:\n{prompt}\n\nAnswer A:\n{small}\n\nAnswer B:\n{large}\n\n"
           "Is answer A as good as answer B? Reply with one word: yes or no.")
_WORD = re.compile(r"[a-z]+")


def add_judge(sub: Any, redis_args: Any) -> None:
    jd = sub.add_parser("judge", help="the large engine grades a sample of small-engine answers: labels in Redis")
    jd.add_argument("--tenant", required=True, help="whose kept prompts to judge (the labels are this tenant's)")
    jd.add_argument("--sample", type=int, default=20, help="prompts to judge (default: %(default)s)")
    jd.add_argument("--gateway", default="http://127.0.0.1:8000", help="the gateway's base URL")
    jd.add_argument("--key", default=None, help="API key for the calls (default: TOKENYARD_API_KEY)")
    jd.add_argument("--grader", default=None, help="engine that grades (default: the sample's large engine)")
    jd.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each answer")
    jd.add_argument("--seed", type=int, default=0, help="which prompts are drawn")
    redis_args(jd)
    jd.set_defaults(func=run_judge)


def verdict(text: str) -> int | None:
    """1 for a reply whose first word is yes, 0 for no, None otherwise."""
    m = _WORD.search(text.strip().lower()[:40])
    word = m.group(0) if m else ""
    return 1 if word == "yes" else 0 if word == "no" else None


def _chat(base: str, key: str, model: str, content: str, max_tokens: int) -> str:
    # The judge's own calls are never kept for feedback (they are the operator's, not the tenant's traffic).
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0,
                       "metadata": {"tokenyard_learning": "off"}}).encode()
    req = urllib.request.Request(base.rstrip("/") + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["message"]["content"] or ""


def run_judge(args: argparse.Namespace) -> int:
    key = args.key or os.environ.get("TOKENYARD_API_KEY")
    if not key:
        print("tokenyard router judge: give --key or set TOKENYARD_API_KEY", file=sys.stderr)
        return 2
    if args.sample < 1:
        print("tokenyard router judge: --sample must be >= 1", file=sys.stderr)
        return 2
    return with_redis(args, lambda client, dep: _judge(args, key, client, dep))


async def _candidates(client: Any, store: Any, tenant: str, prefix: str) -> list[tuple[str, dict[str, Any]]]:
    from tokenyard.gateway.routing.feedback_store import sample_key
    head = sample_key(prefix, tenant, "")
    labelled = set(await store.labels(tenant))
    out = []
    async for raw in client.scan_iter(match=head.replace("[", "\\[") + "*", count=500):
        name = raw.decode() if isinstance(raw, bytes) else raw
        rid = name[len(head):]
        if rid in labelled:
            continue
        sample = await store.sample(tenant, rid)
        if sample is not None and sample.get("engine") == sample.get("small"):
            out.append((rid, sample))
    return sorted(out)


async def _judge(args: argparse.Namespace, key: str, client: Any, dep: Any) -> int:
    store = store_of(client, dep)
    found = await _candidates(client, store, args.tenant, dep.redis_prefix)
    chosen = random.Random(args.seed).sample(found, min(args.sample, len(found)))
    counts = {"labelled": 0, "unparsed": 0, "failed": 0}
    for rid, s in chosen:
        grader = args.grader or s["large"]
        try:
            small = await asyncio.to_thread(_chat, args.gateway, key, s["small"], s["prompt"], args.max_tokens)
            large = await asyncio.to_thread(_chat, args.gateway, key, s["large"], s["prompt"], args.max_tokens)
            reply = await asyncio.to_thread(_chat, args.gateway, key, grader,
                                            GRADING.format(prompt=s["prompt"], small=small, large=large), 8)
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
            print(f"{rid}: the gateway call failed: {e}", file=sys.stderr)
            counts["failed"] += 1
            continue
        label = verdict(reply)
        if label is None:
            counts["unparsed"] += 1
            continue
        await store.put_label(args.tenant, rid, {
            "prompt": s["prompt"], "prompt_tokens": s["prompt_tokens"], "engine": s["engine"], "small": s["small"],
            "large": s["large"], "router_score": s.get("score"), "label": label, "source": "judge",
            "grader": grader, "time": time.time()})
        counts["labelled"] += 1
    print(f"judged {len(chosen)} of {len(found)} unlabelled small-engine prompts of tenant {args.tenant}: "
          f"{counts['labelled']} labelled, {counts['unparsed']} unparsed verdicts, {counts['failed']} failed calls")
    return 0 if not counts["failed"] else 1
