"""The trajectory store's sample log (what the rollout viewer shows) and per-version statistics."""

from __future__ import annotations

import math

import pytest

from rlfleet.services.common.errors import InvalidArgument, NotFound
from rlfleet.services.trajectory.store import TrajectoryStore
from rlfleet.wire import decode_tensordict
from rlfleet.wire.rows import concat_tensordicts
from tests.trajectories import check_rows, groups, make_trajectories, trajectory_ids


class FakeClock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def open_store(path, **kwargs) -> TrajectoryStore:
    return TrajectoryStore(str(path), capacity=1000, clock=FakeClock(), **kwargs)


def test_version_stats_count_every_group_and_means_come_from_its_rows(tmp_path):
    store = open_store(tmp_path / "t.db")
    # make_trajectories: row i scores i and has i % 4 response tokens.
    store.append(make_trajectories(groups(0, 2, 2), first_id=0, policy_version=3), group_keys=["a", "b"],
                 committed_version=5)
    store.append(make_trajectories(groups(2, 1, 2), first_id=4, policy_version=4), group_keys=["c"],
                 filtered_groups=[True], committed_version=5)
    stats = {s.version: s for s in store.samples.version_stats()}
    assert sorted(stats) == [3, 4]
    v3, v4 = stats[3], stats[4]
    assert (v3.groups, v3.trajectories, v3.filtered_groups) == (2, 4, 0)
    assert v3.mean_score == pytest.approx((0 + 1 + 2 + 3) / 4)
    assert v3.mean_response_tokens == pytest.approx((0 + 1 + 2 + 3) / 4)
    assert (v3.mean_staleness, v3.max_staleness) == (2.0, 2)
    assert (v4.groups, v4.filtered_groups, v4.mean_score) == (1, 1, pytest.approx(4.5))
    assert (v4.mean_staleness, v4.max_staleness) == (1.0, 1)
    assert math.isnan(v3.mean_kl)  # no kl_mean column: no mean, not a zero
    store.close()


def test_an_append_of_groups_of_several_versions_counts_each_and_copies_in_its_own_order(tmp_path):
    store = open_store(tmp_path / "t.db", sample_groups_per_version=2)
    versions = (0, 1, 0, 0)  # one call: the collector appends the groups that queued together
    store.append(concat_tensordicts([make_trajectories([group, group], first_id=2 * group, policy_version=version)
                                     for group, version in enumerate(versions)]),
                 group_keys=["a", "b", "c", "d"], committed_version=1)
    v0, v1 = store.samples.version_stats()
    assert (v0.version, v0.groups, v0.trajectories, v1.version, v1.groups, v1.trajectories) == (0, 3, 6, 1, 1, 2)
    assert v0.mean_score == pytest.approx((0 + 1 + 4 + 5 + 6 + 7) / 6)
    assert (v0.mean_staleness, v0.max_staleness, v1.mean_staleness, v1.max_staleness) == (1.0, 1, 0.0, 0)
    # Copied: version 0's first two groups and version 1's, in the Append's order (listed newest first).
    assert [s.trajectory_id for s in store.samples.list().samples] == [f"traj-{i}" for i in range(5, -1, -1)]
    store.close()


def test_an_append_without_a_committed_version_records_no_staleness(tmp_path):
    store = open_store(tmp_path / "t.db")
    store.append(make_trajectories(groups(0, 1, 2)), group_keys=["a"])
    [stats] = store.samples.version_stats()
    assert math.isnan(stats.mean_staleness) and stats.max_staleness == -1
    assert store.samples.list().samples[0].staleness == -1
    store.close()


def test_a_retried_append_is_counted_and_logged_once_and_both_survive_a_reopen(tmp_path):
    path = tmp_path / "t.db"
    store = open_store(path)
    request = make_trajectories(groups(0, 2, 3), policy_version=1, prompt_ids=True)
    store.append(request, group_keys=["a", "b"], committed_version=1)
    store.append(request, group_keys=["a", "b"], committed_version=2)  # a collector retrying after a crash
    store.close()
    store = open_store(path)
    [stats] = store.samples.version_stats()
    assert (stats.groups, stats.trajectories, stats.mean_staleness) == (2, 6, 0.0)
    page = store.samples.list()
    assert page.logged == 6 and [s.trajectory_id for s in page.samples] == [f"traj-{i}" for i in range(5, -1, -1)]
    assert {s.prompt_id for s in page.samples} == {"prompt-0", "prompt-1"}
    store.close()


def test_the_log_keeps_the_first_groups_of_each_version_and_the_newest_groups_in_all(tmp_path):
    store = open_store(tmp_path / "t.db", sample_groups_per_version=2, max_sample_groups=3)
    first = 0
    for version in (0, 1):
        for group in range(3):  # three groups per version: the third is counted, not copied
            store.append(make_trajectories([group, group], first_id=first, policy_version=version),
                         group_keys=[f"{version}/{group}"])
            first += 2
    assert [(s.version, s.groups) for s in store.samples.version_stats()] == [(0, 3), (1, 3)]
    kept = store.samples.list().samples
    # Copied: v0 groups 0, 1 and v1 groups 0, 1; the oldest copy went to keep 3 groups in all.
    assert [s.trajectory_id for s in kept] == ["traj-9", "traj-8", "traj-7", "traj-6", "traj-3", "traj-2"]
    assert store.samples.list(max_version=0).samples[-1].trajectory_id == "traj-2"
    store.close()


def test_listing_filters_by_version_score_and_filtered_groups_and_pages_newest_first(tmp_path):
    store = open_store(tmp_path / "t.db")
    store.append(make_trajectories(groups(0, 2, 2), first_id=0, policy_version=0), group_keys=["a", "b"],
                 filtered_groups=[False, True])
    store.append(make_trajectories(groups(2, 1, 2), first_id=4, policy_version=1), group_keys=["c"])
    ids = lambda page: [s.trajectory_id for s in page.samples]  # noqa: E731
    assert ids(store.samples.list(min_version=1)) == ["traj-5", "traj-4"]
    assert ids(store.samples.list(min_score=1, max_score=4)) == ["traj-4", "traj-3", "traj-2", "traj-1"]
    assert ids(store.samples.list(filtered=True)) == ["traj-3", "traj-2"]
    assert ids(store.samples.list(filtered=False, max_version=0)) == ["traj-1", "traj-0"]
    first = store.samples.list(limit=4)
    assert len(first.samples) == 4 and first.next_cursor == first.samples[-1].cursor
    rest = store.samples.list(limit=4, before_cursor=first.next_cursor)
    assert ids(rest) == ["traj-1", "traj-0"] and rest.next_cursor == 0
    # What the filters match is counted on every page, the log's total beside it.
    assert (first.matching, rest.matching, rest.logged) == (6, 6, 6)
    scored = store.samples.list(min_score=1, max_score=4, limit=2)
    assert (len(scored.samples), scored.matching) == (2, 4)
    later = store.samples.list(min_score=1, max_score=4, limit=2, before_cursor=scored.next_cursor)
    assert later.matching == 4 and store.samples.list(filtered=True).matching == 2
    store.close()


def test_get_returns_the_trajectory_as_appended(tmp_path):
    store = open_store(tmp_path / "t.db")
    store.append(make_trajectories(groups(0, 2, 3), first_id=10, policy_version=2), group_keys=["a", "b"])
    summary = next(s for s in store.samples.list().samples if s.trajectory_id == "traj-14")
    got_summary, row = store.samples.get(summary.cursor)
    assert got_summary == summary and (summary.group_id, summary.sample_index) == (1, 1)
    assert list(row.batch_size) == [1] and trajectory_ids(row) == ["traj-14"]
    check_rows(row)
    assert decode_tensordict(row)["policy_version_start"].tolist() == [2]
    store.close()


@pytest.mark.parametrize("call, message", [
    (lambda log: log.get(999), "cursor: no trajectory 999 in the sample log"),
    (lambda log: log.list(limit=5000), "limit: 5000 is not in"),
    (lambda log: log.list(min_score=math.nan), "min_score: NaN bounds nothing"),
    (lambda log: log.version_stats(limit=-1), "limit: -1 is not in"),
])
def test_bad_reads_name_the_problem(tmp_path, call, message):
    store = open_store(tmp_path / "t.db")
    with pytest.raises((InvalidArgument, NotFound), match=message):
        call(store.samples)
    store.close()


def test_a_sample_log_of_zero_groups_per_version_copies_nothing_but_still_counts(tmp_path):
    store = open_store(tmp_path / "t.db", sample_groups_per_version=0)
    store.append(make_trajectories(groups(0, 1, 2)), group_keys=["a"])
    assert store.samples.list().logged == 0
    assert store.samples.version_stats()[0].groups == 1
    store.close()
