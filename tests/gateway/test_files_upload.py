"""POST /v1/files and friends: a malformed JSONL line is a 400 naming the line, an oversize file a 413
(also when the client sends no Content-Length), and nothing refused is stored; list, content and
delete (not while an open batch reads the file)."""
from __future__ import annotations

import http.client
import json
import os

import openai
import pytest
from batch_helpers import batch_gateway, chat_line, client, jsonl, wait_batch

GOOD = chat_line("a")


@pytest.fixture(scope="module")
def srv():
    with batch_gateway({"max_file_bytes": 4096, "max_lines": 5}, output_len=3) as s:
        yield s


def _stored_files(srv) -> list[str]:
    return [name for _, _, names in os.walk(srv.data_dir) for name in names]


@pytest.mark.parametrize("lines, line_no, code, words", [
    ([GOOD, "{not json", GOOD], 2, "invalid_jsonl", "is not valid JSON"),
    ([GOOD, GOOD.replace('"a"', '"b"'), "[1, 2]"], 3, "invalid_batch_line", "must be a JSON object"),
    ([json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}})], 1, "invalid_batch_line",
     "custom_id"),
    ([GOOD, GOOD], 2, "duplicate_custom_id", "repeats custom_id 'a'"),
    ([chat_line("a", url="/v1/moderations")], 1, "invalid_batch_line", "url must be one of"),
    ([GOOD.replace('"POST"', '"GET"')], 1, "invalid_batch_line", "method must be"),
    ([json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "x"})], 1,
     "invalid_batch_line", "body must be a JSON object"),
    ([json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}, "x": 1})], 1,
     "invalid_batch_line", "unknown key(s) x"),
    ([GOOD, "", chat_line("c")], 2, "invalid_jsonl", "is empty"),
    ([chat_line(f"r{i}") for i in range(6)], 6, "too_many_lines", "at most 5 requests"),
])
def test_malformed_lines_are_refused_naming_the_line(srv, lines, line_no, code, words):
    before = _stored_files(srv)
    with pytest.raises(openai.BadRequestError) as e:
        client(srv).files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    err = e.value.body
    assert err["code"] == code and err["param"] == "file", err
    assert err["message"].startswith(f"Line {line_no} ") and words in err["message"], err["message"]
    assert _stored_files(srv) == before


def test_not_utf8_and_empty_files(srv):
    c = client(srv)
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", GOOD.encode() + b"\n\xff\xfe\n"), purpose="batch")
    assert e.value.body["message"].startswith("Line 2 is not valid UTF-8")
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", b""), purpose="batch")
    assert e.value.body["code"] == "empty_file"
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", jsonl([GOOD])), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"


def test_oversize_file_is_413(srv):
    big = jsonl([chat_line(f"r{i}", "x" * 900) for i in range(5)])
    assert len(big) > 4096
    with pytest.raises(openai.APIStatusError) as e:
        client(srv).files.create(file=("big.jsonl", big), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    assert "4096" in e.value.body["message"]


def test_oversize_upload_without_content_length_is_cut_short(srv):
    """Chunked transfer: no Content-Length to refuse up front; the byte counter stops it."""
    boundary = "tyboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/files")
        conn.putheader("Authorization", "Bearer test-key")
        conn.putheader("Content-Type", f"multipart/form-data; boundary={boundary}")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        sent = 0
        try:
            for chunk in [head] + [b"x" * 16384] * 64:      # 1 MiB, far over 4 KiB + the form's allowance
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            conn.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass            # the server answered and closed before the rest: what we want
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 413 and body["error"]["code"] == "file_too_large"


def test_not_multipart_is_400(srv):
    status, _, body = srv.request("POST", "/v1/files", {"purpose": "batch"})
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_content_type"


def test_list_content_and_delete(srv):
    c = client(srv)
    ids = [c.files.create(file=(f"f{i}.jsonl", jsonl([chat_line(f"x{i}")])), purpose="batch").id for i in range(3)]
    newest = c.files.list(limit=2)
    assert [f.id for f in newest.data] == ids[::-1][:2] and newest.has_more
    page2 = c.files.list(limit=2, after=newest.data[-1].id)
    assert page2.data[0].id == ids[0]
    assert [f.id for f in c.files.list(order="asc").data][-3:] == ids
    assert c.files.content(ids[0]).text == jsonl([chat_line("x0")]).decode()
    deleted = c.files.delete(ids[0])
    assert deleted.deleted and deleted.id == ids[0]
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        c.files.content(ids[0])


def test_input_of_an_open_batch_cannot_be_deleted():
    with batch_gateway({"max_in_flight": 1}, output_len=40, token_ms=25) as srv:
        c = client(srv)
        f = c.files.create(file=("in.jsonl", jsonl([chat_line(f"q{i}") for i in range(3)])), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        with pytest.raises(openai.ConflictError) as e:
            c.files.delete(f.id)
        assert e.value.body["code"] == "file_in_use" and b.id in e.value.body["message"]
        c.batches.cancel(b.id)
        wait_batch(c, b.id)
        assert c.files.delete(f.id).deleted
