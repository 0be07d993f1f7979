"""Integers, times and cursors as they arrive at the HTTP edge (query, path, header, form field).

    limit = parse_int(q.get("limit"), "limit", default=100, minimum=1, maximum=1000)   # 400 when bad
    start = parse_time(q["start"], "start", now=now, relative=True)                   # 400 when bad
    ms, seq = parse_stream_id("1700000000000-3")                                      # ValueError
    json.loads(body, parse_int=json_int)                       # no integer literal of 4,300 digits
    read_int(text, 1), read_time(text, now, relative=True)    # the same, ValueError (the CLIs)

One reader for every such value, so every route refuses the same things with the same 400:
  - only ASCII digits: str.isdigit() also accepts "²" or "৩", which int() then refuses (or,
    for some scripts, reads), and a 500 is what the old isdigit()+int() pairs gave;
  - a bounded number of digits, checked before int(): Python refuses to convert more than 4,300
    digits (ValueError) and would spend quadratic time getting there;
  - times finite and within the range a datetime can show (no nan, inf, 1e300 or negatives).
Every failure is a BadRequest (OpenAI-style JSON) naming the parameter.
"""
from __future__ import annotations

import math
import re
import time
from datetime import datetime, timezone

from tokenyard.gateway.edge.errors import BadRequest

MAX_DIGITS = 19                           # any count, version or limit fits; 2**63 has 19 digits
_INT = re.compile(r"[+-]?[0-9]{1,%d}" % MAX_DIGITS)
_NUMBER = re.compile(r"[+-]?([0-9]{1,20}(\.[0-9]{0,9})?|\.[0-9]{1,9})")
_RELATIVE = re.compile(r"([0-9]{1,6})([mhdw])")
_UNIT_S = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_TIME = 253402300799.0                 # 9999-12-31T23:59:59Z: the last second datetime can show
MAX_STREAM_PART = 2**64 - 1               # a Redis stream id is two unsigned 64-bit numbers


def read_int(text: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """An ASCII decimal integer in [minimum, maximum]; ValueError (a readable message) otherwise."""
    text = text.strip()
    if not _INT.fullmatch(text):
        raise ValueError(f"must be an integer{_range(minimum, maximum)}")
    value = int(text)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"must be an integer{_range(minimum, maximum)}, got {value}")
    return value


def _range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in {minimum}..{maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def read_time(text: str, now: float | None = None, relative: bool = False) -> float:
    """Unix seconds (0 .. year 9999), an ISO 8601 date or date-time (UTC unless an offset is
    given), or with relative=True a span before now: "30m", "12h", "7d", "2w". ValueError otherwise."""
    v = text.strip()
    if not v.isascii():
        raise ValueError("must be unix seconds or an ISO 8601 date/time")
    if relative:
        m = _RELATIVE.fullmatch(v)
        if m:
            now = time.time() if now is None else now
            return _in_range(now - int(m.group(1)) * _UNIT_S[m.group(2)])
    if _NUMBER.fullmatch(v):
        return _in_range(float(v))
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text[:40]!r} is neither unix seconds nor an ISO 8601 date/time") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    try:
        return _in_range(dt.timestamp())
    except OverflowError:   # 0001-01-01 with a +offset falls before datetime's range
        raise ValueError("is out of range") from None


def _in_range(value: float) -> float:
    if not math.isfinite(value) or not 0 <= value <= MAX_TIME:
        raise ValueError(f"must lie between 1970 and 9999 (unix seconds 0..{int(MAX_TIME)})")
    return value


def parse_int(raw: str | None, param: str, *, default: int | None = None, minimum: int | None = None,
              maximum: int | None = None, code: str = "invalid_integer") -> int | None:
    """read_int at the edge: `default` when absent, a 400 naming `param` when wrong."""
    if raw is None:
        return default
    try:
        return read_int(raw, minimum, maximum)
    except ValueError as e:
        raise BadRequest(f"{param} {e}", param=param, code=code) from None


def parse_time(raw: str, param: str, *, now: float | None = None, relative: bool = False,
               code: str = "invalid_time") -> float:
    """read_time at the edge: a 400 naming `param` when wrong."""
    try:
        return read_time(raw, now, relative)
    except ValueError as e:
        raise BadRequest(f"{param}: {e}", param=param, code=code) from None


MAX_JSON_INT_DIGITS = 40   # far above any seed, token count or version; Python refuses 4,300+ anyway


def json_int(text: str) -> int:
    """json.loads(..., parse_int=json_int): an integer literal too long for any parameter is a
    ValueError before int() spends quadratic time on it (callers answer 400 invalid_json)."""
    if len(text) > MAX_JSON_INT_DIGITS + 1:
        raise ValueError(f"an integer literal of {len(text)} characters is too long")
    return int(text)


def parse_stream_id(raw: str) -> tuple[int, int]:
    """"<ms>-<seq>" as Redis stream ids are written; ValueError when it is not one Redis could take
    (so a forged cursor is a 400 here, not a Redis error and a 503 later)."""
    ms, dash, seq = raw.partition("-")
    if not dash or not _digits(ms) or not _digits(seq):
        raise ValueError("not a stream id")
    a, b = int(ms), int(seq)
    if a > MAX_STREAM_PART or b > MAX_STREAM_PART:
        raise ValueError("stream id out of range")
    return a, b


def _digits(text: str) -> bool:
    return 0 < len(text) <= 20 and text.isascii() and text.isdigit()
