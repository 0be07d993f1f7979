"""Upload file names are display names, never paths (tokenyard/gateway/batch/file_names.py): the basename, no
control or format characters, valid UTF-8, at most 255 bytes, a fallback when nothing is left; and
a refused upload's 400 names the expected field instead of echoing an object's repr."""
from __future__ import annotations

import json
import unicodedata

import pytest
from batch_helpers import batch_gateway, chat_line, client, jsonl

from tokenyard.gateway.batch.file_names import FALLBACK, MAX_BYTES, safe_filename

BODY = jsonl([chat_line("a")])


@pytest.fixture(scope="module")
def srv():
    with batch_gateway(output_len=2) as s:
        yield s


def _multipart(parts: list[tuple[bytes, bytes]], boundary: bytes = b"tyb0undary") -> tuple[bytes, dict[str, str]]:
    """parts: (Content-Disposition parameters after form-data;, content), raw bytes as a client may send."""
    body = b"".join(b"--" + boundary + b"\r\nContent-Disposition: form-data; " + disp + b"\r\n\r\n" + content + b"\r\n"
                    for disp, content in parts) + b"--" + boundary + b"--\r\n"
    return body, {"Content-Type": "multipart/form-data; boundary=" + boundary.decode()}


def _upload(srv, filename: bytes, purpose: bytes = b"batch") -> tuple[int, dict]:
    body, headers = _multipart([(b'name="purpose"', purpose), (b'name="file"; filename="' + filename + b'"', BODY)])
    status, _, raw = srv.request("POST", "/v1/files", body, headers)
    return status, json.loads(raw)


def _clean(name: str) -> bool:
    return (name and "/" not in name and "\\" not in name and len(name.encode("utf-8")) <= MAX_BYTES
            and not any(unicodedata.category(ch) in ("Cc", "Cf", "Cs") for ch in name))


@pytest.mark.parametrize("sent, stored", [
    ("requests.jsonl", "requests.jsonl"),
    ("../../x", "x"),
    ("/etc/passwd", "passwd"),
    ("..\\..\\windows\\win.ini", "win.ini"),
    ("dir/", FALLBACK),
    ("..", FALLBACK),
    ("", FALLBACK),
    (None, FALLBACK),
    ("a\x00b\r\n\t.jsonl", "ab.jsonl"),
    ("evil\u202egnp.jsonl", "evilgnp.jsonl"),          # a bidi override that reverses the shown text
    ("bad\udcffname.jsonl", "badname.jsonl"),           # a lone surrogate (undecodable bytes)
    ("  spaced.jsonl  ", "spaced.jsonl"),
    ("cafe\u0301.jsonl", "caf\u00e9.jsonl"),            # NFC
])
def test_safe_filename(sent, stored):
    assert safe_filename(sent) == stored
    assert safe_filename(stored) == stored              # idempotent: a stored name is cleaned again on read


def test_long_names_are_cut_to_255_utf8_bytes_keeping_the_extension():
    name = safe_filename("\u00e9" * 300 + ".jsonl")     # 2 bytes per character
    assert name.endswith(".jsonl") and len(name.encode("utf-8")) <= MAX_BYTES and name.startswith("\u00e9")
    assert safe_filename("x" * 1000) == "x" * MAX_BYTES
    assert safe_filename(name) == name


@pytest.mark.parametrize("sent, stored", [
    (b"../../x", "x"),
    (b"..%2F..%2Fy.jsonl", "..%2F..%2Fy.jsonl"),         # not decoded: no separator appears
    (b"a\\b\\c.jsonl", "c.jsonl"),
    (b"nul\x00in.jsonl", None),                           # whatever the parser keeps: never the NUL
    (b"caf\xe9\x85\xff.jsonl", None),                     # not UTF-8
    (b"line\x1b[31mred.jsonl", "line[31mred.jsonl"),      # an ANSI escape loses its ESC
    (b"x" * 600 + b".jsonl", None),
])
def test_uploaded_names_are_stored_and_echoed_clean(srv, sent, stored):
    status, body = _upload(srv, sent)
    assert status == 200, body
    name = body["filename"]
    assert _clean(name), name
    if stored is not None:
        assert name == stored
    c = client(srv)
    assert c.files.retrieve(body["id"]).filename == name
    assert name in {f.filename for f in c.files.list().data}


def test_a_file_part_named_purpose_is_refused_without_its_repr(srv):
    body, headers = _multipart([(b'name="purpose"; filename="secret-name.txt"', b"batch"), (b'name="file"', BODY)])
    status, _, raw = srv.request("POST", "/v1/files", body, headers)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "purpose" and err["code"] == "invalid_purpose"
    assert "UploadFile" not in err["message"] and "secret-name" not in err["message"] and "Headers" not in err["message"]
    assert "purpose" in err["message"] and "file part" in err["message"]


def test_a_text_field_named_file_names_the_field(srv):
    body, headers = _multipart([(b'name="purpose"', b"batch"), (b'name="file"', BODY)])
    status, _, raw = srv.request("POST", "/v1/files", body, headers)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "file" and err["code"] == "missing_file"
    assert "custom_id" not in err["message"]               # the content is not echoed either


def test_a_wrong_purpose_is_quoted_short_and_printable(srv):
    status, body = _upload(srv, b"f.jsonl", purpose=b"fine-tune\x1b" + b"z" * 500)
    err = body["error"]
    assert status == 400 and err["param"] == "purpose"
    assert "\x1b" not in err["message"] and "z" * 41 not in err["message"] and '"fine-tune?' in err["message"]
    status, _, raw = srv.request("POST", "/v1/files", *_multipart([(b'name="file"; filename="f.jsonl"', BODY)]))
    assert status == 400 and "missing" in json.loads(raw)["error"]["message"]
