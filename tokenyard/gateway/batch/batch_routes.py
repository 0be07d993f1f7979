"""/v1/batches (OpenAI's Batch API): create, read, list, cancel.

    POST /v1/batches               {input_file_id, endpoint, completion_window: "24h", metadata}
    GET  /v1/batches/{batch_id}
    GET  /v1/batches               ?after=&limit=
    POST /v1/batches/{batch_id}/cancel

A batch starts "validating" and the runner (batch_runner.py) takes it from there. What can be
known at once is refused at once with a 400: a missing or foreign input file (404), a file that is
not a batch input, lines whose url is not the batch's endpoint (naming the first such line).
"""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenyard.gateway.batch.batch_store import new_batch_id, to_openai
from tokenyard.gateway.batch.file_routes import conflict, service_and_key, store_errors
from tokenyard.gateway.batch.input_check import ENDPOINTS
from tokenyard.gateway.edge.edge_params import parse_int
from tokenyard.gateway.edge.errors import BadRequest, NotFound, Unavailable
from tokenyard.gateway.http.completion_flow import read_json
from tokenyard.gateway.state import gateway_of

WINDOWS = ("24h",)
_KEYS = {"input_file_id", "endpoint", "completion_window", "metadata"}
MAX_METADATA = 16           # OpenAI's metadata: up to 16 pairs, keys <= 64 and values <= 512 characters


def routes() -> list[Route]:
    return [Route("/v1/batches", store_errors(create_batch), methods=["POST"]),
            Route("/v1/batches", store_errors(list_batches), methods=["GET"]),
            Route("/v1/batches/{batch_id}", store_errors(get_batch), methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", store_errors(cancel_batch), methods=["POST"])]


async def create_batch(request: Request) -> Response:
    svc, key = await service_and_key(request)
    gw = gateway_of(request)
    if gw.draining:
        raise Unavailable("The server is shutting down; retry on another instance", code="draining",
                          headers={"retry-after": "1"})
    body = await read_json(request, gw.deployment.limits.max_body_bytes, gw.deployment.limits.max_json_depth)
    if not isinstance(body, dict):
        raise BadRequest("The body must be a JSON object", code="invalid_body")
    unknown = sorted(set(body) - _KEYS)
    if unknown:
        raise BadRequest(f"Unknown parameter(s): {', '.join(unknown)}", param=unknown[0], code="unknown_parameter")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise BadRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint",
                         code="invalid_endpoint")
    if body.get("completion_window") not in WINDOWS:
        raise BadRequest(f"completion_window must be \"24h\", got {body.get('completion_window')!r}",
                         param="completion_window", code="invalid_completion_window")
    metadata = _metadata(body.get("metadata"))
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise BadRequest("input_file_id must be the id of an uploaded file", param="input_file_id",
                         code="invalid_input_file_id")
    rec = await svc.files.get(key.tenant, file_id)
    if rec.purpose != "batch":
        raise BadRequest(f"File {file_id} has purpose {rec.purpose!r}; a batch's input needs purpose \"batch\"",
                         param="input_file_id", code="invalid_input_file")
    other = {url: line for url, line in rec.urls.items() if url != endpoint}
    if other:
        url, line = min(other.items(), key=lambda x: x[1])
        raise BadRequest(f"Line {line} of {file_id} has url {url}, but the batch's endpoint is {endpoint}; "
                         f"every line must use the batch's endpoint", param="input_file_id", code="mismatched_url")
    batch_id = new_batch_id()
    created = await svc.batches.create({"id": batch_id, "tenant": key.tenant, "key_id": key.key_id,
                                        "endpoint": endpoint, "input_file_id": file_id, "completion_window": "24h",
                                        "total": rec.lines, "metadata": metadata}, input_key=svc.files.key(file_id))
    if not created:     # deleted since the lookup above: exactly as if it had never existed
        raise NotFound(f"No such file: {file_id}", param="input_file_id", code="file_not_found")
    svc.runner.wake()
    return JSONResponse(to_openai(await svc.batches.get(batch_id)))


async def get_batch(request: Request) -> Response:
    svc, key = await service_and_key(request)
    return JSONResponse(to_openai(await svc.batches.get(request.path_params["batch_id"], key.tenant)))


async def list_batches(request: Request) -> Response:
    svc, key = await service_and_key(request)
    q = request.query_params
    limit = parse_int(q.get("limit"), "limit", default=20, minimum=1, maximum=100)
    recs, more = await svc.batches.list(key.tenant, limit, q.get("after"))
    data = [to_openai(r) for r in recs]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": more})


async def cancel_batch(request: Request) -> Response:
    svc, key = await service_and_key(request)
    batch_id = request.path_params["batch_id"]
    await svc.batches.get(batch_id, key.tenant)     # 404 unless it is this tenant's
    if not await svc.batches.move(batch_id, "cancelling", ("validating", "in_progress"), "cancelling_at"):
        rec = await svc.batches.get(batch_id, key.tenant)
        if rec["status"] not in ("cancelling", "cancelled"):
            raise conflict(f"Batch {batch_id} is {rec['status']}; only a validating or in-progress batch "
                            f"can be cancelled", "batch_not_cancellable")
    svc.runner.cancel(batch_id)     # running here: its lines in flight are aborted now
    svc.runner.wake()               # running nowhere (not claimed yet): claim it and finish the cancel
    return JSONResponse(to_openai(await svc.batches.get(batch_id, key.tenant)))


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise BadRequest(f"metadata must be an object of at most {MAX_METADATA} string pairs (keys up to 64, "
                         f"values up to 512 characters)", param="metadata", code="invalid_metadata")
    return value
