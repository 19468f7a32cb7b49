"""The collector's rules, each on its own: failure classification, the staleness bound at admission,
append and read, the dataset reader, bad dataset rows, supervision of background tasks, the
durable commit and pushes that bring replicas back. Fakes stand in for the stubs only."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from rlfleet.client.errors import (AbortedError, DeadlineExceededError, InternalError, InvalidArgumentError,
                                   NotFoundError, UnavailableError)
from rlfleet.services.collector import failures
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.dataset import load_records
from rlfleet.services.collector.filtering import GroupOutcome
from rlfleet.services.collector.ledger import PromptLedger
from rlfleet.services.collector.prompt_item import PromptItem
from rlfleet.services.collector.replicas import ReplicaPool
from rlfleet.services.collector.source import PromptSource
from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument, StartupError
from rlfleet.wire import WireError


# --- failure classification ---------------------------------------------------------------------
@pytest.mark.parametrize("exc,verdict", [
    (InvalidArgumentError("x"), "dead"),
    (NotFoundError("no reward fn"), "dead"),
    (WireError("ref_log_probs", "bad lengths"), "dead"),
    (UnavailableError("down"), "retry"),
    (DeadlineExceededError("slow"), "retry"),
    (AbortedError("cut"), "retry"),
    (InternalError("upstream bug"), "retry"),
    (failures.GenerationFailed("5 attempts"), "retry"),
    (KeyError("content"), None),       # a bug of ours: never retried into dead letters
    (TypeError("unexpected"), None),
    (OSError("disk full"), None),
])
def test_each_failure_ends_as_a_retry_a_dead_letter_or_a_bug(exc, verdict):
    assert failures.verdict(exc) == verdict


def test_dead_letter_codes_and_which_failures_pause_admission():
    assert failures.error_code(NotFoundError("x")) == "NOT_FOUND"
    assert failures.error_code(WireError("kl", "bad")) == "INVALID_ARGUMENT"
    assert failures.error_code(failures.GenerationFailed("x")) == "GenerationFailed"
    down = UnavailableError("reward down")
    assert failures.pauses_admission(down, "reward") and failures.pauses_admission(down, "trajectory")
    assert not failures.pauses_admission(down, "generation")  # replicas have their own pool
    # An episode's environment service is an upstream service, called in the generation stage.
    assert failures.pauses_admission(UnavailableError("gone", method="Step"), "generation")
    assert not failures.pauses_admission(InvalidArgumentError("x"), "reward")


# --- the staleness bound --------------------------------------------------------------------------
def test_the_staleness_bound_at_append_and_at_read():
    asynchronous = VersionGate(max_staleness=1, version=5)
    assert not asynchronous.too_stale_to_append(4, 5) and asynchronous.too_stale_to_append(3, 5)
    assert not asynchronous.stale_at_read(0)  # async: the reader's min_policy_version decides
    sync = VersionGate(max_staleness=3, sync=True, version=5)
    assert sync.max_staleness == 0  # sync forces the bound to 0
    assert sync.too_stale_to_append(4, 5) and not sync.too_stale_to_append(5, 5)
    assert sync.stale_at_read(4) and not sync.stale_at_read(5)


def test_a_restart_realigns_the_step_count_to_the_committed_version():
    gate = VersionGate(groups_per_step=4, max_staleness=0)
    gate.restart_at(3)
    assert (gate.version, gate.groups_started) == (3, 12) and gate.may_start()
    gate.groups_started += 4  # step 3 admitted: step 4 waits for version 4
    assert not gate.may_start()


# --- the dataset reader -----------------------------------------------------------------------------
ROWS = [{"prompt": "one", "answer": "1"}, {"prompt": [{"role": "user", "content": "two"}], "answer": "2"}]


def test_load_records_reads_jsonl_json_parquet_and_saved_datasets(tmp_path):
    import datasets
    import pyarrow
    import pyarrow.parquet as pq

    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    assert load_records(jsonl) == ROWS
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    assert load_records(tmp_path / "rows.json") == ROWS
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": ROWS}))
    assert load_records(tmp_path / "wrapped.json") == ROWS
    flat = [{"prompt": "one", "answer": "1"}, {"prompt": "two", "answer": "2"}]
    pq.write_table(pyarrow.Table.from_pylist(flat), tmp_path / "rows.parquet")
    assert load_records(tmp_path / "rows.parquet") == flat
    datasets.Dataset.from_list(flat).save_to_disk(str(tmp_path / "saved"))
    assert load_records(tmp_path / "saved") == flat


@pytest.mark.parametrize("name,content,message", [
    ("bad.jsonl", '{"prompt": "a"}\n\n{"prompt": "b"\n', "bad.jsonl line 3 column"),
    ("bad.json", '[{"prompt": "a"},\n {"prompt": }]', "bad.json line 2 column"),
    ("scalar.json", '"just a string"', "expected a list of rows"),
    ("bad.parquet", "not parquet at all", "is not a readable Parquet file"),
    ("binary.jsonl", b"\xff\xfe\x00garbage", "cannot read"),
])
def test_a_dataset_that_cannot_be_read_is_a_startup_error_naming_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(StartupError, match="dataset_path: .*" + message.replace("(", r"\(")):
        load_records(path)
    with pytest.raises(StartupError, match="does not exist"):
        load_records(tmp_path / "missing.jsonl")


# --- drawing several prompts at once -----------------------------------------------------------------------
def test_take_draws_dataset_rows_together_in_the_order_next_would_and_stops_before_bad_rows(tmp_path):
    """``take(n)`` hands out what n ``next()`` calls would, the dataset rows of one draw in one ledger
    transaction; a bad row ends a draw (the next one dead-letters it) and so does the epoch's end."""
    records = [{"prompt": f"q{i}"} for i in range(3)] + [{"prompt": 42}] + [{"prompt": f"q{i}"} for i in range(4, 6)]

    async def scenario():
        ledger = PromptLedger(tmp_path / "prompts.sqlite3")
        transactions = []
        add = ledger._add
        ledger._add = lambda items, position: transactions.append(len(items)) or add(items, position)
        source = PromptSource(ledger, records, shuffle=False, epochs=2)
        await source.submit([PromptItem("s1", text="a")])
        source.requeue(PromptItem("r1", text="again"))
        drawn = [[item.prompt_id for item in await source.take(n)] for n in (5, 8, 8, 1, 8)]
        position = await ledger.position()
        pending, failures = await ledger.count(), (await ledger.failures(0, 10))[1]
        ledger.close()
        return drawn, transactions, position, pending, failures, source.pending

    drawn, transactions, position, pending, failures, in_ledger = asyncio.run(scenario())
    assert drawn == [["r1", "s1"], ["row0@e0", "row1@e0", "row2@e0"], ["row4@e0", "row5@e0"], ["row0@e1"],
                     ["row1@e1", "row2@e1"]]
    assert transactions == [1, 3, 2, 1, 2]  # the submission, then one per draw
    assert position == {"epoch": 1, "index": 3} and failures == 1
    assert pending == in_ledger == 9  # s1 and the eight rows (r1 was put back, not added)


# --- bad rows in the prompt source ----------------------------------------------------------------------
def test_bad_rows_are_dead_lettered_with_their_reason_and_the_good_rows_follow(tmp_path):
    records = [{"prompt": "good 0"}, {"prompt": 42}, {"prompt": [{"role": "user"}]}, ["a", "list"],
               {"question": "no prompt"}, {"prompt": [{"role": "robot", "content": "x"}]}, {"prompt": "good 6"}]

    async def scenario():
        source = PromptSource(PromptLedger(tmp_path / "prompts.sqlite3"), records, shuffle=False, epochs=1)
        taken = [(await source.next()).prompt_id, (await source.next()).prompt_id]
        dead, total = await source.ledger.failures(0, 100)
        position = await source.ledger.position()
        source.ledger.close()
        return source, taken, dead, total, position

    source, taken, dead, total, position = asyncio.run(scenario())
    assert taken == ["row0@e0", "row6@e0"]
    assert total == 5 and source.bad_rows == 5
    assert [(d.prompt_id, d.stage, d.code) for d in dead] == [
        (f"row{i}@e0", "dataset", "INVALID_ARGUMENT") for i in range(1, 6)]
    errors = [d.error for d in dead]
    assert "dataset row 1.prompt: must be a non-empty string or a list of chat messages, got int" in errors[0]
    assert "dataset row 2.prompt[0].content: must be a string, got nothing" in errors[1]
    assert "dataset row 3: a row must be an object, got list" in errors[2]
    assert "dataset row 4: no field 'prompt'" in errors[3]
    assert "dataset row 5.prompt[0].role: 'robot' is not one of" in errors[4]
    assert position == {"epoch": 1, "index": 0}  # moved past the dead rows with them (a restart skips them)


def test_a_dataset_without_a_single_prompt_is_refused_not_an_endless_loop_of_dead_letters(tmp_path):
    ledger = PromptLedger(tmp_path / "prompts.sqlite3")
    try:
        with pytest.raises(InvalidArgument, match=r"no row of the dataset is a prompt with prompt_field 'prompt' "
                                                  r"\(e.g. dataset row 0: no field 'prompt'"):
            PromptSource(ledger, [{"q": 1}, {"q": 2}], epochs=0)
        PromptSource(ledger, [{"q": 1}, {"prompt": "one good row is enough"}])
    finally:
        ledger.close()


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_db(request, tmp_path) -> str:
    """Where a test's ledger lives, reopened by it: a SQLite file, or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        return str(tmp_path / "prompts.sqlite3")
    return request.getfixturevalue("postgres").create_database()


def test_groups_that_end_together_end_in_one_durable_transaction(ledger_db):

    path = ledger_db

    async def scenario():
        ledger = PromptLedger(path)
        items = await ledger.add([PromptItem(f"p{i}", text=str(i)) for i in range(8)])
        outcomes = [GroupOutcome("k", 4, i, filtered=i == 0) for i in range(5)]  # one key: its rate adds up
        await asyncio.gather(*(ledger.done(item, outcome=o) for item, o in zip(items[:5], outcomes)),
                             ledger.done(items[5], retain_at_version=3))
        calls = ledger._ends.calls
        ledger.close()
        return calls

    calls = asyncio.run(scenario())
    assert calls <= 2  # the first end alone, the five that queued behind it together
    reopened = PromptLedger(path)
    try:
        pending = asyncio.run(reopened.pending())
        assert [p.prompt_id for p in pending] == ["p6", "p7"]
        (rate,), total = asyncio.run(reopened.pass_rates([], "", 10))
        assert (total, rate.groups, rate.samples, rate.passed, rate.filtered_groups) == (1, 5, 20, 10, 1)
        assert (reopened.filtered_groups, reopened.filtered_samples) == (1, 4)
        assert reopened.recent["k"] == (rate.recent_samples, rate.recent_passed) == (4, rate.recent_passed)
        kept = reopened.run_now(lambda db: db.execute(
            "SELECT prompt_id, appended_version FROM prompts WHERE appended_version IS NOT NULL").fetchall())
        assert [tuple(row) for row in kept] == [("p5", 3)]
    finally:
        reopened.close()


# --- supervision -----------------------------------------------------------------------------------------
class _Supervised:
    """The Service base's supervision, without a server (health is absent: nothing to flip)."""

    def __new__(cls):
        from rlfleet.services.common.server import Service

        class Probe(Service):
            def add_to_server(self, server):
                pass
        return Probe(SimpleNamespace())


def test_a_supervised_task_that_raises_fails_the_service_with_the_reason(caplog):
    async def scenario():
        service = _Supervised()
        service.check_working()  # fine while nothing failed

        async def dies():
            raise KeyError("content")

        async def runs_forever():
            await asyncio.Event().wait()

        service.supervise(runs_forever(), "the replica monitor")
        service.supervise(dies(), "the rollout loop")
        await asyncio.wait_for(service.failed.wait(), 10)
        with pytest.raises(FailedPrecondition, match=r"the rollout loop died: KeyError: 'content'"):
            service.check_working()
        await service.stop_supervised()  # the other one is cancelled; nothing raised here
        return service

    service = asyncio.run(scenario())
    assert "the rollout loop died" in service.failure
    died = [r for r in caplog.records if "the rollout loop died" in r.getMessage()]
    assert died and died[0].exc_info is not None  # the traceback is in the log


def test_a_task_cancelled_at_stop_is_not_a_failure():
    async def scenario():
        service = _Supervised()
        service.supervise(asyncio.Event().wait(), "waiter")
        await asyncio.sleep(0)
        await service.stop_supervised()
        return service
    assert asyncio.run(scenario()).failure == ""


# --- the durable commit and pushes that bring replicas back -------------------------------------------------
def test_the_state_written_at_commit_holds_the_new_version_and_the_breaker_survives_a_restart(ledger_db):
    """The bug: the commit callback saved the gate's version before the gate moved to the new one,
    so a collector killed before its next checkpoint came back one version behind its replicas. The
    version, the spool's manifest (committed with it) and the mismatch breaker's state are in the
    collector's database, read back by the next collector that opens it."""
    from rlfleet.services.collector.breaker_state import BreakerState
    from rlfleet.services.collector.commits import Commits
    from rlfleet.services.collector.mismatch import LagMismatch, MismatchBreaker
    from rlfleet.v1 import weights_pb2

    def collector(ledger):
        gate = VersionGate(version=6, max_staleness=4)
        breaker = BreakerState(MismatchBreaker(threshold=0.01, trip_batches=1, kl_target=0.05), gate, ledger)
        return Commits(ledger, gate, None, None, None, None, None), breaker, gate

    async def first_life():
        ledger = PromptLedger(ledger_db)
        commits, breaker, _ = collector(ledger)
        assert await ledger.committed_version() is None
        await commits.committed(7, weights_pb2.WeightManifest(version=7, total_bytes=3))
        await breaker.report(7, [LagMismatch(0, 0.5, 0.4, 0.9, 10), LagMismatch(2, 0.2, 0.1, 0.5, 10)])
        assert breaker.open
        ledger.close()

    async def second_life():
        ledger = PromptLedger(ledger_db)
        _, breaker, gate = collector(ledger)
        version, manifest = await ledger.committed_version(), await ledger.meta("spool_manifest")
        await breaker.restore()
        assert breaker.open and gate.admission_staleness == 1
        assert await breaker.close()
        ledger.close()
        return version, weights_pb2.WeightManifest.FromString(bytes.fromhex(manifest)).version

    asyncio.run(first_life())
    assert asyncio.run(second_life()) == (7, 7)
    reopened = PromptLedger(ledger_db)
    try:
        assert asyncio.run(reopened.meta("mismatch_breaker")) is None  # closed durably
    finally:
        reopened.close()


def test_a_ledger_written_before_schema_versions_imports_the_state_files_once(tmp_path):
    """An existing deployment's SQLite ledger (no schema version) and its state files (state.json,
    mismatch-breaker.json, mismatch-measured.json): opened, the database's meta holds what they held and
    the files are gone, so nothing reads them again."""
    import sqlite3

    path = tmp_path / "prompts.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE prompts (seq INTEGER PRIMARY KEY AUTOINCREMENT, prompt_id TEXT NOT NULL, item TEXT NOT NULL,
                              attempts INTEGER NOT NULL DEFAULT 0, appended_version INTEGER);
        CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO prompts (prompt_id, item) VALUES ('p1', '{"prompt_id": "p1", "text": "hi"}');
        INSERT INTO meta VALUES ('position', '{"epoch": 2, "index": 5}');
    """)
    old.close()
    (tmp_path / "state.json").write_text(json.dumps({"version": 12}))
    (tmp_path / "mismatch-breaker.json").write_text(json.dumps({"reason": "opened at v11"}))
    (tmp_path / "mismatch-measured.json").write_text(json.dumps({"reports": 3, "measured": []}))

    async def opened():
        ledger = PromptLedger(path, state_dir=tmp_path)
        try:
            return (await ledger.committed_version(), await ledger.meta("mismatch_breaker"),
                    await ledger.meta("mismatch_measured"), await ledger.position(),
                    [p.prompt_id for p in await ledger.pending()], await ledger.meta("schema_version"))
        finally:
            ledger.close()

    assert asyncio.run(opened()) == (12, json.dumps({"reason": "opened at v11"}),
                                     json.dumps({"reports": 3, "measured": []}), {"epoch": 2, "index": 5}, ["p1"], "2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.sqlite3"]
    assert asyncio.run(opened())[0] == 12  # reopened: already version 2, nothing imported again


def test_a_lost_connection_fails_the_call_naming_the_database_and_a_restart_sees_what_committed(postgres):
    """The connection cut (the server terminates it): the call that met it and every later one raise
    DatabaseUnavailable naming the database (UNAVAILABLE) and ``on_lost`` is told (the collector stops
    serving); a collector opening the database again finds every prompt that was acknowledged."""
    from rlfleet.services.common.database import DatabaseUnavailable

    url = postgres.create_database()
    database = url.rsplit("/", 1)[1]
    lost = []

    async def first_life():
        ledger = PromptLedger(url, schema="collector_a", on_lost=lost.append)
        await ledger.add([PromptItem("kept", text="x")])
        assert postgres.terminate(database) >= 1
        with pytest.raises(DatabaseUnavailable, match=r"collector database unreachable: postgresql://.*/" + database):
            await ledger.add([PromptItem("cut", text="y")])
        with pytest.raises(DatabaseUnavailable, match="the connection was lost"):
            await ledger.count()
        ledger.close()

    async def second_life():
        ledger = PromptLedger(url, schema="collector_a")
        try:
            return [p.prompt_id for p in await ledger.pending()]
        finally:
            ledger.close()

    asyncio.run(first_life())
    assert len(lost) == 2 and all(isinstance(e, DatabaseUnavailable) for e in lost)
    assert asyncio.run(second_life()) == ["kept"]


class _Pool:
    def __init__(self, replicas, answering):
        self.replicas, self.answering = replicas, answering
        self.settings = None

    def healthy(self):
        return [r for r in self.replicas if r.healthy]

    async def probe(self, replica, timeout=5.0):
        return self.answering.get(replica.address)


def test_a_push_goes_to_replicas_out_of_rotation_that_answer_as_a_resync():
    from rlfleet.services.collector.fanout import WeightFanout, _offered
    from rlfleet.services.collector.replicas import Replica
    from rlfleet.services.common.errors import Unavailable
    from rlfleet.v1 import weights_pb2

    up = Replica("gen:1", None, None, healthy=True, policy_version=4)
    back = Replica("gen:2", None, None, healthy=False, policy_version=5)  # ran ahead: a crashed commit
    gone = Replica("gen:3", None, None, healthy=False, last_error="connection refused")
    fanout = WeightFanout.__new__(WeightFanout)
    fanout.pool = _Pool([up, back, gone], {"gen:1": 4, "gen:2": 5})
    manifest = weights_pb2.WeightManifest(version=5)
    targets = asyncio.run(fanout.targets(manifest))
    assert [r.address for r in targets] == ["gen:1", "gen:2"]
    assert not _offered(manifest, up).resync and _offered(manifest, back).resync
    assert not manifest.resync  # the trainer's manifest is not changed
    fanout.pool = _Pool([gone], {})
    with pytest.raises(Unavailable, match="no generation replica answers.*gen:3: connection refused"):
        asyncio.run(fanout.targets(manifest))


def _spool_writer(spool):
    from rlfleet.services.collector.spool_writer import SpoolWriter

    return SpoolWriter(spool, lambda segment: segment.close())


async def _spool_push(fanout, version: int, data: bytes, committed: bool = True, fail: bool = False,
                      manifest=None):
    """One push's spool write, as ``WeightFanout._decide`` starts it: copied beside the staging, then the
    version committed (a database spool's manifest with it), then the spool's own commit."""
    from rlfleet.v1 import weights_pb2
    from rlfleet.wire import shm

    segment = shm.create_segment(len(data))
    segment.buffer[:] = data
    write = fanout.spool.begin(manifest or weights_pb2.WeightManifest(version=version, total_bytes=len(data)),
                               await fanout.spool.manifests())
    if fail:
        async def disk_full(segment):
            raise OSError(28, "No space left on device")
        write.copy = disk_full
    decision, copied = asyncio.get_running_loop().create_future(), asyncio.get_running_loop().create_future()
    spooling = fanout.start(write, segment, decision, copied)
    if committed and fanout.spool.commits_with_version:
        await fanout.spool.ledger.commit_version(version, write.manifest.SerializeToString() if await copied
                                                 else None)
    decision.set_result(committed)
    await spooling


def test_a_spool_write_that_fails_is_in_status_until_a_later_push_spools(tmp_path):
    """Disk full while spooling: the push still commits (replicas applied it), the reason is kept for
    ``Status.spool_error``, the spool is left as it was, and the next push that spools clears it."""
    from rlfleet.services.collector.spool import FileSpool

    fanout = _spool_writer(FileSpool(tmp_path))
    try:
        asyncio.run(_spool_push(fanout, 3, bytes(range(8)), fail=True))
        assert fanout.error == "spooling version 3 failed: [Errno 28] No space left on device"
        assert asyncio.run(fanout.spool.manifest()) is None and not list(tmp_path.glob("*.tmp"))
        asyncio.run(_spool_push(fanout, 4, bytes(range(8)), committed=False, fail=True))  # aborted: changes nothing
        assert fanout.error.startswith("spooling version 3 failed")
        asyncio.run(_spool_push(fanout, 5, bytes(range(8))))
        assert fanout.error == "" and asyncio.run(fanout.spool.manifest()).version == 5
        assert (tmp_path / "weights-5.bin").read_bytes() == bytes(range(8))
    finally:
        fanout.spool.close()


def test_the_spool_in_the_database_switches_with_the_version_and_reads_back_chunk_by_chunk(ledger_db, monkeypatch):
    """The spool beside a PostgreSQL ledger (here on both backends): a push's bytes are chunk rows, its
    manifest switches in the transaction that commits the version, older versions are deleted after; an
    aborted push and a cut-off one (chunks without a manifest) leave the committed version's bytes as
    they were; a collector opening the database again re-syncs from them."""
    from rlfleet.services.collector import spool as spool_module
    from rlfleet.services.collector.spool import DatabaseSpool

    monkeypatch.setattr(spool_module, "SPOOL_CHUNK_BYTES", 5)  # 13 bytes: three chunks, the last short
    first, second = bytes(range(13)), bytes(range(100, 113))

    async def chunks_of(ledger):
        return sorted(tuple(row) for row in await ledger.run(
            lambda db: db.execute("SELECT version, idx FROM spool_chunks").fetchall()))

    async def first_life():
        ledger = PromptLedger(ledger_db)
        fanout = _spool_writer(DatabaseSpool(ledger))
        await _spool_push(fanout, 3, first)
        await _spool_push(fanout, 4, second, committed=False)
        await _spool_push(fanout, 5, second, fail=True)  # committed without the spool: it keeps version 3
        assert fanout.error.startswith("spooling version 5 failed")
        manifest = await fanout.spool.manifest()
        assert (manifest.version, await ledger.committed_version()) == (3, 5)
        assert await chunks_of(ledger) == [(3, 0), (3, 1), (3, 2)]
        await _spool_push(fanout, 6, second)
        assert fanout.error == "" and await chunks_of(ledger) == [(6, 0), (6, 1), (6, 2)]
        await DatabaseSpool(ledger).begin(manifest, []).copy(_segment(first))  # version 3 again, cut off: no commit
        ledger.close()

    async def second_life():
        ledger = PromptLedger(ledger_db)
        spool = DatabaseSpool(ledger)  # removes the cut-off push's chunks
        remaining = await chunks_of(ledger)
        manifest = await spool.manifest()
        segment = await spool.load_segment(manifest)
        data = bytes(segment.buffer)
        segment.close()
        ledger.close()
        return remaining, manifest.version, data

    asyncio.run(first_life())
    assert asyncio.run(second_life()) == ([(6, 0), (6, 1), (6, 2)], 6, second)


@pytest.mark.parametrize("kind", ["files", "database"])
def test_a_delta_is_spooled_as_the_committed_version_patched(kind, tmp_path, monkeypatch):
    """The spool keeps a full copy: a delta's tensors written over the committed version's bytes (files:
    copied in the kernel; the database: rows copied, the chunks a tensor falls in rewritten, across chunk
    boundaries), read back whole for a re-sync."""
    from rlfleet.services.collector import spool as spool_module
    from rlfleet.services.collector.spool import DatabaseSpool, FileSpool
    from rlfleet.v1 import tensor_pb2, weights_pb2

    monkeypatch.setattr(spool_module, "SPOOL_CHUNK_BYTES", 5)
    specs = [weights_pb2.WeightSpec(name=n, dtype=tensor_pb2.DTYPE_UINT8, shape=[size])
             for n, size in (("a", 4), ("b", 7), ("c", 2))]  # bytes 0-4, 4-11, 11-13
    full = weights_pb2.WeightManifest(version=3, total_bytes=13, tensors=specs)
    delta = weights_pb2.WeightManifest(version=4, total_bytes=9, tensors=[specs[1], specs[2]])
    delta.delta.base_version = 3

    async def scenario():
        ledger = PromptLedger(str(tmp_path / "prompts.sqlite3")) if kind == "database" else None
        fanout = _spool_writer(DatabaseSpool(ledger) if ledger is not None else FileSpool(tmp_path / "spool"))
        try:
            await _spool_push(fanout, 3, bytes(range(13)), manifest=full)
            await _spool_push(fanout, 4, bytes(range(100, 109)), manifest=delta)
            spooled = await fanout.spool.manifest()
            assert (spooled.version, spooled.total_bytes, list(spooled.tensors)) == (4, 13, specs)
            assert not spooled.HasField("delta") and fanout.error == ""
            segment = await fanout.spool.load_segment(spooled)
            try:
                assert bytes(segment.buffer) == bytes(range(4)) + bytes(range(100, 109))
            finally:
                segment.close()
        finally:
            fanout.spool.close()
            if ledger is not None:
                ledger.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["files", "database"])
def test_an_adapter_is_spooled_beside_the_weights_it_sits_on(kind, tmp_path, monkeypatch):
    """A re-sync pushes the weights an adapter sits on, then the adapter: the spool keeps both (a later
    adapter replaces the first, a full push both); an adapter on the checkpoint is spooled alone; the
    spool opened again (a restarted collector) has the same."""
    from rlfleet.services.collector import spool as spool_module
    from rlfleet.services.collector.spool import DatabaseSpool, FileSpool
    from rlfleet.v1 import weights_pb2

    monkeypatch.setattr(spool_module, "SPOOL_CHUNK_BYTES", 5)

    def adapter(version, size):
        return weights_pb2.WeightManifest(version=version, total_bytes=size,
                                          lora=weights_pb2.LoraAdapter(rank=1, alpha=2, target_modules=["q_proj"]))

    async def scenario():
        ledger = PromptLedger(str(tmp_path / "prompts.sqlite3")) if kind == "database" else None

        def open_spool():
            return _spool_writer(DatabaseSpool(ledger) if ledger is not None else FileSpool(tmp_path / "spool"))

        async def spooled(fanout):
            out = []
            for manifest in await fanout.spool.manifests():
                segment = await fanout.spool.load_segment(manifest)
                out.append((manifest.version, manifest.HasField("lora"), bytes(segment.buffer)))
                segment.close()
            return out

        fanout = open_spool()
        try:
            await _spool_push(fanout, 2, b"ab", manifest=adapter(2, 2))  # on the checkpoint
            assert await spooled(fanout) == [(2, True, b"ab")]
            await _spool_push(fanout, 3, bytes(range(13)))
            await _spool_push(fanout, 4, b"abcdef", manifest=adapter(4, 6))
            assert await spooled(fanout) == [(3, False, bytes(range(13))), (4, True, b"abcdef")]
            await _spool_push(fanout, 5, b"xyz", manifest=adapter(5, 3))
            await _spool_push(fanout, 6, b"uvw", manifest=adapter(6, 3), committed=False)  # aborted: no change
            assert await spooled(fanout) == [(3, False, bytes(range(13))), (5, True, b"xyz")]
            fanout.spool.close()
            fanout = open_spool()
            assert await spooled(fanout) == [(3, False, bytes(range(13))), (5, True, b"xyz")]
            await _spool_push(fanout, 7, bytes(range(50, 63)))
            assert await spooled(fanout) == [(7, False, bytes(range(50, 63)))]
            if kind == "files":
                assert sorted(p.name for p in (tmp_path / "spool").iterdir()) == ["manifest.pb", "weights-7.bin"]
            else:
                versions = await ledger.run(lambda db: db.execute("SELECT DISTINCT version FROM spool_chunks")
                                            .fetchall())
                assert [tuple(v) for v in versions] == [(7,)]
                assert await ledger.meta("spool_base_manifest") is None
        finally:
            fanout.spool.close()
            if ledger is not None:
                ledger.close()

    asyncio.run(scenario())


def _segment(data: bytes):
    from rlfleet.wire import shm

    segment = shm.create_segment(len(data))
    segment.buffer[:] = data
    return segment


def test_sampling_fields_are_checked_by_the_generation_rules():
    from rlfleet.services.common.sampling_spec import sampling_from_fields

    spec = sampling_from_fields({"temperature": 0.7, "max_tokens": 8, "stop": ["\n"], "n": 4})
    assert (spec.n, spec.max_tokens, spec.stop) == (4, 8, ("\n",))
    with pytest.raises(InvalidArgument, match="sampling: no field 'temprature' \\(SamplingParams has n, temperature"):
        sampling_from_fields({"temprature": 1.0})
    with pytest.raises(InvalidArgument, match="prompts\\[2\\].sampling.top_p must be in"):
        sampling_from_fields({"top_p": 3.0, "max_tokens": 4}, "prompts[2].sampling")
    with pytest.raises(InvalidArgument, match="sampling.max_tokens: .*str"):
        sampling_from_fields({"max_tokens": "many"})
    assert torch.tensor(0).item() == 0  # torch imported by the wire codec the collector loads


def test_a_stage_counts_groups_waiting_for_its_limit_as_queued_and_forgets_old_completions():
    """GetStatus showed nothing queued ever: groups waiting for the scoring limit counted as in flight."""
    from rlfleet.services.collector.stage_stats import StageStats

    async def scenario():
        stage, limit = StageStats("reference"), asyncio.Semaphore(1)
        release = asyncio.Event()

        async def group():
            async with stage.track(limit):
                await release.wait()

        tasks = [asyncio.ensure_future(group()) for _ in range(3)]
        await asyncio.sleep(0)
        counts = (stage.queued, stage.in_flight)
        release.set()
        await asyncio.gather(*tasks)
        stage.window.appendleft(0.0)  # a completion long past the horizon
        return counts, (stage.queued, stage.in_flight, stage.done), stage.rate()

    counts, after, rate = asyncio.run(scenario())
    assert counts == (2, 1) and after == (0, 0, 3)
    assert rate == pytest.approx(3 / StageStats.HORIZON_SECONDS)


def test_a_prompt_drawn_while_an_outage_is_found_waits_for_the_upstream_services():
    from rlfleet.client.channel import ChannelSettings
    from rlfleet.services.collector.rollout import Pipeline, PipelineOptions

    async def settle():
        for _ in range(20):
            await asyncio.sleep(0)

    async def scenario():
        release = asyncio.Event()

        class Source:
            async def take(self, limit):
                await release.wait()
                return [PromptItem(prompt_id="p")]

        class Gate:
            async def admit(self):
                return 0, 0

        options = PipelineOptions(group_size=1, sampling={}, default_reward_fn="", kl_estimator=1, advantage_mode=1,
                                  update_kl_controller=False, max_groups_in_flight=4, max_generations_in_flight=1,
                                  max_scoring_in_flight=1)
        pipeline = Pipeline(options, Gate(), ReplicaPool(ChannelSettings()), Source(), None, None, None,
                            ChannelSettings(), on_fatal=lambda what, exc: None)
        started = []

        async def run_group(item, group_index):
            started.append(item.prompt_id)
            await asyncio.Event().wait()

        pipeline._run_group = run_group
        task = asyncio.create_task(pipeline.run())
        await settle()  # the loop waits for a prompt
        pipeline.upstream_up.clear()  # an upstream service found down meanwhile (a failed group's retry comes)
        release.set()
        await settle()
        assert started == []  # drawn, held until the outage ends: it costs no attempt
        pipeline.upstream_up.set()
        await settle()
        assert started[:1] == ["p"]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
