"""A batch's input file lives as long as any open batch reads it (issue 46.3), and a batch whose input
is gone anyway ends instead of being retried for ever.

The attack that used to work: upload F, batch A running on F, batch B on F cancelled, DELETE F (200:
only B, the latest user, was recorded), cancel A -> A stayed `cancelling` across restarts, its
charged answers never downloadable, a FileNotFoundError traceback logged on every poll."""
from __future__ import annotations

import logging
import os
import time

import openai
import pytest
import redis
from batch_helpers import batch_gateway, chat_line, client, jsonl, read_lines, wait_batch
from gateway_helpers import SHARED_REDIS, delete_prefix, unique_prefix

N = 12
IDS = [f"q{i}" for i in range(N)]


def _upload(c: openai.OpenAI) -> str:
    return c.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in IDS])), purpose="batch").id


def _create(c: openai.OpenAI, file_id: str) -> str:
    return c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id


def _wait_completed(c: openai.OpenAI, batch_id: str, at_least: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while c.batches.retrieve(batch_id).request_counts.completed < at_least:
        assert time.monotonic() < deadline, "no line was answered"
        time.sleep(0.02)


def _users(srv, file_id: str) -> set[bytes]:
    return redis.Redis.from_url(SHARED_REDIS).smembers(f"{srv.prefix}file:{file_id}:users")


def test_a_file_read_by_any_open_batch_cannot_be_deleted():
    # ~2 s a line, two at a time: A is still running while B is created, cancelled and F deleted.
    with batch_gateway({"max_in_flight": 2}, output_len=40, token_ms=50) as srv:
        c = client(srv)
        f = _upload(c)
        a = _create(c, f)
        wait_batch(c, a, ("in_progress",))
        b = _create(c, f)
        with pytest.raises(openai.ConflictError) as e:      # both open: both named
            c.files.delete(f)
        err = e.value.body
        assert err["code"] == "file_in_use" and err["param"] == "file_id" and a in err["message"] and b in err["message"]
        t0 = time.monotonic()
        c.batches.cancel(b)
        assert wait_batch(c, b).status == "cancelled"
        # B waited for a slot that A's lines held: the cancel ends that wait, not A's next line (2 s).
        assert time.monotonic() - t0 < 1.5
        with pytest.raises(openai.ConflictError) as e:      # B ended, A still reads F: still a 409, naming A only
            c.files.delete(f)
        assert a in e.value.body["message"] and b not in e.value.body["message"]
        assert c.files.retrieve(f).id == f
        assert _users(srv, f) == {a.encode()}                # B left the set when it reached cancelled
        _wait_completed(c, a, 1)                             # A has charged answers to hand back
        c.batches.cancel(a)
        done = wait_batch(c, a, timeout=20)
        assert done.status == "cancelled" and done.errors is None
        out, errs = read_lines(c, done.output_file_id), read_lines(c, done.error_file_id)
        assert sorted(x["custom_id"] for x in out + errs) == sorted(IDS)     # every line answered once
        assert out and all(x["response"]["status_code"] == 200 for x in out)
        assert _users(srv, f) == set()
        assert c.files.delete(f).deleted                     # no open reader left
        with pytest.raises(openai.NotFoundError):            # and no batch can start on it any more
            _create(c, f)


def test_a_completed_batch_releases_its_input():
    with batch_gateway(output_len=2) as srv:
        c = client(srv)
        f = _upload(c)
        assert wait_batch(c, _create(c, f)).status == "completed"
        assert _users(srv, f) == set()
        assert c.files.delete(f).deleted


def test_cancel_with_the_input_gone_ends_the_batch_and_keeps_its_answers(caplog):
    caplog.set_level(logging.DEBUG, logger="tokenyard.batch")
    with batch_gateway({"max_in_flight": 2}, output_len=20, token_ms=20) as srv:
        c = client(srv)
        f = _upload(c)
        a = _create(c, f)
        _wait_completed(c, a, 2)
        os.remove(os.path.join(srv.data_dir, "dev", f))    # the disk lost it behind the gateway's back
        c.batches.cancel(a)
        done = wait_batch(c, a, timeout=15)
        assert done.status == "cancelled" and done.cancelled_at
        [error] = done.errors.data
        assert error.code == "input_file_missing" and f in error.message
        answered = done.request_counts.completed + done.request_counts.failed
        assert 2 <= done.request_counts.completed and answered < N
        assert f"{N - answered} of {N} requests have no answer" in error.message
        # The answers recorded (and charged) before the loss were written out and can be downloaded.
        assert len(read_lines(c, done.output_file_id)) == done.request_counts.completed
        time.sleep(0.5)                                     # several poll_s rounds: nothing more is logged
    mine = [r for r in caplog.records if a in r.getMessage()]
    assert len(mine) == 1 and mine[0].levelno == logging.WARNING and not mine[0].exc_info, \
        [r.getMessage() for r in mine]


def test_a_resumed_batch_whose_input_is_gone_fails_with_its_answers():
    """The gateway stops mid-batch; the input is lost meanwhile; the next gateway claims the batch:
    it fails at once (not in_progress for ever), with the lines answered before downloadable."""
    prefix, data_dir = unique_prefix("batch-gone"), None
    settings = {"max_in_flight": 2}
    try:
        with batch_gateway(settings, prefix=prefix, output_len=20, token_ms=20) as first:
            data_dir = first.data_dir
            c = client(first)
            f = _upload(c)
            a = _create(c, f)
            _wait_completed(c, a, 2)
        os.remove(os.path.join(data_dir, "dev", f))
        with batch_gateway(settings, prefix=prefix, data_dir=data_dir, output_len=20, token_ms=20) as second:
            c = client(second)
            done = wait_batch(c, a, timeout=15)
            assert done.status == "failed" and done.failed_at
            assert done.errors.data[0].code == "input_file_missing"
            counts = done.request_counts
            assert counts.total == N and counts.completed >= 2 and counts.completed + counts.failed < N
            out = read_lines(c, done.output_file_id)
            assert len(out) == counts.completed and {x["custom_id"] for x in out} <= set(IDS)
            assert redis.Redis.from_url(SHARED_REDIS).scard(f"{prefix}file:{f}:users") == 0
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def test_create_and_delete_racing_never_both_succeed():
    """A batch created on F while F is deleted: either the batch exists and the DELETE is a 409, or
    the DELETE wins and the create is a 404; never a batch left without its input."""
    import threading
    with batch_gateway({"max_in_flight": 1}, output_len=40, token_ms=50) as srv:
        c = client(srv)
        outcomes = []
        for _ in range(15):
            f = _upload(c)
            gate = threading.Barrier(2)
            got: dict[str, object] = {}

            def create(f=f, gate=gate, got=got):
                gate.wait()
                try:
                    got["create"] = _create(c, f)
                except openai.NotFoundError:
                    got["create"] = 404

            def delete(f=f, gate=gate, got=got):
                gate.wait()
                try:
                    got["delete"] = c.files.delete(f).deleted
                except openai.ConflictError:
                    got["delete"] = 409

            threads = [threading.Thread(target=create), threading.Thread(target=delete)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert (got["create"] == 404) == (got["delete"] is True), got
            if got["create"] != 404:
                c.batches.cancel(got["create"])
            outcomes.append(got["delete"])
        assert outcomes                                      # which one wins each round is up to the race
