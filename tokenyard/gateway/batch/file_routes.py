"""/v1/files (OpenAI's Files API, for the Batch API): upload, list, read, download, delete.

    POST   /v1/files                  multipart: file (JSONL), purpose "batch"  -> File object
    GET    /v1/files                  ?purpose=&limit=&order=&after=            -> list of File objects
    GET    /v1/files/{file_id}                                                  -> File object
    GET    /v1/files/{file_id}/content                                          -> the bytes
    DELETE /v1/files/{file_id}                                                  -> {"id", "object", "deleted"}
                                                  409 file_in_use while any open batch reads it

Every call authenticates like /v1/chat/completions; a tenant sees only its own files (another
tenant's id is a 404, exactly like an id that never existed). An upload is read through a byte
counter (413 past batch.max_file_bytes, before the rest is read), checked line by line
(input_check.py: 400 naming the first bad line), stored durably, and only then recorded.
"""
from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator

from redis.exceptions import RedisError
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenyard.gateway.batch.batch_store import OPEN
from tokenyard.gateway.batch.file_names import safe_filename
from tokenyard.gateway.batch.file_records import new_file_id, new_record
from tokenyard.gateway.batch.input_check import check_batch_input
from tokenyard.gateway.batch.service import BatchService
from tokenyard.gateway.edge.edge_params import parse_int
from tokenyard.gateway.edge.errors import APIError, BadRequest, ClientClosed, NotFound, PayloadTooLarge, Unavailable
from tokenyard.gateway.state import gateway_of

if TYPE_CHECKING:
    from tokenyard.gateway.auth.api_keys import KeyRecord

FORM_OVERHEAD = 64 << 10    # multipart boundaries and the purpose field, beyond the file itself
DELETE_TRIES = 3            # a batch created between the look and the removal: look again
SHOWN_VALUE = 40            # characters of a refused text field quoted back in the error


def routes() -> list[Route]:
    return [Route("/v1/files", store_errors(create_file), methods=["POST"]),
            Route("/v1/files", store_errors(list_files), methods=["GET"]),
            Route("/v1/files/{file_id}", store_errors(get_file), methods=["GET"]),
            Route("/v1/files/{file_id}", store_errors(delete_file), methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", store_errors(file_content), methods=["GET"])]


def store_errors(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Redis or the disk failing is the server's trouble, never a bare 500: 503 with a retry hint."""
    @functools.wraps(endpoint)
    async def guarded(request: Request) -> Response:
        try:
            return await endpoint(request)
        except RedisError as e:
            raise Unavailable("Batch API records cannot be read or written right now; retry shortly",
                              code="batch_store_unavailable", headers={"retry-after": "1"}) from e
        except OSError as e:
            raise Unavailable("Batch API files cannot be read or written right now; retry shortly",
                              code="batch_storage_unavailable", headers={"retry-after": "1"}) from e
    return guarded


async def service_and_key(request: Request) -> tuple[BatchService, "KeyRecord"]:
    """The Batch API of this gateway and the caller's key (401 / 503 otherwise)."""
    gw = gateway_of(request)
    key = await gw.keys.authenticate(request.headers.get("authorization"))
    request.scope.setdefault("tokenyard", {})["tenant"] = key.tenant
    if gw.batch is None:
        raise Unavailable("The Batch API is not available on this gateway (it needs Redis and batch.enabled)",
                          code="batch_unavailable")
    return gw.batch, key


async def create_file(request: Request) -> Response:
    svc, key = await service_and_key(request)
    gw = gateway_of(request)
    if gw.draining:
        raise Unavailable("The server is shutting down; retry on another instance", code="draining",
                          headers={"retry-after": "1"})
    limit = svc.settings.max_file_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + FORM_OVERHEAD:
        raise _too_large(limit)
    if not (request.headers.get("content-type") or "").lower().startswith("multipart/form-data"):
        raise BadRequest("Upload the file as multipart/form-data with the fields file and purpose",
                         code="invalid_content_type")
    async with _bounded(request, limit + FORM_OVERHEAD).form(max_files=1, max_fields=4) as form:
        purpose = form.get("purpose")
        upload = form.get("file")
        if purpose != "batch":
            raise BadRequest(f"The form field purpose must be the text \"batch\" (the only purpose this gateway "
                             f"stores), got {_described(purpose)}", param="purpose", code="invalid_purpose")
        if not isinstance(upload, UploadFile):
            raise BadRequest("The form has no file field: upload the JSONL as the form field file (a file part, "
                             "with a filename)", param="file", code="missing_file")
        if upload.size is not None and upload.size > limit:
            raise _too_large(limit)
        lim = gw.deployment.limits
        summary = await asyncio.to_thread(check_batch_input, upload.file, svc.settings.max_lines,
                                          lim.max_body_bytes, lim.max_json_depth)
        file_id = new_file_id()
        upload.file.seek(0)
        size = await asyncio.to_thread(svc.storage.put, key.tenant, file_id, _chunks(upload.file))
        filename = safe_filename(upload.filename)
        rec = new_record(file_id, key.tenant, size, filename, "batch", summary.lines, summary.first_line_of)
        await svc.files.put(rec)
    return JSONResponse(rec.to_openai())


async def list_files(request: Request) -> Response:
    svc, key = await service_and_key(request)
    q = request.query_params
    limit = parse_int(q.get("limit"), "limit", default=10_000, minimum=1, maximum=10_000)
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest(f"order must be asc or desc, got {order!r}", param="order", code="invalid_order")
    recs, more = await svc.files.list(key.tenant, q.get("purpose"), limit, order == "desc", q.get("after"))
    data = [r.to_openai() for r in recs]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": more})


async def get_file(request: Request) -> Response:
    svc, key = await service_and_key(request)
    rec = await svc.files.get(key.tenant, request.path_params["file_id"])
    return JSONResponse(rec.to_openai())


async def file_content(request: Request) -> Response:
    svc, key = await service_and_key(request)
    rec = await svc.files.get(key.tenant, request.path_params["file_id"])
    try:
        f = await asyncio.to_thread(svc.storage.open, key.tenant, rec.id)
    except OSError as e:
        raise APIError(f"The content of file {rec.id} cannot be read", code="file_unreadable") from e
    return StreamingResponse(_chunks(f, close=True), media_type="application/octet-stream",
                             headers={"content-length": str(rec.bytes)})


async def delete_file(request: Request) -> Response:
    svc, key = await service_and_key(request)
    rec = await svc.files.get(key.tenant, request.path_params["file_id"])
    for _ in range(DELETE_TRIES):
        readers = await _open_readers(svc, rec.id)
        if readers:
            break
        if await svc.files.remove_unused(rec):      # atomic: no batch took the file since the look
            await asyncio.to_thread(svc.storage.delete, key.tenant, rec.id)
            return JSONResponse({"id": rec.id, "object": "file", "deleted": True})
    listed = ", ".join(f"{batch_id} ({status})" for batch_id, status in readers) or "a batch being created"
    err = conflict(f"File {rec.id} is the input of open batch(es) {listed}; cancel them or wait for them to end, "
                   f"then delete the file", "file_in_use")
    err.param = "file_id"
    raise err


async def _open_readers(svc: BatchService, file_id: str) -> list[tuple[str, str]]:
    """(batch id, status) of every open batch reading the file; listed users found final or gone
    are released on the way (see FileRecords.release)."""
    readers = []
    for batch_id in sorted(await svc.files.users_of(file_id)):
        try:
            status = (await svc.batches.get(batch_id))["status"]
        except NotFound:
            status = ""
        if status in OPEN:
            readers.append((batch_id, status))
        else:
            await svc.files.release(file_id, batch_id)
    return readers


def _described(value: object) -> str:
    """A refused form value for an error message: a short quote of text, never an object's repr
    (an UploadFile's repr carries the client's headers and file name)."""
    if value is None:
        return "nothing (the field is missing)"
    if not isinstance(value, str):
        return "a file part (send purpose as a plain text field, without a filename)"
    shown = "".join(ch if ch.isprintable() else "?" for ch in value[:SHOWN_VALUE])
    return f'"{shown}"' + ("..." if len(value) > SHOWN_VALUE else "")


def _chunks(f: Any, close: bool = False) -> Iterator[bytes]:
    try:
        while chunk := f.read(1 << 20):
            yield chunk
    finally:
        if close:
            f.close()


def _bounded(request: Request, limit: int) -> Request:
    """The same request, its body counted as it arrives: 413 once past `limit` (whatever
    Content-Length said), so an oversize upload is never read (or spooled to disk) in full."""
    seen = 0

    async def receive() -> Any:
        nonlocal seen
        message = await request.receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _too_large(limit - FORM_OVERHEAD)
        elif message["type"] == "http.disconnect":
            raise ClientClosed("The client closed the connection before sending the whole file",
                               code="client_disconnected")
        return message

    return Request(request.scope, receive)


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The file is larger than {limit} bytes (batch.max_file_bytes)", param="file",
                           code="file_too_large")


def conflict(message: str, code: str) -> APIError:
    err = APIError(message, code=code)
    err.status, err.type = 409, "invalid_request_error"
    return err

