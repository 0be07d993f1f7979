"""Mixed steps (decoding rows and prompt tokens in one step) in the fleet's service curve: fitted from
timed mixed steps (`with_mixed`), read off by the simulator, and measured from a served replica's counters."""
from __future__ import annotations

import pytest

from tokenyard.bench.fleet.policies import StaticPolicy
from tokenyard.bench.fleet.service_curve import ServiceCurve, StepSample, with_mixed, with_prefill_table
from tokenyard.bench.fleet.simulator import SimConfig, simulate
from tokenyard.bench.fleet.trace import Request


def line() -> ServiceCurve:
    return ServiceCurve(base_s=0.002, per_seq_s=0.004, per_ctx_token_s=1e-5, per_prefill_token_s=0.001,
                        prefill_base_s=0.05, max_num_seqs=16)


def test_with_mixed_recovers_the_fixed_and_per_row_cost() -> None:
    curve = line()
    # Mixed steps that cost 30 ms more than their parts' base and prefill, and 2.5 ms a row (not 4).
    shapes = [(1, 50, 128), (4, 200, 128), (8, 400, 128), (12, 600, 320)]
    samples = [StepSample(r, c, p, curve.base_s + curve.prefill_seconds(p) + 0.030 + 0.0025 * r + 1e-5 * c)
               for r, c, p in shapes]
    got = with_mixed(curve, samples + [StepSample(4, 200, 0, 0.05), StepSample(0, 0, 64, 0.2)])
    assert got.mixed_base_s == pytest.approx(0.030, rel=1e-6)
    assert got.mixed_per_seq_s == pytest.approx(0.0025, rel=1e-6)
    for r, c, p in shapes:
        assert got.step_s(r, c, p) == pytest.approx(curve.base_s + curve.prefill_seconds(p) + 0.030 + 0.0025 * r
                                                    + 1e-5 * c)
    # Pure steps are read as before.
    assert got.step_s(4, 200, 0) == curve.step_s(4, 200, 0)
    assert got.step_s(0, 0, 128) == curve.step_s(0, 0, 128)
    # The results file keeps the two figures.
    again = ServiceCurve.from_dict(got.to_dict())
    assert (again.mixed_base_s, again.mixed_per_seq_s) == (got.mixed_base_s, got.mixed_per_seq_s)


def test_with_mixed_without_samples_or_with_one_batch_size() -> None:
    curve = line()
    assert with_mixed(curve, [StepSample(4, 200, 0, 0.05)]) is curve          # nothing mixed: unchanged
    assert curve.step_s(3, 100, 128) == pytest.approx(curve.step_s(3, 100, 0) + curve.prefill_seconds(128))
    # One batch size: per row stays per_seq_s, the median of the rest is fixed.
    one = [StepSample(4, 0, 128, curve.base_s + curve.prefill_seconds(128) + 4 * 0.004 + extra)
           for extra in (0.01, 0.02, 0.03)]
    got = with_mixed(curve, one)
    assert got.mixed_per_seq_s == curve.per_seq_s and got.mixed_base_s == pytest.approx(0.02)
    # Mixed steps cheaper than their parts: clipped at zero, never a negative cost.
    cheap = [StepSample(r, 0, 128, 0.001) for r in (1, 8)]
    got = with_mixed(curve, cheap)
    assert got.mixed_base_s == 0.0 and got.mixed_per_seq_s == 0.0


@pytest.mark.parametrize("bad", [{"mixed_base_s": -0.1, "mixed_per_seq_s": 0.0}, {"mixed_base_s": 0.01},
                                 {"mixed_per_seq_s": 0.01}, {"mixed_base_s": float("nan"), "mixed_per_seq_s": 0.0}])
def test_bad_mixed_figures_are_refused_by_name(bad) -> None:
    with pytest.raises(ValueError, match="mixed_"):
        ServiceCurve.from_dict({**line().to_dict(), **bad})


def test_the_simulator_charges_a_mixed_step_its_own_cost() -> None:
    # One request decoding, a second arriving mid-run: the step that prefills the second while the first
    # decodes is mixed. With a 0.5 s mixed_base_s, the first request's end moves by that much.
    flat = ServiceCurve(base_s=0.01, per_seq_s=0.0, per_ctx_token_s=0.0, per_prefill_token_s=0.0, max_num_seqs=4)
    reqs = [Request(0, 0.0, 10, 20), Request(1, 0.055, 10, 2)]

    def end_of_first(curve: ServiceCurve) -> float:
        res = simulate(SimConfig(curve=curve), StaticPolicy("one", 1), reqs)
        first = next(o for o in res.outcomes if o.req.id == 0)
        assert first.e2e_s is not None
        return first.e2e_s
    plain = end_of_first(flat)
    mixed = end_of_first(ServiceCurve.from_dict({**flat.to_dict(), "mixed_base_s": 0.5, "mixed_per_seq_s": 0.0}))
    assert mixed == pytest.approx(plain + 0.5)


def test_validation_reads_a_mixed_step_from_the_replicas_counters() -> None:
    from tokenyard.bench.fleet.validation import mixed_samples_from_stats
    curve = with_prefill_table(line(), [])

    def snap(steps: int, busy: float, prefill: int, out: int) -> dict:
        return {"num_steps": steps, "busy_seconds": busy, "prefill_tokens": prefill, "output_tokens": out}
    decode = curve.step_s(4, round(4 * (48 + 10 + 1.5)), 0)   # 10 steps in, 1.5 into the interval
    # One replica: 4 rows decoding; before `after` their prefill (left out); then 3 steps of which one is
    # mixed (a 130-token prompt, its one token), the two others decode steps at the curve's cost.
    one = [snap(0, 0.0, 0, 0), snap(1, 0.3, 200, 4), snap(10, 0.6, 200, 40),
           snap(13, 0.6 + 0.4 + 2 * decode, 330, 40 + 3 * 4 + 1), snap(15, 1.2, 330, 61)]
    got = mixed_samples_from_stats([(float(i), [s]) for i, s in enumerate(one)], after=2.0, curve=curve,
                                   prompt_tokens=48)
    assert len(got) == 1
    assert got[0].decode_rows == 4 and got[0].prefill_tokens == 130
    assert got[0].seconds == pytest.approx(0.4)
    # Before `after` nothing counts; a prompt with no rows decoding is a pure prefill, not mixed.
    assert mixed_samples_from_stats([(float(i), [s]) for i, s in enumerate(one)], after=10.0, curve=curve,
                                    prompt_tokens=48) == []
    alone = [snap(0, 0.0, 0, 0), snap(1, 0.3, 130, 1), snap(2, 0.31, 130, 1)]
    assert mixed_samples_from_stats([(float(i), [s]) for i, s in enumerate(alone)], after=0.0, curve=curve,
                                    prompt_tokens=48) == []
