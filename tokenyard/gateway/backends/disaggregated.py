"""Disaggregated serving: a request's prompt runs on a prefill replica, its KV blocks move to a
decode replica, which streams the tokens (docs/kv_transfer.md, "Disaggregated serving").

    engines.NAME.replicas: [{url: ..., role: prefill}, {url: ..., role: decode}, ...]

A pool whose replicas include a prefill and a decode one is a DisaggregatedPool: a ReplicaPool
(the same health checks, ejection, choice, metrics and sleep control over all its replicas) whose
requests take this path:

1. choose a decode replica (role decode; role both only when none is routable: colocated),
2. POST the prompt to a prefill replica's /v1/engine/prefill naming that decode replica and the
   transport (`disaggregation.kv_transport`: shm when both URLs name one host, else TCP to the
   decode replica's KV receiver); the prefill replica runs the prompt, exports its full blocks and
   hands them over (engines/serving/kv_handover.py),
3. send the request to the decode replica (with the shm handle), which imports the blocks into its
   prefix cache, hits them, computes the prompt's tail (< one block) and streams every token.

Failures before the first token are retried, never hung on:
- a prefill replica that fails (refused, killed mid-request, 503, over prefill_timeout_s) is
  counted against its health and the next one is tried, up to max_prefill_attempts; after that the
  decode replica computes the whole prompt itself (colocated fallback);
- a decode replica that fails before its first token (killed, refused the KV, no output within
  first_token_timeout_s) is counted against its health and another decode replica is chosen (the
  prefill replica's blocks are still cached: the second hand-over is an export, not a prefill), up
  to replica_pool.max_attempts decode replicas; then the client gets an error, at once.
Once a token was streamed nothing is retried, as in every replica pool.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlparse

from tokenyard.engines.core.errors import EngineDeadError
from tokenyard.engines.core.outputs import StepOutput
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.runtime.async_engine import RequestStream
from tokenyard.gateway.backends.remote_engine import RemoteEngine
from tokenyard.gateway.backends.replica_pool import Replica, ReplicaPool
from tokenyard.gateway.config.disagg_config import DisaggConfig
from tokenyard.gateway.config.replica_config import PoolConfig

log = logging.getLogger("tokenyard.disaggregated")


@dataclass(slots=True)
class Handover:
    """What step 2 gave: decode_failed (the decode replica refused the KV: try another), else the shm
    handle (None over TCP or without a hand-over) and the prefill reply (None: colocated fallback)."""
    decode_failed: str | None = None     # why the decode side refused the KV (transfer stage)
    handle: str | None = None            # shm payload for the decode replica's generate request
    doc: dict[str, Any] | None = None    # the prefill replica's reply (None: fallback, no hand-over)


class Flow:
    """One request's way through the pool; its outputs go to `out`, whichever replicas serve it."""

    def __init__(self, request_id: str, call: tuple) -> None:
        self.request_id = request_id
        self.call = call                    # (prompt ids, params, priority, salt)
        self.out = RequestStream(request_id)
        self.replica: Replica | None = None  # the decode replica streaming now
        self.delivered = False
        self.task: asyncio.Task | None = None
        self.handover: dict[str, Any] | None = None   # the prefill replica's reply, for tests and logs


class DisaggregatedPool(ReplicaPool):
    def __init__(self, name: str, replicas: list[Replica], roles: dict[Replica, str], cfg: PoolConfig,
                 dcfg: DisaggConfig, model_fingerprint: str = "") -> None:
        super().__init__(name, replicas, cfg, model_fingerprint)
        self.roles = roles
        self.dcfg = dcfg
        self._flows: dict[str, Flow] = {}
        self.handovers = 0             # requests whose KV came from a prefill replica
        self.colocated = 0             # requests a decode (or both) replica computed whole
        self.prefill_failures = 0      # prefill attempts that failed (then retried or fell back)
        self.decode_retries = 0        # requests moved to another decode replica before their first token

    @property
    def num_in_flight(self) -> int:
        return len(self._flows)

    # -- choice -------------------------------------------------------------------------------
    def _pick(self, role: str, ids: list[int], salt: str | None, tried: list[Replica]) -> Replica | None:
        """The best routable replica of this role not tried yet. A replica whose own stats say another
        role (started with another --role than the deployment lists) is never used for this one."""
        exclude = [r for r in self.replicas
                   if self.roles[r] != role or r in tried or getattr(r.engine, "info", {}).get("role", role) != role]
        if len(exclude) == len(self.replicas):
            return None
        return self.choose(ids, salt, exclude)

    def _transport(self, pre: Replica, dec: Replica) -> str:
        if self.dcfg.kv_transport != "auto":
            return self.dcfg.kv_transport
        return "shm" if urlparse(pre.label).hostname == urlparse(dec.label).hostname else "tcp"

    # -- the AsyncEngine interface ------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | dict | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        if self.dead is not None:
            raise EngineDeadError(f"engine {self.name}: {self.dead}")
        flow = Flow(request_id, (list(prompt_token_ids), params, priority, cache_salt))
        self._flows[request_id] = flow
        flow.task = asyncio.get_running_loop().create_task(self._run(flow), name=f"disagg-{request_id}")
        return flow.out

    def abort(self, request_id: str) -> None:
        flow = self._flows.pop(request_id, None)
        if flow is None:
            return
        if flow.task is not None:
            flow.task.cancel()
        if flow.replica is not None:
            flow.replica.engine.abort(request_id)
        flow.out.put(StepOutput(request_id, [], finished=True, finish_reason="abort"))

    async def stop(self) -> None:
        for rid in list(self._flows):
            self.abort(rid)
        await super().stop()

    # -- one request --------------------------------------------------------------------------
    async def _run(self, flow: Flow) -> None:
        rid = flow.request_id
        ids, params, priority, salt = flow.call
        tried: list[Replica] = []
        why = "no routable decode replica"
        try:
            while len(tried) < self.cfg.max_attempts:
                dec = self._pick("decode", ids, salt, tried) or self._pick("both", ids, salt, tried)
                if dec is None:
                    break
                tried.append(dec)
                hand = Handover()
                if self.roles[dec] == "decode" and len(ids) >= self.dcfg.min_prompt_tokens:
                    hand = await self._prefill(flow, dec)
                    if hand.decode_failed is not None:
                        why = hand.decode_failed
                        self._failed(dec, why)
                        self.decode_retries += 1
                        continue
                self.handovers += hand.doc is not None
                self.colocated += hand.doc is None
                try:
                    inner = (dec.engine.add_request(rid, ids, params, priority, salt) if hand.handle is None
                             else dec.engine.add_handed_over(rid, ids, params, priority, salt, hand.handle))
                except EngineDeadError as e:
                    why = str(e)
                    continue
                flow.replica = dec
                why = await self._forward(flow, dec, inner)
                if not why:
                    return
                flow.replica = None
                dec.retries_from += 1
                self.decode_retries += 1
                self.retries += 1
                log.info("engine %s: request %s moves to another decode replica (%s failed before its first "
                         "token: %s)", self.name, rid, dec.label, why)
            self._end(flow, StepOutput(rid, [], finished=True, finish_reason="error",
                                       error=f"engine {self.name}: no replica served the request ({why})"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the client must get an end, never a hang
            log.exception("engine %s: request %s failed in the disaggregated flow", self.name, rid)
            self._end(flow, StepOutput(rid, [], finished=True, finish_reason="error",
                                       error=f"engine {self.name}: {type(e).__name__}: {e}"))

    def _end(self, flow: Flow, out: StepOutput) -> None:
        if self._flows.get(flow.request_id) is flow:
            del self._flows[flow.request_id]
            flow.out.put(out)

    async def _prefill(self, flow: Flow, dec: Replica) -> Handover:
        """Step 2 with up to max_prefill_attempts prefill replicas; Handover() (no KV) when none did it."""
        ids, _, _, salt = flow.call
        tried: list[Replica] = []
        while len(tried) < self.dcfg.max_prefill_attempts:
            pre = self._pick("prefill", ids, salt, tried)
            if pre is None:
                break
            tried.append(pre)
            transport = self._transport(pre, dec)
            body: dict[str, Any] = {"request_id": flow.request_id, "prompt_token_ids": ids, "cache_salt": salt,
                                    "transport": transport, "timeout_s": self.dcfg.prefill_timeout_s}
            if transport == "tcp":
                port = dec.engine.info.get("kv_port")
                if not port:
                    return Handover(decode_failed=f"decode replica {dec.label} advertises no KV port")
                body.update(kv_host=urlparse(dec.label).hostname, kv_port=int(port))
            status, doc = await pre.engine.control("prefill", body, self.dcfg.prefill_timeout_s)
            if status == 200:
                flow.handover = doc
                return Handover(handle=doc.get("handle"), doc=doc)
            self.prefill_failures += 1
            if status == 502 and doc.get("stage") == "transfer":
                return Handover(decode_failed=str(doc.get("error")))
            if status == 0:             # unreachable, killed mid-request, or over the timeout
                self._failed(pre, str(doc.get("error")))
            log.warning("engine %s: prefill of %s on %s failed (%s: %s)", self.name, flow.request_id, pre.label,
                        status, doc.get("error"))
            if status == 400:           # the prompt itself: the decode replica gives the client the reason
                break
        log.warning("engine %s: request %s is prefilled on decode replica %s (no prefill replica did it)",
                    self.name, flow.request_id, dec.label)
        return Handover()

    async def _forward(self, flow: Flow, dec: Replica, inner: RequestStream) -> str:
        """Pass the decode replica's outputs on; '' when the request ended (finished or a final error),
        else why it failed before its first token (the caller retries)."""
        while True:
            try:
                if flow.delivered:
                    out = await inner.get()
                else:
                    out = await asyncio.wait_for(inner.get(), self.dcfg.first_token_timeout_s)
            except asyncio.TimeoutError:
                dec.engine.abort(flow.request_id)
                why = f"no output within first_token_timeout_s ({self.dcfg.first_token_timeout_s:g} s)"
                self._failed(dec, why)
                return why
            if (out.finish_reason == "error" and not flow.delivered and getattr(inner, "retryable", False)):
                return out.error or "error"
            if out.new_token_ids:
                flow.delivered = True
            if out.finished:
                self._end(flow, out)
                return ""
            flow.out.put(out)


def build_disaggregated(name: str, spec: Any, build_local: Callable[[Any], Any],
                        model_fingerprint: str = "") -> DisaggregatedPool:
    """A DisaggregatedPool for an EngineSpec whose replicas have roles (replica_config.ReplicaSet)."""
    from tokenyard.engines.runtime.async_engine import AsyncEngine
    cfg = spec.replicas.pool
    members: list[Replica] = []
    roles: dict[Replica, str] = {}
    for rs in spec.replicas.replicas:
        if rs.local:     # an in-process replica is a full engine: the colocated fallback
            r = Replica("local", AsyncEngine(build_local(spec), name), cfg, remote=False)
        else:
            eng = RemoteEngine(rs.url, name, connect_timeout_s=cfg.connect_timeout_s,
                               stats_interval_s=cfg.stats_interval_s, health_timeout_s=cfg.health_timeout_s,
                               max_model_len=cfg.max_model_len or 4096)
            r = Replica(rs.url, eng, cfg, remote=True)
        members.append(r)
        roles[r] = rs.role
    return DisaggregatedPool(name, members, roles, cfg, spec.replicas.disagg, model_fingerprint)
