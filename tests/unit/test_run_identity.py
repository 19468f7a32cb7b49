"""Run identity (services/collector/run.py, the ledger's ``run`` row, the SDK's claim): who may join a run."""

from __future__ import annotations

import json

import pytest

from rlfleet.client import Run
from rlfleet.client.aio import run_claim
from rlfleet.client.channel import ChannelSettings
from rlfleet.services.collector import run as runs
from rlfleet.services.collector.ledger import PromptLedger
from rlfleet.services.common.database import open_database, purge_database
from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument

HELD = runs.Run("run-20261128-120000-abcdef", 1_764_331_200.0, resumed=True)


def test_a_new_trainer_joins_a_run_that_committed_nothing():
    runs.check_join(HELD, 0, "", 0)


def test_a_new_trainer_is_refused_by_a_run_under_way_naming_it():
    with pytest.raises(FailedPrecondition) as refused:
        runs.check_join(HELD, 10, "", 0)
    message = str(refused.value)
    assert "starts a new run" in message and HELD.run_id in message and "committed version 10" in message
    assert "--fresh" in message


def test_resuming_another_run_is_refused_naming_both():
    with pytest.raises(FailedPrecondition) as refused:
        runs.check_join(HELD, 10, "run-20261127-090000-123456", 10)
    assert "run-20261127-090000-123456" in str(refused.value) and HELD.run_id in str(refused.value)


def test_resuming_with_other_weights_than_committed_is_refused():
    with pytest.raises(FailedPrecondition, match="holding the weights of version 8.*committed version 10"):
        runs.check_join(HELD, 10, HELD.run_id, 8)
    runs.check_join(HELD, 10, HELD.run_id, 10)


def test_calls_of_another_run_are_refused_calls_without_one_taken():
    runs.check_call(HELD, [("authorization", "Bearer x"), ("rlfleet-run-id", HELD.run_id)])
    runs.check_call(HELD, [("authorization", "Bearer x")])
    runs.check_call(HELD, None)
    with pytest.raises(FailedPrecondition, match="joined run run-old.*now holds run " + HELD.run_id):
        runs.check_call(HELD, [("rlfleet-run-id", "run-old")])


def test_a_run_is_made_once_with_the_state_and_kept(tmp_path):
    ledger = PromptLedger(tmp_path / "prompts.sqlite3")
    first = ledger.open_run()
    assert not first.resumed and first.run_id.startswith("run-")
    assert ledger.open_run() == runs.Run(first.run_id, first.created_at, resumed=True)
    ledger.close()
    reopened = PromptLedger(tmp_path / "prompts.sqlite3")
    assert reopened.open_run().run_id == first.run_id
    reopened.close()


def test_a_state_older_than_run_ids_is_adopted_as_resumed(tmp_path):
    ledger = PromptLedger(tmp_path / "prompts.sqlite3")
    ledger.run_now(lambda db: db.execute("INSERT INTO meta (name, value) VALUES ('version', '7')"))
    run = ledger.open_run()
    assert run.resumed
    stored = json.loads(ledger.run_now(lambda db: db.execute("SELECT value FROM meta WHERE name = 'run'").fetchone()[0]))
    assert stored["run_id"] == run.run_id
    ledger.close()


def test_purging_drops_the_state_so_the_next_open_is_a_new_run(tmp_path):
    path = tmp_path / "prompts.sqlite3"
    ledger = PromptLedger(path)
    old = ledger.open_run()
    ledger.close()
    assert "meta" in purge_database(str(path), role="collector")
    ledger = PromptLedger(path)
    new = ledger.open_run()
    assert new.run_id != old.run_id and not new.resumed
    ledger.close()
    assert purge_database(str(tmp_path / "absent.sqlite3"), role="collector") == []
    assert not (tmp_path / "absent.sqlite3").exists()


def test_purging_a_database_another_instance_owns_is_refused(tmp_path):
    path = str(tmp_path / "owned.sqlite3")
    owner = open_database(path, role="collector", lock_timeout_seconds=0.1)
    owner.execute("CREATE TABLE kept (x INTEGER)")
    try:
        with pytest.raises(RuntimeError, match="in use by another process"):
            purge_database(path, role="collector", lock_timeout_seconds=0.2)
        assert "kept" in owner.tables()
    finally:
        owner.close()


def test_the_sdk_claim_and_its_metadata():
    assert run_claim("new") == "new" and run_claim(None) is None
    assert run_claim("run-a-b@12") == Run("run-a-b", 12)
    assert str(Run("run-a-b", 12)) == "run-a-b@12"
    with pytest.raises(ValueError, match="RUN_ID@VERSION"):
        run_claim("resume")
    with pytest.raises(TypeError):
        run_claim(12)
    assert ("rlfleet-run-id", "run-a") in ChannelSettings(run_id="run-a").metadata()
    assert not any(key == "rlfleet-run-id" for key, _ in ChannelSettings().metadata())


def test_a_claimed_run_id_of_another_shape_is_invalid_and_never_echoed_whole():
    for claimed in ("nope", "run-1", "x" * 100_000, HELD.run_id + "\n"):
        with pytest.raises(InvalidArgument, match="run_id: not a run id") as refused:
            runs.check_join(HELD, 0, claimed, 0)
        assert len(str(refused.value)) < 300
    with pytest.raises(FailedPrecondition) as refused:
        runs.check_call(HELD, [("rlfleet-run-id", "y" * 8000)])
    assert len(str(refused.value)) < 600 and "8000 characters" in str(refused.value)
