"""Runs batches: claims them, feeds their lines through the request flow, and finalizes them.

    runner = BatchRunner(gw, store, files, storage, settings)
    runner.start()            # looks for open batches every batch.poll_s (new ones, or a dead gateway's)
    runner.wake()             # a batch was just created: look now
    runner.cancel(batch_id)   # abort its running lines now (the route has already marked it cancelling)
    await runner.stop()       # lines in flight are cut; their batches resume on the next start

One task per batch this gateway holds the lease of (batch_store.py). Lines are read from the input
file in order; a line that already has an answer in Redis is skipped, so a restarted gateway (or
another one, once the lease has lapsed) resumes where the last one stopped and answers each line
exactly once. At most batch.max_in_flight lines run at once in this gateway, over all batches, fewer
while the event loop lags (adaptive_limit.py); each one waits for idle capacity (idle_capacity.py).
Every lease_s / 3 the lease is renewed and the status re-read (a cancel made through another gateway)
and the expiry checked.

Statuses: validating -> in_progress -> finalizing -> completed; cancelling -> cancelled (lines in
flight are aborted at once, in the engine's next step; every line without an answer is answered
"batch_cancelled"); past expires_at -> expired (unanswered lines: "batch_expired"). Every line ends
in exactly one of the two files, except when the input file is gone: then the batch ends at once
(input_gone.py: failed, or cancelled / expired if it was being cancelled / past its window), its
answers so far written out and `errors` saying how many lines have none.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenyard.gateway.batch.adaptive_limit import AdaptiveLimit
from tokenyard.gateway.batch.batch_store import BatchStore
from tokenyard.gateway.batch.file_records import FileRecords
from tokenyard.gateway.batch.file_storage import FileStorage, InputMissing, line_chunks
from tokenyard.gateway.batch.finalize import close_chunks, write_results
from tokenyard.gateway.batch.idle_capacity import IdleCapacity
from tokenyard.gateway.batch.input_gone import end_without_input
from tokenyard.gateway.batch.line_runner import RetryLater, run_line
from tokenyard.gateway.config.batch_settings import BatchSettings
from tokenyard.gateway.edge.errors import APIError, Unauthorized
from tokenyard.gateway.http.completion_flow import BatchLane
from tokenyard.gateway.http.generation_group import GenerationGroup
from tokenyard.policies.schema import DEFAULT_BATCH_PRICE_PERCENT

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

log = logging.getLogger("tokenyard.batch")
READ_LINES = 256        # input lines read from storage at a time


@dataclass(slots=True)
class _Run:
    """One batch being run by this gateway."""

    id: str
    rec: dict[str, str]
    stop: str | None = None                  # "cancelled" / "expired" / "paused" (gateway stops, lease lost)
    running: dict[int, GenerationGroup] = field(default_factory=dict)   # line index -> its request in flight
    task: asyncio.Task | None = None

    def started(self, index: int, gen: GenerationGroup) -> None:
        """A line's request reached the engine; one that got there after a cancel is aborted at once."""
        self.running[index] = gen
        if self.stop in ("cancelled", "expired"):
            gen.abort(self.stop)

    def halt(self, why: str) -> None:
        if self.stop is None or why == "cancelled":
            self.stop = why
        if why in ("cancelled", "expired"):
            for gen in list(self.running.values()):
                gen.abort(why)


class BatchRunner:
    def __init__(self, gw: "Gateway", store: BatchStore, files: FileRecords, storage: FileStorage,
                 settings: BatchSettings) -> None:
        self.gw = gw
        self.store = store
        self.files = files
        self.storage = storage
        self.settings = settings
        self.owner = secrets.token_hex(8)    # this gateway process, in lease records
        self.capacity = IdleCapacity(gw.admission, settings.idle_share, settings.bulk_engines,
                                     settings.start_gap_ms / 1000)
        self.limit = AdaptiveLimit(settings.max_in_flight, settings.max_loop_lag_ms / 1000)   # lines in flight
        self.answered = {"completed": 0, "failed": 0}    # lines this gateway answered (/metrics)
        self._runs: dict[str, _Run] = {}
        self._failing: dict[str, str] = {}      # batch id -> the error its last run failed with (logged once)
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    @property
    def runs(self) -> dict[str, _Run]:
        return self._runs

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.limit.start()
        self._loop_task = asyncio.get_running_loop().create_task(self._poll(), name="batch-runner")

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        run = self._runs.get(batch_id)
        if run is not None:
            run.halt("cancelled")

    async def stop(self) -> None:
        held = list(self._runs)
        tasks = [t for t in [self._loop_task, *(r.task for r in self._runs.values())] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.limit.stop()
        # Handing the leases back lets the next start (or another gateway) resume at once.
        for batch_id in held:
            try:
                await self.store.release(batch_id, self.owner)
            except Exception as e:  # noqa: BLE001 - Redis gone: the lease lapses after lease_s
                log.warning("could not release the lease on %s: %s", batch_id, e)
        self._runs.clear()

    async def _poll(self) -> None:
        while True:
            _raise_if_cancelled()
            try:
                for batch_id in await self.store.open_ids():
                    if batch_id not in self._runs and not self.gw.draining:
                        if await self.store.hold(batch_id, self.owner, self.settings.lease_s):
                            run = _Run(batch_id, {})
                            self._runs[batch_id] = run
                            run.task = asyncio.get_running_loop().create_task(self._run(run), name=f"batch-{batch_id}")
            except Exception as e:  # noqa: BLE001 - Redis down: try again next round
                _raise_if_cancelled()
                log.warning("batch runner: cannot list open batches: %s", e)
            try:    # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that races its timeout
                async with asyncio.timeout(self.settings.poll_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    # -- one batch -----------------------------------------------------------------------------
    async def _run(self, run: _Run) -> None:
        keeper = asyncio.get_running_loop().create_task(self._keep(run))
        try:
            try:
                await self._steps(run)
            except InputMissing as e:
                await end_without_input(self.store, self.files, self.storage, run.id, run.stop, e)
            self._failing.pop(run.id, None)
        except Exception as e:  # noqa: BLE001 - logged; the batch stays open and is picked up again
            _raise_if_cancelled()
            # The traceback once per batch and cause, not on every claim (every poll_s) while it lasts.
            cause = f"{type(e).__name__}: {e}"
            if self._failing.get(run.id) != cause:
                self._failing[run.id] = cause
                log.exception("batch %s: run failed; it resumes on the next claim", run.id)
            else:
                log.debug("batch %s: run failed again: %s", run.id, cause)
        finally:
            keeper.cancel()
            self._runs.pop(run.id, None)
            if not asyncio.current_task().cancelling():
                try:
                    await self.store.release(run.id, self.owner)
                except Exception:  # noqa: BLE001 - the lease lapses by itself
                    pass

    async def _steps(self, run: _Run) -> None:
        run.rec = await self.store.get(run.id)
        status = run.rec["status"]
        if status == "validating":
            status = await self._validate(run)
        if status == "in_progress":
            await self._feed(run)
            status = (await self.store.get(run.id))["status"]
        if run.stop == "paused":
            return
        if status in ("in_progress", "cancelling", "finalizing"):
            await self._finish(run, status)

    async def _keep(self, run: _Run) -> None:
        """Renew the lease; notice a cancel made elsewhere and the expiry."""
        every = self.settings.lease_s / 3
        while True:
            await asyncio.sleep(min(every, self.settings.poll_s))
            _raise_if_cancelled()
            try:
                if not await self.store.hold(run.id, self.owner, self.settings.lease_s):
                    log.warning("batch %s: lease taken by another gateway; stopping here", run.id)
                    run.halt("paused")
                    return
                rec = await self.store.get(run.id)
            except Exception as e:  # noqa: BLE001 - Redis hiccup: keep going, try again
                _raise_if_cancelled()
                log.warning("batch %s: lease renewal failed: %s", run.id, e)
                continue
            if rec["status"] == "cancelling":
                run.halt("cancelled")
            elif time.time() >= int(rec["expires_at"]):
                run.halt("expired")

    async def _validate(self, run: _Run) -> str:
        tenant, file_id = run.rec["tenant"], run.rec["input_file_id"]
        try:
            await self.files.get(tenant, file_id)
            await asyncio.to_thread(lambda: self.storage.open(tenant, file_id).close())
        except (APIError, OSError) as e:
            errors = {"object": "list", "data": [{"code": "invalid_input_file", "line": None, "param": "input_file_id",
                                                  "message": f"The input file {file_id} cannot be read: {e}"}]}
            await self.store.set_fields(run.id, errors=json.dumps(errors))
            await self.store.move(run.id, "failed", ("validating",), "failed_at")
            return "failed"
        if await self.store.move(run.id, "in_progress", ("validating",), "in_progress_at"):
            return "in_progress"
        return (await self.store.get(run.id))["status"]

    async def _feed(self, run: _Run) -> None:
        """Start every unanswered line (at most max_in_flight at once), then wait for them."""
        answered = await self.store.answered(run.id)
        tasks: set[asyncio.Task] = set()
        lines = line_chunks(self.storage, run.rec["tenant"], run.rec["input_file_id"], READ_LINES)
        try:
            while run.stop is None:
                chunk = await asyncio.to_thread(next, lines, None)
                if chunk is None:
                    break
                for index, raw in chunk:
                    if index in answered:
                        continue
                    # Giving up the wait on a cancel: another batch may hold every slot for a long time.
                    got = await self.limit.acquire(lambda: run.stop is not None or self.gw.draining)
                    if self.gw.draining:
                        run.halt("paused")
                    if run.stop is not None or not got:
                        if got:
                            self.limit.release()
                        break
                    task = asyncio.get_running_loop().create_task(self._line(run, index, raw))
                    tasks.add(task)
                    task.add_done_callback(lambda t: self._line_done(run, tasks, t))
            await asyncio.gather(*list(tasks), return_exceptions=True)
        finally:
            for t in list(tasks):
                t.cancel()
            close_chunks(lines)

    def _line_done(self, run: _Run, tasks: set[asyncio.Task], task: asyncio.Task) -> None:
        tasks.discard(task)
        self.limit.release()
        if not task.cancelled() and task.exception() is not None:   # not recorded: it runs again later
            log.warning("batch %s: a line's answer was not recorded: %r", run.id, task.exception())

    async def _line(self, run: _Run, index: int, raw: bytes) -> None:
        obj = json.loads(raw)           # checked at upload (input_check.py)
        custom_id, url, endpoint = obj["custom_id"], obj["url"], run.rec["endpoint"]
        request_id = f"{run.id}-{index}"
        response: dict[str, Any] | None = None
        if url != endpoint:
            body = APIError(f"url {url} differs from the batch's endpoint {endpoint}", param="url",
                            code="invalid_url").body()
            response = {"status_code": 400, "request_id": request_id, "body": body}
        while response is None and run.stop is None:
            try:
                key = await self.gw.keys.lookup(run.rec["key_id"])
                if key is None or key.revoked is not None:
                    err = Unauthorized("The API key that created this batch has been revoked", code="invalid_api_key")
                    response = {"status_code": 401, "request_id": request_id, "body": err.body()}
                    break
                response = await run_line(self.gw, key, url, obj["body"], request_id, self._lane(),
                                          lambda gen: run.started(index, gen))
                if response is None:    # aborted by a cancel or the expiry: answered with the rest
                    return
            except RetryLater as e:
                await asyncio.sleep(e.after_s)
            except APIError as e:       # e.g. keys unverifiable: wait and try again
                _raise_if_cancelled()
                await asyncio.sleep(1.0)
                log.debug("batch %s line %d: %s", run.id, index, e)
            except Exception:  # noqa: BLE001 - a bug must cost one line, never the batch
                _raise_if_cancelled()
                log.exception("batch %s line %d failed", run.id, index)
                err = APIError("The gateway failed while running this line", code="internal_error")
                response = {"status_code": 500, "request_id": request_id, "body": err.body()}
            finally:
                run.running.pop(index, None)
        if response is None:
            return
        ok = response["status_code"] == 200
        line = json.dumps({"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id,
                           "response": response, "error": None}, ensure_ascii=False)
        if await self.store.answer(run.id, index, ok, line):
            self.answered["completed" if ok else "failed"] += 1

    def _lane(self) -> BatchLane:
        policy = self.gw.policy.policy
        percent = DEFAULT_BATCH_PRICE_PERCENT if policy is None else policy.batch_price_percent
        bulk = self.settings.bulk
        return BatchLane(percent, lambda engine: bulk.get(engine, engine), self.capacity.wait)

    # -- the end -------------------------------------------------------------------------------
    async def _finish(self, run: _Run, status: str) -> None:
        """Answer what is left (cancelled / expired), write the files, reach the final status."""
        if status == "in_progress" and run.stop is None:
            missing = int(run.rec["total"]) - len(await self.store.answered(run.id))
            if missing:     # an answer was lost (e.g. Redis failed mid-line): run them again later
                raise RuntimeError(f"{missing} lines have no answer yet")
            if not await self.store.move(run.id, "finalizing", ("in_progress",), "finalizing_at"):
                status = (await self.store.get(run.id))["status"]
            else:
                status = "finalizing"
        if status == "finalizing":
            final, time_field, allowed = "completed", "completed_at", ("finalizing",)
        elif status == "cancelling" or run.stop == "cancelled":
            final, time_field, allowed = "cancelled", "cancelled_at", ("cancelling",)
        else:   # still in progress past its window
            final, time_field, allowed = "expired", "expired_at", ("in_progress",)
        rec = await self.store.get(run.id)
        await write_results(self.store, self.files, self.storage, rec, "batch_" + final if final != "completed"
                            else None)
        await self.store.move(run.id, final, allowed, time_field)


def _raise_if_cancelled() -> None:
    """Re-raise a cancel of this task that an `except Exception` (or a library) let through: the
    Redis client can turn a cancel that lands mid-command into a connection error or swallow it, and
    a loop that went on would keep a stopped gateway renewing its lease for ever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()
