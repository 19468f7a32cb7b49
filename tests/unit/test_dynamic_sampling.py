"""Dynamic sampling's rules on their own: which groups are filtered, the filter rate and the over-sampling it
buys at admission, pass rates counted once per prompt row across a reopen, and the curriculum's skips."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.filtering import FilterRate, FilterRule, GroupOutcome, revisit
from rlfleet.services.collector.ledger import PromptLedger
from rlfleet.services.collector.prompt_item import PromptItem
from rlfleet.services.collector.source import PromptSource


@pytest.mark.parametrize("scores, min_range, filtered, passed", [
    ([0.0, 0.0, 0.0, 0.0], 0.0, True, 0),
    ([1.0, 1.0, 1.0, 1.0], 0.0, True, 4),
    ([0.0, 1.0, 0.0, 0.0], 0.0, False, 1),
    ([0.5, 0.625, 0.5, 0.5625], 0.0, False, 4),
    ([0.5, 0.625, 0.5, 0.5625], 0.125, True, 4),  # a range at the bound is filtered
    ([0.5, 0.75, 0.5, 0.5625], 0.125, False, 4),
])
def test_a_group_is_filtered_when_its_score_range_is_at_most_the_bound(scores, min_range, filtered, passed):
    outcome = FilterRule(True, min_range, pass_score=0.5).outcome("k", torch.tensor(scores))
    assert outcome == GroupOutcome("k", len(scores), passed, filtered)
    assert not FilterRule(False).outcome("k", torch.tensor(scores)).filtered  # off: pass rates only


def test_the_filter_rate_is_over_a_window_and_its_over_sampling_is_capped():
    rate = FilterRate(window=4, max_oversampling=4.0)
    assert (rate.rate, rate.expected_loss) == (0.0, 0.0)
    for filtered in (True, True, False, True, True, True):  # the window keeps the last four
        rate.record(filtered)
    assert rate.rate == 0.75 and rate.expected_loss == 0.75
    rate.record(True)
    assert rate.rate == 1.0 and rate.expected_loss == 0.75  # capped: at most 4 groups started per group expected


def test_admission_starts_replacements_alongside_the_groups_expected_to_be_filtered():
    """Two groups per step, staleness 0, version 0: only step 0 may start. A filtered group gives its slot back,
    a delivered one keeps it; groups in flight expected to be filtered (the measured rate) do not count."""
    async def scenario():
        gate = VersionGate(groups_per_step=2, max_staleness=0)
        await gate.admit()
        await gate.admit()
        full_without_a_rate = not gate.may_start()
        await gate.settle(delivered=False, expected_loss=0.5)  # filtered: its slot goes to another group
        await gate.admit()
        counts = [(gate.groups_started, gate.unsettled)]
        # 2 started, 2 in flight, half of them expected filtered: one more starts alongside.
        may_oversample = gate.may_start()
        await gate.admit()
        counts.append((gate.groups_started, gate.unsettled))
        # 3 started, 3 in flight -> int(1.5) = 1 expected filtered: 2 count, step 0 is full.
        full_with_the_rate = not gate.may_start()
        await gate.settle(delivered=True, expected_loss=0.0)  # the rate fell to 0: 3 count
        still_full = not gate.may_start()
        return full_without_a_rate, counts, may_oversample, full_with_the_rate, still_full

    assert asyncio.run(scenario()) == (True, [(2, 2), (3, 3)], True, True, True)


def test_pass_rates_count_each_ended_row_once_and_survive_a_reopen(tmp_path):
    path = tmp_path / "prompts.sqlite3"

    async def scenario():
        ledger = PromptLedger(path)
        items = await ledger.add([PromptItem(f"p{i}", text=str(i)) for i in range(3)])
        await asyncio.gather(ledger.done(items[0], outcome=GroupOutcome("p0", 4, 4, True)),
                             ledger.done(items[1], outcome=GroupOutcome("p1", 4, 1, False)),
                             ledger.done(items[2]))  # an end without an outcome counts nothing
        again = (await ledger.add([PromptItem("p0", text="0")]))[0]
        await ledger.done(again, outcome=GroupOutcome("p0", 4, 0, True))
        ledger.close()

    asyncio.run(scenario())
    reopened = PromptLedger(path)
    try:
        rates, total = asyncio.run(reopened.pass_rates([], "", 10))
        assert total == 2
        assert [(r.prompt_key, r.groups, r.samples, r.passed, r.filtered_groups, r.recent_samples, r.recent_passed)
                for r in rates] == [("p0", 2, 8, 4, 2, 4, 0), ("p1", 1, 4, 1, 0, 4, 1)]
        assert (reopened.filtered_groups, reopened.filtered_samples) == (2, 8)
        assert reopened.recent == {"p0": (4, 0), "p1": (4, 1)}
        assert [r.prompt_key for r in asyncio.run(reopened.pass_rates(["p1", "nope"], "", 10))[0]] == ["p1"]
        assert [r.prompt_key for r in asyncio.run(reopened.pass_rates([], "p0", 10))[0]] == ["p1"]
    finally:
        reopened.close()


def test_the_curriculum_skips_rows_whose_latest_group_passed_all_or_none_but_revisits_some(tmp_path):
    records = [{"prompt": f"q{i}", "id": f"q{i}"} for i in range(40)]

    async def scenario():
        ledger = PromptLedger(tmp_path / "prompts.sqlite3")
        ledger.recent.update({f"q{i}": (4, 4 if i % 2 else 0) for i in range(20)})  # q0..q19 solved or hopeless
        ledger.recent.update({f"q{i}": (4, 2) for i in range(20, 30)})  # q20..q29 still learnable
        source = PromptSource(ledger, records, shuffle=False, epochs=1, curriculum_revisit=0.25)
        drawn = [item.dataset_key for item in await source.take(40)]
        ledger.close()
        return drawn, source.curriculum_skipped

    drawn, skipped = asyncio.run(scenario())
    revisited = [f"q{i}" for i in range(20) if revisit(0, 0, i, 0.25)]
    assert drawn == revisited + [f"q{i}" for i in range(20, 40)]
    assert skipped == 20 - len(revisited) and 0 < len(revisited) < 20
