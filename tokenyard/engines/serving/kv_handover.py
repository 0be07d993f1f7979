"""The replica side of disaggregated serving (docs/kv_transfer.md, "Disaggregated serving").

An engine replica has a role: `prefill`, `decode` or `both` (the default: today's engine, which
does either). The gateway (tokenyard/gateway/backends/disaggregated.py) sends a request's prompt to
a prefill replica's POST /v1/engine/prefill with the decode replica it chose; the prefill replica

1. runs the prompt as a request of its own (max_tokens 1, greedy, seed 0: its prefill stops at the
   cacheable boundary and computes the tail apart, scheduler._chunk_len, so the blocks' bytes are
   those any seeded engine computes for that prefix),
2. exports the prompt's full blocks through the KV connector (digests, CRCs, layout),
3. hands them to the decode replica: on one host through shared memory (the handle goes back to
   the gateway, which passes it in the decode replica's generate request), otherwise over TCP to
   the decode replica's KV receiver (KVReceiver on `kv_port`, advertised in its stats document),
   which imports them before the prefill replica answers.

The decode replica imports the blocks (registered in its prefix cache), then admits the request,
which hits them: it computes only the prompt's tail after the last full block (1 to block_size
tokens) and samples the first token itself. Recomputing that short tail instead of taking the
prefill side's token keeps every sampling state (seed, penalties, logprobs, grammars) on one engine,
so a handed-over request's tokens are those of one engine, and nothing streams before the decode
replica has the request (a retry before the first token is always safe).

Export and import run on the engine's step executor between steps, like step() itself.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tokenyard.engines.core.errors import HandoverError  # noqa: F401 - raised here, re-exported
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.kv_transfer.block_payload import BlockPayload
from tokenyard.engines.kv_transfer.connector import KVConnector
from tokenyard.engines.kv_transfer.shm_transport import ShmTransport
from tokenyard.engines.kv_transfer.tcp_transport import KVReceiver, TransferError, send_payload

log = logging.getLogger("tokenyard.kv_handover")

ROLES = ("prefill", "decode", "both")
TRANSPORTS = ("shm", "tcp")
# The prefill request: one greedy token; seed set so its prefill splits at the cacheable boundary
# exactly as a seeded request's does on any engine (the exported bytes then match a colocated run's).
PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, seed=0)
# An import goes into the pool this many bytes of blocks per step-thread call (16 MiB: about 20 ms of
# copying on a 2-core VM), so decode steps of the running requests interleave with a long one.
IMPORT_CHUNK_BYTES = 16 << 20


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return role


class KVHandover:
    """Export (prefill role) and import (decode role) of one replica's AsyncEngine."""

    def __init__(self, engine: Any, role: str = "both", shm_dir: str | None = None) -> None:
        self.engine = engine                  # AsyncEngine over a single-process tokenyard Engine
        self.role = check_role(role)
        self.shm = ShmTransport(shm_dir)
        self.receiver: KVReceiver | None = None
        # Counters for the stats document (what the gateway and tests read).
        self.num_exported = 0                 # prefill requests handed over
        self.num_imported_blocks = 0
        self.num_present_blocks = 0           # offered but already cached here
        self.num_import_failures = 0          # payloads not imported (bad frame, layout, timeout)
        self.num_prefills_cancelled = 0       # prefills aborted before their end (the gateway went away)

    # -- both sides ---------------------------------------------------------------------------
    def _connector(self) -> KVConnector:
        """A connector over the engine core and cache tensors in place now: made per hand-over, since a
        restart replaces the core and a wake from sleep level 1 allocates the cache tensors again."""
        return KVConnector(self.engine.engine)

    async def _on_step_thread(self, fn, *args):
        # The AsyncEngine's step executor: the call runs between two steps, never during one.
        return await asyncio.get_running_loop().run_in_executor(self.engine._executor, fn, *args)

    def check_engine(self) -> None:
        """ValueError when this engine cannot hand KV over (tensor/pipeline parallel, no prefix cache, mock)."""
        core = getattr(self.engine, "engine", None)
        if core is None or not hasattr(core, "blocks"):
            raise ValueError(f"role {self.role} needs a torch engine in this process (not a mock, not "
                             f"server.engine_process)")
        KVConnector(core)

    def stats(self) -> dict[str, Any]:
        return {"role": self.role, "kv_port": self.receiver.port if self.receiver is not None else None,
                "kv_exported": self.num_exported, "kv_imported_blocks": self.num_imported_blocks,
                "kv_present_blocks": self.num_present_blocks, "kv_import_failures": self.num_import_failures,
                "kv_prefills_cancelled": self.num_prefills_cancelled}

    # -- prefill side -------------------------------------------------------------------------
    async def prefill(self, request_id: str, prompt_ids: list[int], cache_salt: str | None, transport: str,
                      kv_host: str | None = None, kv_port: int | None = None,
                      timeout_s: float = 60.0) -> dict[str, Any]:
        """Run the prompt, export its blocks and hand them over; the reply document for the gateway.
        RequestError/ValueError for a bad prompt (from add_request), HandoverError otherwise."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if transport == "tcp" and (not kv_host or not isinstance(kv_port, int)):
            raise ValueError("transport tcp needs kv_host and kv_port (the decode replica's KV receiver)")
        t0 = time.perf_counter()
        rid = f"{request_id}:prefill"
        stream = self.engine.add_request(rid, prompt_ids, PREFILL_PARAMS, cache_salt=cache_salt)
        try:
            while True:
                out = await stream.get()
                if out.finished:
                    break
        finally:
            if not stream.finished:      # cancelled (the gateway went away): free the blocks
                self.num_prefills_cancelled += 1
                self.engine.abort(rid)
        if out.finish_reason in ("error", "abort"):
            raise HandoverError("prefill", f"the prefill request ended with {out.finish_reason}: {out.error}")
        t1 = time.perf_counter()
        payload: BlockPayload = await self._on_step_thread(self._connector().export_prefix, prompt_ids, cache_salt)
        body = await asyncio.to_thread(payload.to_bytes)
        t2 = time.perf_counter()
        reply: dict[str, Any] = {"transport": transport, "num_blocks": len(payload.blocks),
                                 "num_tokens": payload.num_tokens, "bytes": len(body),
                                 "prefill_s": t1 - t0, "export_s": t2 - t1}
        try:
            if transport == "shm":
                reply["handle"] = await asyncio.to_thread(self.shm.send, body)
            else:
                reply["import"] = await send_payload(kv_host, kv_port, body, timeout_s)
        except (OSError, TransferError) as exc:
            raise HandoverError("transfer", f"handing the KV to the decode replica failed: {exc}") from exc
        reply["send_s"] = time.perf_counter() - t2
        self.num_exported += 1
        return reply

    # -- decode side --------------------------------------------------------------------------
    async def import_payload(self, payload: BlockPayload) -> dict[str, Any]:
        """Import on the step thread; the result as a reply document. KVLayoutMismatch (a ValueError)
        when the payload was made by another model or layout.

        The CRCs are checked first on a worker thread, then the blocks go in IMPORT_CHUNK_BYTES at a
        time, one executor call each: the running requests' decode steps run between the pieces, so
        a 4,000-token prompt's import (184 MB of fp32 KV on SmolLM2, about 0.3 s in one piece) does
        not stall them all at once. A piece's blocks are registered in the prefix cache at once; the
        next piece finds them there (present) and extends the chain."""
        conn = self._connector()
        try:
            conn.layout.check(payload.layout)
            await asyncio.to_thread(payload.check_crcs)
            step = max(1, IMPORT_CHUNK_BYTES // conn.io.block_nbytes)
            n = len(payload.blocks)
            imported, first_present = 0, None
            res = None
            for end in range(min(step, n), n + step, step):
                end = min(end, n)
                res = await self._on_step_thread(conn.import_payload, payload.head(end))
                imported += res.num_imported
                if first_present is None:
                    first_present = res.num_present
                if res.rejected_at is not None or res.num_tokens < end or end == n:
                    break     # a bad block, or no room left in the pool: the rest is recomputed
        except Exception:
            self.num_import_failures += 1
            raise
        if res is None:     # an empty payload
            return {"num_blocks": 0, "num_imported": 0, "num_present": 0, "rejected_at": None, "reason": None}
        self.num_imported_blocks += imported
        self.num_present_blocks += first_present or 0
        if res.rejected_at is not None:
            log.warning("KV import: %s (the rest of the prompt is recomputed)", res.reason)
        return {"num_blocks": n, "num_imported": imported, "num_present": first_present or 0,
                "rejected_at": res.rejected_at, "reason": res.reason}

    async def import_handle(self, handle: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """Import a shared-memory payload; None when it could not be (logged, counted): the request
        then computes its whole prompt here, which is slower but gives the same tokens."""
        try:
            payload = await asyncio.to_thread(self.shm.receive, handle, timeout_s)
        except Exception as exc:  # noqa: BLE001 - a lost or bad payload means recomputing, never a failed request
            self.num_import_failures += 1
            log.warning("KV payload %s not received (%s: %s); the prompt is recomputed", handle,
                        type(exc).__name__, exc)
            return None
        try:
            return await self.import_payload(payload)
        except Exception as exc:  # noqa: BLE001 - counted in import_payload; the prompt is recomputed
            log.warning("KV import of %s failed (%s: %s); the prompt is recomputed", handle, type(exc).__name__, exc)
            return None

    async def start_receiver(self, host: str, port: int, timeout_s: float = 30.0) -> KVReceiver:
        self.receiver = await KVReceiver(self.import_payload, host, port, timeout_s).start()
        self.shm.sweep()
        return self.receiver

    async def close(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()
            self.receiver = None
