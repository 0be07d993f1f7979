"""POST /v1/embeddings on a built-in torch engine the deployment marks `embeddings: true`.

The vectors are the engine's (tokenyard/engines/model/pooled_embedding.py): final hidden states mean-pooled
over each input's tokens and L2-normalised, computed between the engine's steps (AsyncEngine.embed),
so generation running on the same engine is not disturbed. Around them, the gates of a completion:
the key (authenticated by the caller), the token rate limit and admission with the inputs' token
count and no output tokens (gatekeeper.enter), and one usage record whose prompt tokens are priced
at the engine's input price (no cached or completion tokens).

OpenAI's options: `encoding_format` "float" (default) or "base64" (the float32 values, little-endian,
base64 of their bytes, as OpenAI sends them), and `dimensions`: the first N components, divided by
their own norm again (a 400 above the model's hidden size). Strings are encoded as /v1/completions
encodes a prompt (with the tokenizer's BOS where it adds one); token ids go in as they are.
An engine stepping in a process of its own (server.engine_process, the default for torch engines)
computes them in that process (tokenyard/engines/serving/process_embeddings.py); engines behind a replica
pool do not compute embeddings here: a 400 says so.
"""
from __future__ import annotations

import asyncio
import base64
import secrets
import time
from typing import Any

import numpy as np

from tokenyard.engines.core.errors import EngineDeadError, RequestError
from tokenyard.gateway.auth.api_keys import PRIORITIES, KeyRecord
from tokenyard.gateway.backends.engine_pool import EngineHandle
from tokenyard.gateway.edge.errors import BadRequest, Unavailable
from tokenyard.gateway.observability.metrics import prompt_bucket
from tokenyard.gateway.spend.usage import RecordContext, UsageRecord

ENCODINGS = ("float", "base64")


class EmbeddingCall:
    """What the access log reads of a finished request (its `record`), as it reads a Generation's."""

    __slots__ = ("record",)

    def __init__(self) -> None:
        self.record: UsageRecord | None = None


def options(body: dict[str, Any], size: int) -> tuple[str, int | None]:
    """(encoding_format, dimensions) from the body, or a 400 naming the field."""
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in ENCODINGS:
        raise BadRequest(f"'encoding_format' must be one of {', '.join(ENCODINGS)}, got {encoding!r}",
                         param="encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise BadRequest(f"'dimensions' must be a positive integer, got {dims!r}", param="dimensions")
    if dims is not None and dims > size:
        raise BadRequest(f"'dimensions' is {dims} but this model's embeddings have {size}", param="dimensions")
    return encoding, dims


def shape(vectors: list[list[float]], dims: int | None, encoding: str) -> list[Any]:
    """Each vector cut to `dims` components and renormalised (when asked), as floats or base64. Both
    formats carry the same float32 values: decoding the base64 gives back the float list exactly."""
    arr = np.asarray(vectors, dtype=np.float32)
    if dims is not None and dims < arr.shape[1]:
        arr = arr[:, :dims]
        norms = np.linalg.norm(arr.astype(np.float64), axis=1, keepdims=True)
        arr = (arr / np.maximum(norms, 1e-12)).astype(np.float32)
    if encoding == "base64":
        return [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in arr]
    return arr.tolist()


def _token_ids(tok: Any, inputs: list[str] | list[list[int]]) -> list[list[int]]:
    return [list(x) if isinstance(x, list) else tok.encode(x) for x in inputs]


async def serve(gw: Any, key: KeyRecord, handle: EngineHandle, body: dict[str, Any],
                inputs: list[str] | list[list[int]], arrival: float, info: dict[str, Any],
                context: RecordContext, deadline: float, lane: Any = None) -> tuple[dict[str, Any], dict[str, str]]:
    """(the reply object, its headers). lane: a Batch API line's (batch priority, idle room, price percent)."""
    engine = handle.engine
    size = getattr(engine, "embedding_size", None)
    if size is None:
        raise BadRequest(f"Embeddings from engine {handle.name} are not supported in this serving mode "
                         f"(replicas): they are computed by an engine of this gateway only",
                         param="model", code="embeddings_not_supported")
    encoding, dims = options(body, size)
    if any(x == "" for x in inputs):    # as OpenAI: an empty string is no input (not a lone BOS)
        raise BadRequest("'input' must not contain empty strings", param="input")
    prompts = _token_ids(handle.tokenizer, inputs) if len(inputs) < 64 else \
        await asyncio.to_thread(_token_ids, handle.tokenizer, inputs)
    max_len = engine.max_model_len
    for i, ids in enumerate(prompts):
        if not ids:
            raise BadRequest(f"input {i} encodes to no tokens", param="input")
        if len(ids) > max_len:
            raise BadRequest(f"This model's maximum context length is {max_len} tokens; input {i} has {len(ids)}",
                             param="input", code="context_length_exceeded")
    tokens = sum(len(ids) for ids in prompts)
    if lane is not None:
        await lane.wait_for_room(handle.name)
    admitted = await gw.gatekeeper.enter(key, handle.name, tokens, 0, deadline,
                                         None if lane is None else PRIORITIES.index("batch"))
    info.update(engine=handle.name, route_reason="embeddings")
    try:
        vectors = await engine.embed(prompts)
    except RequestError as e:       # a token id outside the vocabulary
        admitted.end(None)
        raise BadRequest(str(e), param="input") from e
    except EngineDeadError as e:
        admitted.end(None)
        raise Unavailable(f"Engine {handle.name} is unavailable", code="engine_unavailable") from e
    except BaseException:
        admitted.end(None)
        raise
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(shape(vectors, dims, encoding))]
    call = EmbeddingCall()
    call.record = _record(gw, handle, context, tokens, arrival, 100 if lane is None else lane.price_percent)
    info["generation"] = call
    admitted.billing(gw.usage_sink)(call.record)
    admitted.end(tokens)
    return ({"object": "list", "data": data, "model": handle.name,
             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
            {"x-tokenyard-engine": handle.name, **admitted.headers})


def _record(gw: Any, handle: EngineHandle, ctx: RecordContext, tokens: int, arrival: float,
            percent: int = 100) -> UsageRecord:
    """The request's usage: prompt tokens at the input price; the metrics a completion counts."""
    now = time.perf_counter()
    prices, m = handle.prices, gw.metrics
    m.e2e.labels(handle.name, prompt_bucket(tokens)).observe(now - arrival)
    m.prompt_tokens.labels(handle.name).inc(tokens)
    m.count_request(handle.name, 200, "embeddings")
    cost = prices.cost(tokens, 0, 0, percent)
    return UsageRecord(
        request_id=f"{ctx.client_request_id}-{secrets.token_hex(4)}", time=time.time() - (now - arrival),
        engine=handle.name, requested_model=handle.name, route_reason="embeddings", prompt_tokens=tokens,
        cached_tokens=0, completion_tokens=0, cost_micros=cost, status="ok", finish_reason=None, ttft_s=None,
        e2e_s=now - arrival, stream=False, tenant=ctx.tenant, key_id=ctx.key_id,
        client_request_id=ctx.client_request_id, tags=dict(ctx.tags), user=ctx.user,
        prices=[prices.input, prices.cached_input, prices.output], baseline_engine=ctx.baseline_engine or handle.name,
        baseline_cost_micros=cost, key_name=ctx.key_name, routed_prompt_tokens=tokens, api=ctx.api,
        batch=ctx.batch, price_percent=percent)
