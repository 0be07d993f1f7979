"""Ending a batch whose input file is gone, instead of retrying it for ever.

    await end_without_input(store, files, storage, batch_id, run_stop, err)

The input's bytes can vanish behind the gateway's back (a disk swapped, a file removed by hand, or
records from before DELETE refused files in use). Then the lines not yet run can never be read,
and the unanswered ones cannot even be named in the error file (their custom ids are in the
input). Retrying cannot help: before this, such a batch stayed `cancelling` (or `in_progress`) across
restarts, logging a traceback on every poll, its charged answers never downloadable.

So the batch reaches a final status at once: `cancelled` when it was being cancelled, `expired`
past its window, else `failed`; `errors` says the input is gone and how many lines have no answer;
the answers recorded so far (and charged) go to the output and error files as usual; and one
warning is logged. Every step is a plain overwrite or a compare-and-set, so a crash in the middle
is finished by the next claim.
"""
from __future__ import annotations

import json
import logging

from tokenyard.gateway.batch.batch_store import FINAL, BatchStore
from tokenyard.gateway.batch.file_records import FileRecords
from tokenyard.gateway.batch.file_storage import FileStorage, InputMissing
from tokenyard.gateway.batch.finalize import write_results

log = logging.getLogger("tokenyard.batch")
CODE = "input_file_missing"


async def end_without_input(store: BatchStore, files: FileRecords, storage: FileStorage, batch_id: str,
                            run_stop: str | None, err: InputMissing) -> str:
    """Move the batch to its final status; return it (or the status it already had)."""
    rec = await store.get(batch_id)
    if rec["status"] in FINAL:
        return rec["status"]
    total, answered = int(rec["total"]), len(await store.answered(batch_id))
    message = (f"The input file {err.file_id} is gone from the file storage: {total - answered} of {total} "
               f"requests have no answer and are in neither file")
    errors = {"object": "list", "data": [{"code": CODE, "line": None, "param": "input_file_id", "message": message}]}
    await store.set_fields(batch_id, errors=json.dumps(errors))
    await write_results(store, files, storage, rec, None, partial=True)
    for _ in range(3):      # a cancel can land between the read and the move: then it is cancelled
        status = (await store.get(batch_id))["status"]
        if status in FINAL:
            return status
        final, allowed = _final(status, run_stop)
        if await store.move(batch_id, final, allowed, final + "_at"):
            log.warning("batch %s: %s; it is %s with %d of %d requests answered", batch_id, err, final, answered,
                        total)
            return final
    raise RuntimeError(f"batch {batch_id}: its status kept changing")


def _final(status: str, run_stop: str | None) -> tuple[str, tuple[str, ...]]:
    if status == "cancelling":
        return "cancelled", ("cancelling",)
    if status == "in_progress" and run_stop == "expired":
        return "expired", ("in_progress",)
    return "failed", ("validating", "in_progress", "finalizing")
