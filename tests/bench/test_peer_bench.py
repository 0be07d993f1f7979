"""The peer harness's pure parts (tokenyard/bench/peers/peer_bench.py): parsing llama-bench's JSON, the SSE
lines of a streamed /v1/completions, spreads and served figures. llama.cpp is never built or run."""
from __future__ import annotations

import json
import math

import pytest

from tokenyard.bench.peers import models as pm
from tokenyard.bench.peers import peer_bench as pb
from tokenyard.bench.serving_metrics import RequestRecord

# The fields llama-bench -o json writes per test that the harness reads (values made up).
_ENTRY = {"build_commit": "abc1234", "build_number": 1, "cpu_info": "x86", "model_type": "llama ?B all F32",
          "model_size": 123967488, "model_n_params": 30998528, "n_threads": 2, "type_k": "f16",
          "flash_attn": False, "n_prompt": 512, "n_gen": 0, "avg_ns": 1, "stddev_ns": 0, "avg_ts": 5500.5,
          "stddev_ts": 12.25, "samples_ns": [1, 2], "samples_ts": [5490.0, 5511.0]}


def test_parse_llama_bench_skips_leading_log_lines_and_labels_tests():
    tg = {**_ENTRY, "n_prompt": 0, "n_gen": 128, "avg_ts": 620.0, "samples_ts": [620.0]}
    text = "load_backend: loaded CPU backend\n" + json.dumps([_ENTRY, tg], indent=2)
    rows = pb.parse_llama_bench(text)
    assert [r["test"] for r in rows] == ["pp512", "tg128"]
    assert rows[0]["tok_s"] == 5500.5 and rows[0]["samples_tok_s"] == [5490.0, 5511.0]
    assert rows[0]["n_threads"] == 2 and rows[0]["build_commit"] == "abc1234"
    assert rows[1]["tok_s"] == 620.0


def test_llama_bench_label_of_a_combined_test():
    assert pb.llama_bench_test({"n_prompt": 512, "n_gen": 128}) == "pp512+tg128"


def test_parse_llama_bench_without_json_fails():
    with pytest.raises(ValueError):
        pb.parse_llama_bench("error: failed to load model\n")


def test_spread():
    s = pb.spread([3.0, 1.0, 2.0, float("nan")])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert pb.spread([])["median"] is None


def test_sse_events_and_text():
    assert pb.sse_event(b"data: [DONE]\n") == "DONE"
    assert pb.sse_event(": keep-alive") is None and pb.sse_event("") is None
    assert pb.sse_event("data: {not json") is None
    ev = pb.sse_event('data: {"choices": [{"text": " w300", "index": 0}]}')
    assert isinstance(ev, dict) and pb.event_text(ev) == " w300"
    assert pb.event_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert pb.event_text({"choices": [{"delta": {"content": "x"}}]}) == "x"


def test_served_figures_counts_only_requested_tokens():
    recs = [RequestRecord(ok=True, ttft=0.1 * i, itls=[0.01, 0.02], e2e=1.0, output_tokens=3) for i in (1, 2)]
    recs.append(RequestRecord(ok=False, status=500, error="boom"))
    f = pb.served_figures(recs, duration_s=2.0, expected_tokens=5)
    assert f["completed"] == 2 and f["failed"] == 1
    assert f["useful_output_tok_s"] == 2.5                 # min(6 sent, 5 asked) / 2 s
    assert math.isclose(f["ttft_p50_ms"], 150.0)
    assert math.isclose(f["itl_p50_ms"], 15.0)


def test_table_renders_medians_ranges_and_ratios():
    fig = {"config": "w2",
           "decode_tg128_tok_s": {"llama.cpp": pb.spread([600.0, 620.0, 610.0]),
                                  "tokenyard_fp32": pb.spread([120.0, 130.0, 122.0])},
           "served": {"requests": 96, "by_server": {"tokenyard_fp32": {
               "concurrency_96": {"useful_output_tok_s": pb.spread([800.0]), "failed_total": 0},
               "concurrency_32": {k: pb.spread([10.0]) for k in ("useful_output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
                                                                 "itl_p50_ms", "itl_p99_ms")} | {"failed_total": 1}}}}}
    text = pb.table(fig)
    assert "| 610.0 (600.0-620.0) | 122.0 (120.0-130.0) | 0.20x |" in text
    assert "| tokenyard_fp32 | 800 (800-800) | 10 (10-10) |" in text and text.rstrip().endswith("| 1 |")


def test_placeholder_vocab_has_exactly_the_model_vocab():
    v = pm.placeholder_vocab(8192)
    assert len(v) == len(set(v)) == 8192
    assert v[:3] == ["<unk>", "<s>", "</s>"] and v[3] == "<0x00>" and v[258] == "<0xFF>"
    with pytest.raises(ValueError):
        pm.placeholder_vocab(100)


def test_missing_binaries_say_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setattr(pm, "LLAMA_BIN", tmp_path)
    with pytest.raises(pm.PeerSetupError, match="build_llama_cpp.sh"):
        pm.llama_binary("llama-bench")


def test_cpu_busy_fraction_from_proc_stat_deltas():
    before = [100, 0, 50, 800, 50, 0, 0, 0]
    after = [150, 0, 100, 850, 100, 0, 0, 0]        # +50 user, +50 system, +50 idle, +50 iowait
    assert pb.cpu_busy_fraction(before, after) == 0.5
    assert pb.cpu_busy_fraction(before, before) == 0.0


def test_served_runs_per_server():
    assert pb.concurrencies_for(None, 96) == [96, 32]          # Tokenyard: all at once, then 32 clients
    assert pb.concurrencies_for(32, 96) == [96, 32]
    assert pb.concurrencies_for(96, 96) == [96]                 # 32 clients on 96 slots = the 32-slot case
    assert pb.concurrencies_for(32, 32) == [32]                 # all at once is 32 clients already


def test_served_gap_variants_parse_names_and_environment():
    from tokenyard.bench.served_gap import parse_variant
    assert parse_variant("default") == ("default", {})
    assert parse_variant("spin:TOKENYARD_STEP_SPIN=2000,OMP_WAIT_POLICY=PASSIVE") == (
        "spin", {"TOKENYARD_STEP_SPIN": "2000", "OMP_WAIT_POLICY": "PASSIVE"})
    for bad in (":A=1", "x:A", "x:=1"):
        with pytest.raises(ValueError):
            parse_variant(bad)
