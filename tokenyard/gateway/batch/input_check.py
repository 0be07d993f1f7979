"""The check of a Batch API input file at upload: JSONL with one request per line, in OpenAI's shape

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Each line is one JSON object (UTF-8, at most limits.max_body_bytes, the edge's depth and surrogate
rules) with a unique non-empty `custom_id`, `method` POST, `url` one of ENDPOINTS and an object
`body`; at most batch.max_lines lines. The first bad line is refused with a 400 that names it
("Line 7: ..."), so nothing malformed is ever stored. The body itself (model, messages, ...) is
checked when the line runs, by the endpoint's own parser: a bad body goes to the batch's error
file and the batch goes on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import BinaryIO

from tokenyard.gateway.edge.errors import BadRequest
from tokenyard.gateway.http.completion_flow import decode_json

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
MAX_CUSTOM_ID = 512
_KEYS = {"custom_id", "method", "url", "body"}


@dataclass(slots=True)
class InputSummary:
    lines: int = 0
    first_line_of: dict[str, int] = field(default_factory=dict)   # url -> the first line (1-based) using it


def check_batch_input(f: BinaryIO, max_lines: int, max_line_bytes: int, max_depth: int) -> InputSummary:
    """Blocking (reads the file); raises BadRequest naming the first bad line."""
    out = InputSummary()
    seen: set[str] = set()
    f.seek(0)
    number = 0
    while True:
        raw = f.readline(max_line_bytes + 2)
        if not raw:
            break
        number += 1
        line = raw.rstrip(b"\r\n") if raw.endswith(b"\n") else raw
        if len(line) > max_line_bytes:
            raise _bad(number, f"is longer than {max_line_bytes} bytes (limits.max_body_bytes)", "line_too_large")
        if not raw.endswith(b"\n") and f.read(1):   # readline stopped at its size cap, not at a newline
            raise _bad(number, f"is longer than {max_line_bytes} bytes (limits.max_body_bytes)", "line_too_large")
        if not line.strip():
            raise _bad(number, "is empty; every line must be one request object", "invalid_jsonl")
        if out.lines >= max_lines:
            raise _bad(number, f"is one too many: a batch holds at most {max_lines} requests (batch.max_lines)",
                       "too_many_lines")
        try:
            obj = decode_json(line, max_depth, what=f"Line {number}")
        except BadRequest as e:
            e.param, e.code = "file", "invalid_jsonl"
            raise
        custom_id = _check_request(obj, number)
        if custom_id in seen:
            raise _bad(number, f"repeats custom_id {custom_id!r}; each line needs its own", "duplicate_custom_id")
        seen.add(custom_id)
        out.lines += 1
        out.first_line_of.setdefault(obj["url"], number)
    if out.lines == 0:
        raise BadRequest("The file has no lines; a batch input file needs at least one request", param="file",
                         code="empty_file")
    return out


def _check_request(obj: object, number: int) -> str:
    if not isinstance(obj, dict):
        raise _bad(number, f"must be a JSON object, got {type(obj).__name__}", "invalid_batch_line")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise _bad(number, f"has unknown key(s) {', '.join(unknown)}; a line has custom_id, method, url and body",
                   "invalid_batch_line")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise _bad(number, f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters",
                   "invalid_batch_line")
    if obj.get("method") != "POST":
        raise _bad(number, f"method must be \"POST\", got {obj.get('method')!r}", "invalid_batch_line")
    if obj.get("url") not in ENDPOINTS:
        raise _bad(number, f"url must be one of {', '.join(ENDPOINTS)}, got {obj.get('url')!r}", "invalid_batch_line")
    if not isinstance(obj.get("body"), dict):
        raise _bad(number, "body must be a JSON object (the request's body)", "invalid_batch_line")
    return custom_id


def _bad(number: int, what: str, code: str) -> BadRequest:
    return BadRequest(f"Line {number} {what}", param="file", code=code)
