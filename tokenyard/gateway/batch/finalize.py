"""The end of a batch: answer the lines it will never run, then write its output and error files.

    await write_results(store, files, storage, rec, fill_code="batch_cancelled")   # or None

Every line has exactly one answer in Redis first (lines never run get `fill_code`, through the same
exactly-once script as any other answer, so request_counts stay exact); then the answers are
copied, in input order, into the output file (status 200) and the error file (everything else),
in OpenAI's shape, one line per custom_id:

    {"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200, "request_id": "...",
     "body": {...}}, "error": null}
    {"id": "batch_req_...", "custom_id": "...", "response": null,
     "error": {"code": "batch_cancelled", "message": "..."}}

When the input file is gone (InputMissing from the fill), the runner calls again with partial=True:
the answers already recorded (and charged) are still written and downloadable.

Safe to repeat after a crash: the file ids are chosen once (kept in the batch's hash), each file is
written whole and renamed into place, and the records are plain overwrites.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import tempfile
from typing import IO, Any, Iterator

from tokenyard.gateway.batch.batch_store import BatchStore
from tokenyard.gateway.batch.file_records import FileRecords, new_file_id, new_record
from tokenyard.gateway.batch.file_storage import FileStorage, line_chunks

CHUNK = 1000        # answers read from Redis per round trip
_FILL_MESSAGE = {"batch_cancelled": "The batch was cancelled before this request ran.",
                 "batch_expired": "The batch did not complete within its completion window; this request "
                                  "did not run."}


async def write_results(store: BatchStore, files: FileRecords, storage: FileStorage, rec: dict[str, str],
                        fill_code: str | None, partial: bool = False) -> None:
    """partial: the input file is gone, so unanswered lines cannot be filled (their custom ids are in
    it): write the answers there are and leave those lines out (the batch's `errors` says so)."""
    batch_id, tenant, total = rec["id"], rec["tenant"], int(rec["total"])
    if fill_code is not None:
        await _fill(store, storage, rec, fill_code)
    out_id = await store.set_if_empty(batch_id, "pending_output_file_id", new_file_id())
    err_id = await store.set_if_empty(batch_id, "pending_error_file_id", new_file_id())
    with tempfile.TemporaryFile() as out_tmp, tempfile.TemporaryFile() as err_tmp:
        counts = [0, 0]
        for start in range(0, total, CHUNK):
            answers = await store.answers(batch_id, start, min(total, start + CHUNK))
            parts: tuple[list[bytes], list[bytes]] = ([], [])
            for i, answer in enumerate(answers):
                if answer is None:
                    if partial:
                        continue
                    raise RuntimeError(f"batch {batch_id}: line {start + i} has no answer yet")
                parts[0 if answer[:1] == b"o" else 1].append(answer[1:] + b"\n")
            counts[0] += len(parts[0])
            counts[1] += len(parts[1])
            await asyncio.to_thread(_append, out_tmp, err_tmp, parts)
        ids = {}
        for tmp, file_id, n, kind in ((out_tmp, out_id, counts[0], "output"), (err_tmp, err_id, counts[1], "error")):
            if n == 0:
                ids[kind] = ""
                continue
            size = await asyncio.to_thread(_store, storage, tenant, file_id, tmp)
            await files.put(new_record(file_id, tenant, size, f"{batch_id}_{kind}.jsonl", "batch_output"))
            ids[kind] = file_id
    await store.set_fields(batch_id, output_file_id=ids["output"], error_file_id=ids["error"])


async def _fill(store: BatchStore, storage: FileStorage, rec: dict[str, str], code: str) -> None:
    """Answer every line that has none with `code` (the custom ids come from the input file)."""
    answered = await store.answered(rec["id"])
    if len(answered) >= int(rec["total"]):
        return
    chunks = line_chunks(storage, rec["tenant"], rec["input_file_id"])
    try:
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            for index, raw in chunk:
                if index in answered:
                    continue
                line = json.dumps({"id": "batch_req_" + secrets.token_hex(12),
                                   "custom_id": json.loads(raw)["custom_id"], "response": None,
                                   "error": {"code": code, "message": _FILL_MESSAGE[code]}}, ensure_ascii=False)
                await store.answer(rec["id"], index, False, line)
    finally:
        close_chunks(chunks)


def _append(out_tmp: IO[bytes], err_tmp: IO[bytes], parts: tuple[list[bytes], list[bytes]]) -> None:
    out_tmp.write(b"".join(parts[0]))
    err_tmp.write(b"".join(parts[1]))


def _store(storage: FileStorage, tenant: str, file_id: str, tmp: IO[bytes]) -> int:
    tmp.seek(0)
    return storage.put(tenant, file_id, iter(lambda: tmp.read(1 << 20), b""))


def close_chunks(chunks: Iterator[Any]) -> None:
    """Close a line_chunks reader (its file)."""
    try:
        chunks.close()
    except ValueError:      # still running in its worker thread (the task was cancelled): it ends with the thread
        pass
