"""UsageRecord.to_dict (the dict the ledger, the spool and the sinks get) equals dataclasses.asdict
and shares no container with the record, without asdict's recursive deep copy."""
from __future__ import annotations

from dataclasses import asdict, fields

from tokenyard.gateway.spend.usage import UsageRecord, compact, expand


def _record() -> UsageRecord:
    return UsageRecord(request_id="r1", time=1.5, engine="big", requested_model="auto", route_reason="router",
                       prompt_tokens=10, cached_tokens=2, completion_tokens=5, cost_micros=7, status="ok",
                       finish_reason="stop", ttft_s=0.1, e2e_s=0.3, stream=True, tags={"team": "a"},
                       prices=[1, 2, 3], choice_completion_tokens=[2, 3],
                       engine_state={"big": {"predicted_ttft_ms": 1.0, "healthy": True}}, usage_estimated=True)


def test_to_dict_equals_asdict_and_copies_every_container():
    rec = _record()
    got = rec.to_dict()
    assert got == asdict(rec) and list(got) == [f.name for f in fields(UsageRecord)]
    for name, value in got.items():
        if isinstance(value, (dict, list)):
            assert value is not getattr(rec, name), name       # a copy: a sink may change it
    got["engine_state"]["big"]["healthy"] = False
    assert rec.engine_state["big"]["healthy"] is True


def test_compact_then_expand_is_the_record():
    d = _record().to_dict()
    assert expand(compact(d)) == d
    assert "batch" not in compact(d) and compact(d)["usage_estimated"] is True
