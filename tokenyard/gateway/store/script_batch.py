"""Calls of one Lua script that arrive while another is on its way go to Redis together (group
commit): one pipeline, one round trip, each call still its own script.

    reserve = ScriptBatch(redis, redis.register_script(text))
    result = await reserve(keys, args)          # as script(keys=keys, args=args)

Why: at 32 clients the rate limit's reservation was a round trip per request (a connection taken
from the pool and given back, a send, a wake-up, a reply parsed alone). Redis runs a pipeline's
scripts one after another, each atomically, so a limit stays exactly as exact; only the sends are
shared.

The rules:
* Nothing on its way: the call goes alone, at once (one client pays nothing for this).
* Otherwise it waits for the call or batch on its way to come back, then goes with every call
  that arrived meanwhile (at most `max_batch`), in arrival order: one batch in flight at a time.
* A whole pipeline's failure (connection, timeout) reaches every call in it, as each call alone
  would have failed; a call's own error reaches that call only; NOSCRIPT (a restarted server)
  loads the script and runs those calls, and only those, again.
* A caller cancelled while it waits is left out of the batch (its script never runs).

Who touches what: the event loop thread only.
"""
from __future__ import annotations

import asyncio
from typing import Any

from redis.exceptions import NoScriptError


class ScriptBatch:
    def __init__(self, redis: Any, script: Any, max_batch: int = 64) -> None:
        self.redis = redis
        self.script = script                    # redis-py's registered script (its sha and text)
        self.max_batch = max_batch
        self._busy = False                      # a call or a batch is on its way
        self._waiting: list[tuple[list[Any], list[Any], asyncio.Future]] = []
        self._sender: asyncio.Task | None = None
        self.batches = 0                        # batches sent (tests, and what the bench reports)

    async def __call__(self, keys: list[Any], args: list[Any]) -> Any:
        if not self._busy:
            self._busy = True
            try:
                return await self.script(keys=keys, args=args)
            finally:
                self._busy = False
                self._send_waiting()
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((keys, args, fut))
        return await fut

    def _send_waiting(self) -> None:
        if self._busy or not self._waiting:
            return
        self._busy = True
        batch, self._waiting = self._waiting[:self.max_batch], self._waiting[self.max_batch:]
        self._sender = asyncio.get_running_loop().create_task(self._send(batch))

    async def _send(self, batch: list[tuple[list[Any], list[Any], asyncio.Future]]) -> None:
        try:
            live = [c for c in batch if not c[2].done()]      # a cancelled caller's script is not run
            if live:
                self.batches += 1
                try:
                    results = await self._run(live)
                    missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
                    if missing:
                        await self.redis.script_load(self.script.script)
                        for i, r in zip(missing, await self._run([live[i] for i in missing])):
                            results[i] = r
                except BaseException as e:              # the whole pipeline failed: every call did
                    for _, _, fut in live:
                        if not fut.done():
                            fut.set_exception(e if isinstance(e, Exception) else ConnectionError(repr(e)))
                    if not isinstance(e, Exception):
                        raise
                else:
                    for (_, _, fut), r in zip(live, results):
                        if fut.done():
                            continue
                        if isinstance(r, Exception):
                            fut.set_exception(r)
                        else:
                            fut.set_result(r)
        finally:
            self._busy = False
            self._send_waiting()

    async def _run(self, calls: list[tuple[list[Any], list[Any], asyncio.Future]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        sha = self.script.sha
        for keys, args, _ in calls:
            pipe.evalsha(sha, len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)
