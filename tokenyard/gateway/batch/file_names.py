"""The file name an upload is stored and echoed under: a display name, never a path.

    safe_filename("../../etc/passwd")        -> "passwd"
    safe_filename("a\\x00b\\r\\n.jsonl")     -> "ab.jsonl"
    safe_filename(None) / ("") / ("..")      -> "upload.jsonl"

The multipart parser hands over whatever the client put in Content-Disposition: path segments,
NUL and other control characters, bidi overrides, bytes that were not UTF-8 (decoded as latin-1 by
Starlette, or lone surrogates from other decoders). The name is only metadata (the bytes live under
the random file id, file_storage.py), but it is echoed in JSON, listings and the dashboard, where a
path or a control character misleads a reader or a client that saves the file under that name. So:
the last path segment (both `/` and `\\` separate), NFC, no characters of the Unicode categories
Cc/Cf/Cs/Co/Zl/Zp, no surrounding blanks, at most MAX_BYTES of UTF-8 (the extension kept), and
FALLBACK when nothing is left. Idempotent, so records stored before this rule are cleaned on read.
"""
from __future__ import annotations

import unicodedata

FALLBACK = "upload.jsonl"
MAX_BYTES = 255                 # a file name on common file systems
_DROP = {"Cc", "Cf", "Cs", "Co", "Zl", "Zp"}    # controls, format (bidi, zero width), surrogates, private use
_MAX_EXT = 16                   # a longer "extension" is part of the name, not kept when trimming


def safe_filename(name: object) -> str:
    if not isinstance(name, str):
        return FALLBACK
    # Drop the unencodable (lone surrogates) before NFC, which cannot handle them either.
    name = "".join(ch for ch in name if unicodedata.category(ch) != "Cs")
    name = unicodedata.normalize("NFC", name).replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if unicodedata.category(ch) not in _DROP).strip()
    if name in ("", ".", ".."):
        return FALLBACK
    return _bounded(name)


def _bounded(name: str) -> str:
    """At most MAX_BYTES of UTF-8, cut at a character boundary, keeping a short extension."""
    if len(name.encode("utf-8")) <= MAX_BYTES:
        return name
    stem, dot, ext = name.rpartition(".")
    if not dot or not stem or len(ext) > _MAX_EXT:
        stem, ext = name, ""
    tail = "." + ext if ext else ""
    room = MAX_BYTES - len(tail.encode("utf-8"))
    cut = stem.encode("utf-8")[:room].decode("utf-8", "ignore")
    return (cut.rstrip() or FALLBACK.rsplit(".", 1)[0]) + tail
