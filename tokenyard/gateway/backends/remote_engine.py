"""A remote engine replica (`tokenyard engine serve`) behind the same interface as AsyncEngine.

    engine = RemoteEngine("http://10.0.0.7:9000", name="demo-large"); await engine.start()
    stream = engine.add_request(rid, prompt_ids, params, priority=0, cache_salt=tenant)
    async for out in stream: ...          # StepOutput, the last one finished
    engine.abort(rid)                     # the replica frees the request's blocks at its next step

add_request() returns at once, like AsyncEngine's: a task posts the request and feeds the
replica's NDJSON lines into the stream. All requests share one aiohttp session (keep-alive
connections to the replica). A transport failure (refused, reset, timed out, the stream cut)
ends the stream with an "error" output, and the stream says whether the failure is
`retryable`: the replica did not send a token for it (or answered 503, e.g. draining), so the
pool may run it elsewhere without the client seeing a thing. A bad request (400) is not
retryable. Stats are polled every `stats_interval_s` and served from that cache.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, fields
from typing import Any, Callable

import aiohttp

from tokenyard.engines.core.errors import EngineDeadError
from tokenyard.engines.core.outputs import EngineStats, StepOutput
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.runtime.async_engine import RequestStream

log = logging.getLogger("tokenyard.remote_engine")

_STATS_FIELDS = {f.name for f in fields(EngineStats)}
_OUTPUT_FIELDS = {f.name for f in fields(StepOutput)}
ABORT_GRACE_S = 2.0          # after an abort, how long the stream may take to end before it is cut


def empty_stats(max_num_seqs: int = 1, block_size: int = 16) -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0, num_free_blocks=0, num_total_blocks=0, kv_usage=0.0,
                       block_size=block_size, num_preemptions=0, prefix_cache_hit_rate=0.0, prefix_cache_hit_tokens=0,
                       num_steps=0, last_step_tokens=0, last_step_seconds=0.0, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=0)


class RemoteStream(RequestStream):
    """A RequestStream that also knows whether a token came (after one, a failure is never retried)."""

    __slots__ = ("got_tokens",)

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.got_tokens = False


class RemoteEngine:
    def __init__(self, url: str, name: str = "engine", *, connect_timeout_s: float = 2.0,
                 stats_interval_s: float = 0.25, health_timeout_s: float = 1.0, max_model_len: int = 4096) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self.connect_timeout_s = connect_timeout_s
        self.stats_interval_s = stats_interval_s
        self.health_timeout_s = health_timeout_s
        self._fallback_max_model_len = max_model_len
        self.info: dict[str, Any] = {}          # the replica's latest stats document
        self._stats = empty_stats()
        self.dead: str | None = None            # the pool decides health; a remote engine is never "dead"
        self.on_failure: Callable[[str], None] | None = None   # told about transport failures
        self._session: aiohttp.ClientSession | None = None
        self._streams: dict[str, RemoteStream] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._poller: asyncio.Task | None = None

    # -- the AsyncEngine interface ------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return int(self.info.get("max_model_len") or self._fallback_max_model_len)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_failed_steps(self) -> int:
        return int(self.info.get("failed_steps", 0))

    def stats(self) -> EngineStats:
        return self._stats

    async def start(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
            await self.refresh_stats()
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name=f"stats-{self.url}")

    async def stop(self) -> None:
        for rid in list(self._streams):
            self.abort(rid)
        tasks = list(self._tasks.values()) + ([self._poller] if self._poller else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._poller = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | dict | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> RemoteStream:
        return self.add_handed_over(request_id, prompt_token_ids, params, priority, cache_salt, None)

    def add_handed_over(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | dict | None,
                        priority: int, cache_salt: str | None, kv_handle: str | None) -> RemoteStream:
        """add_request for a decode replica: kv_handle is a shared-memory KV payload a prefill replica made
        for this prompt (disaggregated.py), which the replica imports first (None: nothing to import)."""
        if self._session is None:
            raise EngineDeadError(f"replica {self.url} of engine {self.name} is not started")
        if isinstance(params, SamplingParams):
            params = asdict(params)
        body = {"request_id": request_id, "prompt_token_ids": list(prompt_token_ids), "params": params or {},
                "priority": priority, "cache_salt": cache_salt}
        if kv_handle is not None:
            body["kv_handle"] = kv_handle
        stream = RemoteStream(request_id)
        self._streams[request_id] = stream
        self._tasks[request_id] = asyncio.get_running_loop().create_task(self._run(request_id, body, stream))
        return stream

    def abort(self, request_id: str) -> None:
        """End the stream with an "abort" output now; tell the replica (which frees the blocks)."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.put(StepOutput(request_id, [], finished=True, finish_reason="abort"))
        task = self._tasks.get(request_id)
        if task is not None and not task.done():
            asyncio.get_running_loop().create_task(self._send_abort(request_id, task))

    # -- health and stats ---------------------------------------------------------------------
    async def check_health(self) -> tuple[bool, bool]:
        """(alive, ready) from GET /health."""
        if self._session is None:
            return False, False
        try:
            async with self._session.get(self.url + "/health",
                                         timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as resp:
                body = await resp.json(content_type=None)
                return resp.status == 200 and body.get("status") == "ok", bool(body.get("ready"))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            return False, False

    async def refresh_stats(self) -> bool:
        if self._session is None:
            return False
        try:
            async with self._session.get(self.url + "/v1/engine/stats",
                                         timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as resp:
                if resp.status != 200:
                    return False
                doc = await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            return False
        self.info = doc
        self._stats = EngineStats(**{k: v for k, v in doc.items() if k in _STATS_FIELDS})
        return True

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            await self.refresh_stats()

    # -- sleep and wake (tokenyard/engines/serving/replica_server.py) ---------------------------
    @property
    def sleep_state(self) -> str:
        """As the replica last reported it: "awake", "asleep" or "waking"."""
        return str(self.info.get("sleep_state") or "awake")

    @property
    def sleep_level(self) -> int:
        return int(self.info.get("sleep_level") or 0)

    async def control(self, action: str, body: dict[str, Any], timeout_s: float) -> tuple[int, dict[str, Any]]:
        """POST /v1/engine/{action} (sleep, wake): (status, its JSON document); status 0 when the
        replica could not be reached or did not answer in timeout_s. The cached state follows a
        good answer at once, without waiting for the next stats poll."""
        if self._session is None:
            return 0, {"error": f"replica {self.url} is not started"}
        try:
            async with self._session.post(f"{self.url}/v1/engine/{action}", json=body,
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                doc = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
            return 0, {"error": f"replica {self.url} failed: {type(e).__name__}: {e}"}
        if not isinstance(doc, dict):
            doc = {"error": str(doc)[:200]}
        if status == 200:
            self.info.update({k: doc[k] for k in ("sleep_level", "sleep_state") if k in doc})
        return status, doc

    # -- one request --------------------------------------------------------------------------
    async def _run(self, rid: str, body: dict[str, Any], stream: RemoteStream) -> None:
        finished = False
        try:
            async with self._session.post(self.url + "/v1/engine/generate", json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    try:
                        doc = json.loads(text)
                    except ValueError:
                        doc = {"error": text[:200]}
                    if resp.status == 400:   # the request's own fault: the client gets a 400, never a retry
                        self._reject(rid, stream, str(doc.get("error")), doc.get("kind"), doc.get("param"),
                                     doc.get("code"))
                        return
                    self._fail(rid, stream, f"replica answered {resp.status}: {doc.get('error')}",
                               retryable=resp.status == 503 or bool(doc.get("retryable")), transport=False)
                    return
                async for line in resp.content:
                    if not line.strip():
                        continue
                    out = StepOutput(**{k: v for k, v in json.loads(line).items() if k in _OUTPUT_FIELDS})
                    if out.new_token_ids:
                        stream.got_tokens = True
                    if out.finished:
                        finished = True
                    if self._streams.get(rid) is stream:
                        if out.finished:
                            del self._streams[rid]
                        stream.put(out)
                    if finished:
                        return
            self._fail(rid, stream, "the replica closed the stream early", retryable=not stream.got_tokens)
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, TypeError) as e:
            self._fail(rid, stream, f"replica {self.url} failed: {type(e).__name__}: {e}",
                       retryable=not stream.got_tokens)
        finally:
            self._tasks.pop(rid, None)

    def _reject(self, rid: str, stream: RemoteStream, message: str, kind: str | None, param: str | None,
                code: str | None) -> None:
        if self._streams.get(rid) is not stream:
            return
        del self._streams[rid]
        stream.retryable = False
        stream.put(StepOutput(rid, [], finished=True, finish_reason="error", error=message, bad_request=True,
                              error_param="grammar" if kind == "grammar" else param, error_code=code))

    def _fail(self, rid: str, stream: RemoteStream, message: str, retryable: bool, transport: bool = True) -> None:
        if transport and self.on_failure is not None:
            self.on_failure(message)
        if self._streams.get(rid) is not stream:
            return                                   # aborted: nobody is listening
        del self._streams[rid]
        stream.retryable = retryable
        stream.put(StepOutput(rid, [], finished=True, finish_reason="error", error=message))

    async def _send_abort(self, rid: str, task: asyncio.Task) -> None:
        try:
            async with self._session.post(self.url + "/v1/engine/abort", json={"request_id": rid},
                                          timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as resp:
                await resp.read()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass
        # The replica ends the stream with its "abort" line (the connection stays reusable); a
        # stream that does not end soon is cut, which the replica also reads as an abort.
        done, _ = await asyncio.wait([task], timeout=ABORT_GRACE_S)
        if not done:
            task.cancel()
