"""The mismatch breaker's rule: lag-0 k3 KL over the threshold in N reports in a row opens it."""

from __future__ import annotations

import asyncio
import math

import pytest

from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.mismatch import LagMismatch, MismatchBreaker
from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument
from tests.waiting import settle


def lag(lag: int, kl_k3: float, tokens: int = 10) -> LagMismatch:
    return LagMismatch(lag=lag, kl_k3=kl_k3, kl_k1=kl_k3, ess_token=0.9, tokens=tokens)


def test_n_reports_over_in_a_row_open_it_naming_value_threshold_and_version():
    breaker = MismatchBreaker(threshold=0.01, trip_batches=3)
    assert not breaker.report(4, [lag(0, 0.5)])
    assert not breaker.report(5, [lag(0, 0.001)])  # under: the count starts again
    assert not breaker.report(6, [lag(0, 0.2), lag(1, 0.3)])
    assert not breaker.report(7, [lag(1, 9.0)])  # no lag-0 tokens: neither counts nor resets
    assert not breaker.report(7, [lag(0, 0.3)])
    breaker.check()
    assert breaker.report(8, [lag(0, 0.25)])

    assert breaker.open and breaker.consecutive_over == 3 and breaker.reports == 6
    with pytest.raises(FailedPrecondition, match=r"lag-0 k3 KL of 0\.25 \(threshold 0\.01\) in 3 batches in a "
                                                 r"row, since policy version 6"):
        breaker.check()
    assert not breaker.report(9, [lag(0, 0.9)])  # reports still taken while open
    assert breaker.latest[0].kl_k3 == 0.9
    assert breaker.close() and not breaker.open and breaker.consecutive_over == 0
    breaker.check()
    assert not breaker.close()


def test_without_a_threshold_reports_are_kept_and_never_acted_on():
    breaker = MismatchBreaker(threshold=None, trip_batches=1)
    assert not breaker.report(1, [lag(0, 100.0)])
    assert not breaker.open and breaker.latest[0].kl_k3 == 100.0


@pytest.mark.parametrize(("lags", "message"), [
    ([lag(0, 0.1), lag(0, 0.2)], r"lags\[1\]\.lag: lag 0 is reported twice"),
    ([lag(0, math.nan)], r"lags\[0\]\.kl_k3: not a finite number"),
    ([lag(2, 0.1, tokens=0)], r"lags\[0\]\.tokens: a lag with no token"),
    ([lag(i, 0.1) for i in range(1025)], "lags: 1025 entries, at most 1024"),
])
def test_a_bad_report_is_refused_naming_the_field_and_changes_nothing(lags, message):
    breaker = MismatchBreaker(threshold=0.01, trip_batches=1)
    with pytest.raises(InvalidArgument, match=message):
        breaker.report(1, lags)
    assert breaker.reports == 0 and not breaker.open and not breaker.latest


def test_a_held_gate_admits_nothing_until_released():
    async def scenario():
        gate = VersionGate(groups_per_step=1, max_staleness=10)
        await gate.hold(True)
        waiting = asyncio.ensure_future(gate.admit())
        await settle()
        held = waiting.done()
        await gate.hold(False)
        return held, await asyncio.wait_for(waiting, 5)

    held, admitted = asyncio.run(scenario())
    assert not held and admitted == (0, 0)


def test_admission_stays_under_the_kl_target_and_re_measures_after_the_horizon():
    breaker = MismatchBreaker(threshold=None, kl_target=0.05, horizon=3)
    assert breaker.admission_staleness(4) == 1  # no report yet: it starts low, not at the ceiling
    assert breaker.admission_staleness(0) == 0  # and never above the ceiling
    assert MismatchBreaker(threshold=None).admission_staleness(4) == 4  # no KL target: the ceiling alone
    breaker.report(10, [lag(0, 9.0), lag(1, 0.01), lag(2, 0.2)])
    assert breaker.admission_staleness(4) == 1  # lag 2 is over the target; lag 0 never lowers it
    assert breaker.admission_staleness(0) == 0
    breaker.report(11, [lag(1, 0.3)])
    assert breaker.admission_staleness(4) == 0
    breaker.report(12, [lag(0, 0.0)])
    assert breaker.admission_staleness(4) == 0  # lag 1 measured 2 reports ago: still within the horizon
    breaker.report(13, [lag(0, 0.0)])
    breaker.report(14, [lag(0, 0.0)])
    assert breaker.admission_staleness(4) == 4 and sorted(breaker.measured) == [0]  # forgotten: measured again


def test_a_lowered_admission_bound_paces_new_groups_and_never_exceeds_the_ceiling():
    async def scenario():
        gate = VersionGate(groups_per_step=1, max_staleness=2)
        await gate.bound_admission(0)
        first = await asyncio.wait_for(gate.admit(), 5)  # step 0 at version 0
        second = asyncio.ensure_future(gate.admit())  # step 1 needs version >= 1 under a bound of 0
        await settle()
        paced = not second.done()
        await gate.bound_admission(7)
        return first, paced, await asyncio.wait_for(second, 5), gate.admission_staleness

    first, paced, second, bound = asyncio.run(scenario())
    assert first == (0, 0) and paced and second == (1, 0) and bound == 2


def test_the_measurements_admission_acts_on_round_trip_through_their_saved_form():
    import json

    breaker = MismatchBreaker(threshold=None, kl_target=0.05, horizon=4)
    breaker.report(3, [LagMismatch(0, 0.001, 0.001, 0.99, 64), LagMismatch(2, 0.2, 0.1, 0.5, 16)])
    restored = MismatchBreaker(threshold=None, kl_target=0.05, horizon=4)
    restored.restore_measurements(json.loads(json.dumps(breaker.measurements())))
    assert (restored.measured, restored.reports) == (breaker.measured, 1)
    assert restored.admission_staleness(8) == breaker.admission_staleness(8) == 1


def test_a_retried_report_counts_once_toward_the_breaker_and_the_horizon():
    breaker = MismatchBreaker(threshold=0.01, trip_batches=2, kl_target=0.05, horizon=2)
    assert breaker.report(4, [lag(0, 0.5)], report_id="a") is False
    assert breaker.report(4, [lag(0, 0.5)], report_id="a") is None  # the retry: nothing changes
    assert not breaker.open and breaker.consecutive_over == 1 and breaker.reports == 1
    assert breaker.report(5, [lag(0, 0.5)], report_id="b") is True  # the second report in a row opens it
    assert breaker.reports == 2


def test_report_ids_survive_a_restart_bounded_and_a_long_one_is_refused():
    import json

    from rlfleet.services.collector.mismatch import REMEMBERED_REPORTS

    breaker = MismatchBreaker(threshold=None, kl_target=0.05, horizon=4)
    for number in range(REMEMBERED_REPORTS + 5):
        breaker.report(number, [lag(1, 0.01)], report_id=f"r{number}")
    restored = MismatchBreaker(threshold=None, kl_target=0.05, horizon=4)
    restored.restore_measurements(json.loads(json.dumps(breaker.measurements())))

    assert len(restored.taken) == REMEMBERED_REPORTS and restored.taken[-1] == f"r{REMEMBERED_REPORTS + 4}"
    assert restored.report(99, [lag(1, 9.0)], report_id=f"r{REMEMBERED_REPORTS + 4}") is None  # taken before
    assert restored.measured[1][0].kl_k3 == 0.01
    with pytest.raises(InvalidArgument, match="report_id: 129 characters, at most 128"):
        restored.report(100, [lag(1, 0.01)], report_id="x" * 129)
    assert restored.reports == REMEMBERED_REPORTS + 5
