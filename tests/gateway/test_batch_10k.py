"""10,000 lines in one batch on the mock engine: every custom_id answered exactly once, in input
order, and every line run exactly once (one usage record each)."""
from __future__ import annotations

from batch_helpers import batch_gateway, chat_line, client, jsonl, read_lines, wait_batch

N = 10_000


def test_ten_thousand_lines_each_answered_once():
    records: list = []
    settings = {"max_file_bytes": 8 << 20, "max_in_flight": 64, "start_gap_ms": 0, "max_loop_lag_ms": 0}
    with batch_gateway(settings, usage_sink=records.append, output_len=2) as srv:
        c = client(srv)
        f = c.files.create(file=("big.jsonl", jsonl([chat_line(f"id-{i}", f"q {i}") for i in range(N)])),
                           purpose="batch")
        assert c.files.retrieve(f.id).bytes == f.bytes
        done = wait_batch(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                              completion_window="24h").id, timeout=120)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (N, N, 0)
        assert done.error_file_id is None
        out = read_lines(c, done.output_file_id)
        assert [x["custom_id"] for x in out] == [f"id-{i}" for i in range(N)]
        assert all(x["response"]["status_code"] == 200 for x in out)
        ran = [r for r in records if r.client_request_id.startswith(done.id)]
        assert len(ran) == N and len({r.client_request_id for r in ran}) == N
        assert all(r.status == "ok" for r in ran)
