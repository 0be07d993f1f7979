"""POST /v1/feedback: a client's judgement of one response, stored as a label the router learns from.

    {"response_id": "chatcmpl-...", "score": 0.0}                 # the answer was bad (0..1, 1 = good)
    {"response_id": "chatcmpl-...", "preferred_engine": "demo-large"}

`response_id` is a chat completion's, text completion's or message's `id` (`chatcmpl-`, `cmpl-`,
`msg_` + the request id), or the `x-request-id` header of any response (the Responses API's too).
The response must have been kept for feedback (deployment `router_learning`, docs/router.md) and
belong to the caller's tenant; otherwise 404 `response_not_found` (never a 403 that would confirm an
id of another tenant exists).

The training label (1: the small engine is enough, 0: the large one is needed):
  preferred_engine  the small engine -> 1, the large engine -> 0 (whichever engine answered);
  score             on an answer of the small engine: >= 0.5 -> 1, < 0.5 -> 0. On an answer of the
                    large engine a score says nothing about the small one: the feedback is kept with
                    label null (`"label": null`), which training skips.
Both given: preferred_engine decides the label; the score is kept beside it. Sending feedback on the
same response again replaces its label (one label per response; a retry stores nothing twice).
"""
from __future__ import annotations

import math
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tokenyard.gateway.edge.errors import BadRequest, NotFound, Unavailable
from tokenyard.gateway.http.completion_flow import read_json
from tokenyard.gateway.state import Gateway, gateway_of

KEYS = ("response_id", "score", "preferred_engine")
ID_PREFIXES = ("chatcmpl-", "cmpl-", "msg_")
MAX_ID = 128
SCORE_CUT = 0.5         # a score at or above it says the answer was good enough


def routes() -> list[Route]:
    return [Route("/v1/feedback", feedback, methods=["POST"])]


def request_id_of(response_id: str) -> str:
    for prefix in ID_PREFIXES:
        if response_id.startswith(prefix):
            return response_id[len(prefix):]
    return response_id


def parse_feedback(body: Any) -> tuple[str, float | None, str | None]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in body:
        if name not in KEYS:
            raise BadRequest(f"Unrecognized request argument supplied: {name}", param=name,
                             code="unrecognized_parameter")
    rid = body.get("response_id")
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID or not rid.isprintable():
        raise BadRequest(f"'response_id' is required: the id of a response (at most {MAX_ID} printable characters)",
                         param="response_id", code="invalid_response_id")
    score = body.get("score")
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))
                              or not math.isfinite(score) or not 0 <= score <= 1):
        raise BadRequest(f"'score' must be a number in [0, 1] (1: the answer was good), got {score!r}",
                         param="score", code="invalid_score")
    preferred = body.get("preferred_engine")
    if preferred is not None and (not isinstance(preferred, str) or not preferred):
        raise BadRequest("'preferred_engine' must be an engine name", param="preferred_engine",
                         code="invalid_preferred_engine")
    if score is None and preferred is None:
        raise BadRequest("send 'score' (0..1) or 'preferred_engine' (or both)", param="score",
                         code="missing_feedback")
    return rid, None if score is None else float(score), preferred


def label_for(sample: dict[str, Any], score: float | None, preferred: str | None) -> int | None:
    """1: the small engine is enough; 0: the large one is needed; None: no signal (see the module doc)."""
    small, large = sample["small"], sample["large"]
    if preferred is not None:
        if preferred not in (small, large):
            raise BadRequest(f"'preferred_engine' must be {small!r} or {large!r} (the engines this response was "
                             f"routed between), got {preferred!r}", param="preferred_engine",
                             code="invalid_preferred_engine")
        return 1 if preferred == small else 0
    if sample["engine"] == small and score is not None:
        return 1 if score >= SCORE_CUT else 0
    return None


async def feedback(request: Request) -> JSONResponse:
    gw: Gateway = gateway_of(request)
    body = await read_json(request, gw.deployment.limits.max_body_bytes, gw.deployment.limits.max_json_depth)
    key = await gw.keys.authenticate(request.headers.get("authorization"))
    try:
        rid, score, preferred = parse_feedback(body)
    except BadRequest:
        gw.metrics.router_feedback.labels("invalid").inc()
        raise
    learning = gw.learning
    store = learning.store
    sample = None
    if store is not None and gw.deployment.router_learning.enabled:
        try:
            await learning.flush()            # a response of this gateway a moment ago is findable now
            sample = await store.sample(key.tenant, request_id_of(rid))
        except Exception as e:  # noqa: BLE001 - Redis away: the client may retry
            raise Unavailable("Feedback cannot be stored right now; retry", code="store_unavailable") from e
    if sample is None:
        gw.metrics.router_feedback.labels("not_found").inc()
        raise NotFound(f"No response with id '{rid[:64]}' was kept for feedback for this key's tenant (unknown, "
                       "expired, not sampled, or feedback is off in this deployment)", param="response_id",
                       code="response_not_found")
    try:
        label = label_for(sample, score, preferred)
    except BadRequest:
        gw.metrics.router_feedback.labels("invalid").inc()
        raise
    entry = {"prompt": sample["prompt"], "prompt_tokens": sample["prompt_tokens"], "engine": sample["engine"],
             "small": sample["small"], "large": sample["large"], "router_score": sample.get("score"),
             "score": score, "preferred_engine": preferred, "label": label, "source": "feedback",
             "key_id": key.key_id, "time": time.time()}
    try:
        new = await store.put_label(key.tenant, request_id_of(rid), entry)
    except Exception as e:  # noqa: BLE001
        raise Unavailable("Feedback cannot be stored right now; retry", code="store_unavailable") from e
    gw.metrics.router_feedback.labels("labelled" if label is not None else "no_signal").inc()
    return JSONResponse({"object": "feedback", "response_id": rid, "engine": sample["engine"], "label": label,
                         "stored": "created" if new else "replaced"})
