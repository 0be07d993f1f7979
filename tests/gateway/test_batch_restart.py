"""A gateway killed in the middle of a 10,000-line batch: a new gateway on the same Redis and data
folder takes the batch over once the dead one's lease lapses, runs only the lines that have no
answer, and the output has every custom_id exactly once.

The kill: every task of the first gateway's batch runner is cancelled at once, without the orderly
stop (which would hand its lease back): what Redis and the disk hold is then what a crash leaves,
including lines cut short in the engine. The first gateway keeps serving HTTP, but nothing of it
runs batches any more."""
from __future__ import annotations

import tempfile
import time

import redis
from batch_helpers import batch_gateway, chat_line, client, jsonl, read_lines, wait_batch
from gateway_helpers import SHARED_REDIS, delete_prefix, unique_prefix

N = 10_000


def _kill_runner(srv) -> None:
    runner = srv.gateway.batch.runner
    loop = runner._loop_task.get_loop()

    def kill() -> None:
        for task in [runner._loop_task, *(r.task for r in runner._runs.values())]:
            task.cancel()

    loop.call_soon_threadsafe(kill)
    deadline = time.monotonic() + 10
    while runner._runs or not runner._loop_task.done():
        assert time.monotonic() < deadline, "the runner did not stop"
        time.sleep(0.01)
        loop.call_soon_threadsafe(kill)


def test_killed_mid_batch_resumes_and_answers_each_line_once():
    prefix, data_dir = unique_prefix("batch-restart"), tempfile.mkdtemp(prefix="tytest-batch-")
    settings = {"max_file_bytes": 8 << 20, "max_in_flight": 64, "start_gap_ms": 0, "max_loop_lag_ms": 0, "lease_s": 1.0}
    first: list = []
    second: list = []
    try:
        with batch_gateway(settings, usage_sink=first.append, prefix=prefix, data_dir=data_dir,
                           output_len=2) as a:
            c = client(a)
            f = c.files.create(file=("big.jsonl", jsonl([chat_line(f"id-{i}", f"q {i}") for i in range(N)])),
                               purpose="batch")
            batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            deadline = time.monotonic() + 60
            while c.batches.retrieve(batch.id).request_counts.completed < 2_000:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            _kill_runner(a)
            answers = redis.Redis.from_url(SHARED_REDIS).hlen(f"{prefix}batch:{batch.id}:answers")
            assert 2_000 <= answers < N, answers
            assert c.batches.retrieve(batch.id).status == "in_progress"
            cut = [r for r in first if r.status != "ok"]          # lines in flight when it died
            assert len([r for r in first if r.status == "ok"]) == answers
            with batch_gateway(settings, usage_sink=second.append, prefix=prefix, data_dir=data_dir,
                               output_len=2) as b:
                c2 = client(b)
                done = wait_batch(c2, batch.id, timeout=120)
                assert done.status == "completed"
                assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == \
                    (N, N, 0)
                out = read_lines(c2, done.output_file_id)
                assert [x["custom_id"] for x in out] == [f"id-{i}" for i in range(N)]
                # The second gateway ran exactly the lines without an answer: none twice, none dropped.
                assert len(second) == N - answers
                assert {r.client_request_id for r in second}.isdisjoint(
                    {r.client_request_id for r in first if r.status == "ok"})
                assert {r.client_request_id for r in cut} <= {r.client_request_id for r in second}
    finally:
        delete_prefix(SHARED_REDIS, prefix)
