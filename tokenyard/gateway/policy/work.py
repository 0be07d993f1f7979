"""CPU-heavy policy work (validate, hash, diff, simulate) off the event loop, with a time limit.

    policy = await off_loop(check_document, text, engines)

Validation of a document is linear in its size (aliases are refused before they expand, diffs
are bounded), but a 1 MB document or a replay of 100,000 recorded requests is still seconds of
Python: run on the loop, that is seconds in which /health, streams and every other request wait.
So the admin API and the operator page hand such work to one worker thread and wait for it at
most `POLICY_WORK_TIMEOUT_S`; past that the caller gets a 503 (retry later, or send less) and
the loop never stalls. One worker: admin work is rare, and a second document waits behind the
first rather than doubling the CPU taken from serving. A thread cannot be stopped, so work that
ran past its limit finishes in the background and its result is dropped.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from tokenyard.gateway.edge.errors import Unavailable

T = TypeVar("T")

POLICY_WORK_TIMEOUT_S = 20.0
_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-work")


async def off_loop(fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
    loop = asyncio.get_running_loop()
    limit = POLICY_WORK_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return await asyncio.wait_for(loop.run_in_executor(_WORKER, lambda: fn(*args)), limit)
    except asyncio.TimeoutError:
        raise Unavailable(f"Checking this policy took longer than {limit:g} s; send a smaller document or "
                          "retry when the gateway is less busy", code="policy_work_timeout",
                          headers={"retry-after": "5"}) from None
