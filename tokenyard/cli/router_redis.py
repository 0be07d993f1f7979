"""What the `tokenyard router` commands that read Redis share (tokenyard/cli/router.py, router_judge.py):
the --config / --redis-url options, a run against the deployment's Redis, its feedback store."""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any


def redis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="deployment YAML file (default: the packaged tokenyard/deploy/default.yaml)")
    p.add_argument("--redis-url", help="Redis to use (default: REDIS_URL, then the deployment's)")


def with_redis(args: argparse.Namespace, work: Any) -> int:
    """Run `work(client, deployment)` (a coroutine function) against the deployment's Redis."""
    import redis
    import redis.asyncio as aioredis

    from tokenyard.cli.deployment_arg import load_or_exit
    from tokenyard.gateway.store.embedded_redis import command_redis_url
    dep = load_or_exit(args.config)

    async def main(url: str) -> int:
        client = aioredis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
        try:
            return await work(client, dep)
        finally:
            await client.aclose()
    try:
        with command_redis_url(args.redis_url, dep.redis_url, dep.redis_dir) as url:
            return asyncio.run(main(url))
    except (redis.RedisError, OSError) as e:
        print(f"tokenyard router: {e}", file=sys.stderr)
        return 1


def store_of(client: Any, dep: Any) -> Any:
    from tokenyard.gateway.routing.feedback_store import FeedbackStore
    s = dep.router_learning
    return FeedbackStore(client, dep.redis_prefix, s.retention_s, s.max_labels_per_tenant)
