"""Collector logic above gRPC: staleness admission, prompt source, trajectory layout."""

import asyncio

import pytest
import torch

from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.ledger import PromptLedger
from rlfleet.services.collector.prompt_item import PromptItem
from rlfleet.services.collector.source import PromptSource
from rlfleet.services.collector.trajectories import response_versions
from rlfleet.services.common.errors import InvalidArgument, ResourceExhausted
from rlfleet.v1 import generation_pb2
from rlfleet.wire import WireError


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


async def admitted_now(gate: VersionGate, limit: int = 100) -> int:
    count = 0
    while count < limit and gate.may_start():
        await gate.admit()
        count += 1
    return count


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_gate_runs_at_most_k_steps_ahead(max_staleness):
    async def scenario():
        gate = VersionGate(groups_per_step=4, max_staleness=max_staleness)
        # Version 0: steps 0..k may start.
        assert await admitted_now(gate) == 4 * (max_staleness + 1)
        for version in range(1, 4):
            await gate.begin_push()
            assert not gate.may_start()  # closed while weights swap
            await gate.end_push(version)
            # Each push opens exactly one more step, and every group started
            # for step s starts at a version >= s - k.
            assert await admitted_now(gate) == 4
            step = gate.step_of(gate.groups_started - 1)
            assert gate.version >= step - max_staleness
    run(scenario())


def test_gate_versions_are_monotone_and_failed_push_keeps_version():
    async def scenario():
        gate = VersionGate(version=3)
        await gate.begin_push()
        await gate.end_push(None)
        assert gate.version == 3 and gate.may_start()
        await gate.begin_push()
        with pytest.raises(ValueError):
            await gate.end_push(2)
    run(scenario())


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_push_without_a_step_moves_the_step_count_not_the_lead(max_staleness):
    """TorchRL's recipe pushes once before training: step 0 then runs on those weights and the
    lead over the trainer stays k steps (else sync mode would generate a step that goes stale)."""
    async def scenario():
        gate = VersionGate(groups_per_step=2, max_staleness=max_staleness)
        for version in (1, 2):  # pushes with nothing admitted: the trainer has not taken a step
            await gate.begin_push()
            await gate.end_push(version)
        admitted = []
        for version in (3, 4, 5):
            while gate.may_start():
                admitted.append(await gate.admit())
            assert len(admitted) == 2 * (max_staleness + version - 2)  # k+1 steps ahead, then one per push
            await gate.begin_push()
            await gate.end_push(version)
        # Step s started at version >= 2 + s - k: never more than k steps ahead of the trainer.
        assert all(started >= 2 + gate.step_of(index) - max_staleness for index, started in admitted)
        assert [started for index, started in admitted if gate.step_of(index) == 0] == [2, 2]
    run(scenario())


def test_a_slot_given_back_just_before_a_push_does_not_halve_the_next_step():
    """Sync mode: the trainer read a batch of the current step, then a group of that step failed for
    good (its slot given back) just before the trainer's push. The push followed a step: the next step
    gets its whole two groups (before, the push counted as one without a step and the next step got one
    slot, so a trainer waiting for whole steps of two groups waited for ever)."""
    async def scenario():
        gate = VersionGate(groups_per_step=2, sync=True)
        assert await admitted_now(gate) == 2  # step 0 at v0
        for _ in range(2):
            await gate.settle(delivered=True)
        gate.note_read()  # the trainer read step 0
        await gate.begin_push()
        await gate.end_push(1)
        assert await admitted_now(gate) == 2  # step 1 at v1
        await gate.settle(delivered=True)
        gate.note_read()  # the trainer read one group of step 1 ...
        await gate.give_back()  # ... and the other failed for good (a dead letter) before the push
        await gate.begin_push()
        await gate.end_push(2)
        assert not gate.read_since_commit
        # The failed slot of step 1 and the two of step 2: at least the two groups a step needs.
        assert await admitted_now(gate) == 3
    run(scenario())


def test_give_back_reopens_a_slot():
    async def scenario():
        gate = VersionGate(groups_per_step=2, max_staleness=0)
        assert await admitted_now(gate) == 2
        await gate.give_back()
        assert await admitted_now(gate) == 1
    run(scenario())


def test_groups_deleted_unread_give_their_slots_back():
    """Sync mode: a group dynamic sampling started ahead of the step (over-sampling) holds a slot of
    the next step; it goes stale at the trainer's push and is deleted unread, and its slot comes back."""
    async def scenario():
        gate = VersionGate(groups_per_step=2, sync=True)
        gate.expected_loss = 0.5  # half the groups measured filtered: replacements start alongside
        assert await admitted_now(gate) == 3
        for _ in range(3):
            await gate.settle(delivered=True, expected_loss=0.0)  # none was filtered after all
        await gate.begin_push()
        await gate.end_push(1)
        assert await admitted_now(gate) == 1  # the third v0 group holds one of step 1's two slots
        await gate.reopen(1)  # stale since the push: deleted unread, its prompt generated again
        assert await admitted_now(gate) == 1
    run(scenario())


def records(n):
    return [{"prompt": f"q{i}", "answer": str(i)} for i in range(n)]


def ledger() -> PromptLedger:
    return PromptLedger(":memory:")


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_db(request, tmp_path) -> str:
    """Where a test's ledger lives, reopened by it: a SQLite file, or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        return str(tmp_path / "prompts.sqlite3")
    return request.getfixturevalue("postgres").create_database()


def test_prompt_source_epochs_shuffle_resume_and_priority():
    async def scenario():
        source = PromptSource(ledger(), records(5), shuffle=True, seed=1, epochs=2)
        first = [(await source.next()).text for _ in range(5)]
        assert sorted(first) == [f"q{i}" for i in range(5)] and first != [f"q{i}" for i in range(5)]
        state = source.state()
        assert state == {"epoch": 1, "index": 0}
        await source.submit([PromptItem(prompt_id="", text="urgent")])
        source.requeue(PromptItem(prompt_id="r", text="again"))
        assert (await source.next()).text == "again"
        assert (await source.next()).text == "urgent"
        second = [(await source.next()).text for _ in range(5)]
        assert sorted(second) == sorted(first) and source.state() == {"epoch": 2, "index": 0}
        waiting = asyncio.ensure_future(source.next())  # the dataset is done: it waits for submissions
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await source.submit([PromptItem(prompt_id="late", text="after the epochs")])
        assert (await asyncio.wait_for(waiting, 10)).text == "after the epochs"
        resumed = PromptSource(ledger(), records(5), shuffle=True, seed=1, epochs=2)
        resumed.load_state(state)
        assert [(await resumed.next()).text for _ in range(5)] == second
    run(scenario())


def test_prompt_source_validation_and_bounds():
    async def scenario():
        with pytest.raises(InvalidArgument, match="row 0"):
            PromptSource(ledger(), [{"prompt": 3}])
        bounded = PromptSource(ledger(), max_submitted=2)
        with pytest.raises(ResourceExhausted):
            await bounded.submit([PromptItem(f"{i}", text="x") for i in range(3)])
        assert bounded.queued == 0 and await bounded.ledger.count() == 0
        chat = PromptSource(ledger(), [{"prompt": [{"role": "user", "content": "hi"}]}])
        assert (await chat.next()).chat == [{"role": "user", "content": "hi"}]
    run(scenario())


def test_every_prompt_handed_out_is_in_the_ledger_until_it_ends(ledger_db):
    """A restarted source generates what was pending (queued or in flight), from where the dataset stood."""
    path = ledger_db

    async def first_life():
        source = PromptSource(PromptLedger(path), records(4), shuffle=False)
        assert await source.submit([PromptItem("s1", text="a"), PromptItem("s2", text="b")]) == ["s1", "s2"]
        assert await source.submit([PromptItem("s1", text="a again")]) == ["s1"]  # pending: not queued twice
        taken = [await source.next() for _ in range(4)]  # s1, s2, row0, row1
        assert [t.prompt_id for t in taken] == ["s1", "s2", "row0@e0", "row1@e0"]
        assert len({t.append_key for t in taken}) == 4
        await source.done(taken[0])  # s1's group appended
        dead = await source.dead(taken[2], "reward", "NOT_FOUND", "no such reward function")
        assert (dead.prompt_id, dead.code) == ("row0@e0", "NOT_FOUND")
        assert await source.ledger.attempted(taken[3]) == 1
        assert source.pending == 2
        source.ledger.close()  # a crash: s2 and row1 were in flight
        return taken

    async def second_life(taken):
        source = PromptSource(PromptLedger(path), records(4), shuffle=False)
        assert await source.restore() == 2 and source.pending == 2
        again = [await source.next() for _ in range(3)]
        assert [a.prompt_id for a in again] == ["s2", "row1@e0", "row2@e0"]  # then the dataset goes on
        assert again[0].append_key == taken[1].append_key  # its Append is deduplicated if it landed
        assert again[1].attempts == 1  # the retry budget survived
        failures, total = await source.ledger.failures(0, 10)
        assert total == 1 and [f.prompt_id for f in failures] == ["row0@e0"]
        source.ledger.close()

    run(second_life(run(first_life())))


def test_sync_mode_keeps_appended_prompts_a_while_to_generate_stale_groups_again(ledger_db):
    async def scenario():
        source = PromptSource(PromptLedger(ledger_db))
        await source.submit([PromptItem("a", text="x"), PromptItem("b", text="y")])
        a, b = await source.next(), await source.next()
        await source.done(a, retain_at_version=3)
        await source.done(b, retain_at_version=4)
        assert source.pending == 0 and await source.ledger.pending() == []  # not generated after a restart
        assert await source.submit([PromptItem("a", text="x, submitted again")]) == ["a"]  # kept != pending
        assert await source.regenerate(["b", "zz"]) == ["zz"]  # zz: never here (or forgotten)
        again = await source.next()
        assert (again.prompt_id, again.text) == ("b", "y") and again.append_key != b.append_key  # a new Append
        assert await source.ledger.forget_appended(4) == 1  # a's kept row (v3); b's new row is pending
        assert await source.regenerate(["a"]) == ["a"]
        assert [p.prompt_id for p in await source.ledger.pending()] == ["a", "b"]
        source.ledger.close()
    run(scenario())


def test_a_group_dropped_before_its_prompts_end_was_written_is_generated_again_under_a_new_row(ledger_db):
    """A commit between a group's Append and its prompt's end (sync mode): the dropped group's row is
    still pending. It is replaced (a new row, a new append key), and the late end of the old row is a
    no-op: before, the prompt was reported as gone from the ledger and the late end ended it, lost."""
    async def scenario():
        source = PromptSource(PromptLedger(ledger_db))
        await source.submit([PromptItem(p, text=p) for p in ("a", "b", "c")])
        a, b, c = [await source.next() for _ in range(3)]
        # a's Append went out, its end is not written; b's group is some other row's (not replaceable).
        assert await source.regenerate(["a", "b"], unconfirmed={a.ledger_seq}) == ["b"]
        again = await source.next()
        assert again.prompt_id == "a" and again.append_key != a.append_key
        await source.done(a, retain_at_version=1)  # the late end finds no row
        assert [p.prompt_id for p in await source.ledger.pending()] == ["b", "c", "a"]
        assert source.pending == 3 and await source.ledger.count() == 3
        assert await source.ledger.attempted(b) == 1  # b's own row, counted
        await source.done(again, retain_at_version=2)
        await source.done(b)
        assert [p.prompt_id for p in await source.ledger.pending()] == ["c"] and source.pending == 1
        source.ledger.close()
    run(scenario())


def test_after_a_restart_a_pending_rows_dropped_group_is_generated_again_under_a_new_row(ledger_db):
    """Killed after a group's Append and before its prompt's end: the restarted collector queues the
    row, whose Append would find the earlier group and end it. A commit that drops that group first
    replaces the row: queued, its item leaves the queue; out, it is dropped when it comes back (a
    retry's attempt count on it fails nothing)."""
    async def first_life():
        source = PromptSource(PromptLedger(ledger_db))
        await source.submit([PromptItem(p, text=p) for p in ("a", "b", "c")])
        taken = [await source.next() for _ in range(3)]
        source.ledger.close()  # a crash: all three out, a's and b's groups appended
        return taken

    async def second_life():
        source = PromptSource(PromptLedger(ledger_db))
        assert await source.restore() == 3
        out = await source.next()  # a is out again; b and c are queued
        assert out.prompt_id == "a"
        assert await source.regenerate(["a", "b"]) == []  # b's queued item left the queue
        assert source.pending == 4  # a's old item is still out
        assert await source.ledger.attempted(out) == 1  # its row is gone: counted on the item alone
        source.requeue(out)  # it comes back (discarded or retried): dropped, its new row is queued
        assert source.pending == 3
        order = [(await source.next()) for _ in range(3)]
        assert [p.prompt_id for p in order] == ["c", "a", "b"]
        assert len({p.append_key for p in order} | {out.append_key}) == 4
        assert source.pending == 3 and await source.ledger.count() == 3
        for item in order:
            await source.done(item)
        assert source.pending == 0 and await source.ledger.count() == 0
        source.ledger.close()

    run(first_life())
    run(second_life())


def test_dead_letters_keep_the_newest_and_count_all(ledger_db):
    async def scenario():
        store = PromptLedger(ledger_db, max_dead_letters=3)
        items = await store.add([PromptItem(f"p{i}", text="x") for i in range(5)])
        for item in items:
            await store.dead(item, "generation", "INTERNAL", f"boom {item.prompt_id}")
        failures, total = await store.failures(0, 100)
        assert total == 5 and [f.prompt_id for f in failures] == ["p2", "p3", "p4"]
        after, _ = await store.failures(failures[0].seq, 1)
        assert [f.prompt_id for f in after] == ["p3"]
        assert await store.count() == 0
        store.close()
    run(scenario())


class _Pool:
    """Stands in for ReplicaPool: probes answer what the replica now serves."""

    def __init__(self, serving, on_probe=None):
        self.serving, self.on_probe, self.failed = serving, on_probe, []

    async def probe(self, replica):
        if self.on_probe is not None:
            self.on_probe()
        return self.serving

    async def mark_failed(self, replica, error):
        replica.healthy = False
        self.failed.append(error)


class _Fanout:
    def __init__(self):
        self.pushes, self.busy = 0, False


def check_in_rotation(serving, on_probe=None, busy=False):
    from rlfleet.services.collector.replicas import Replica
    from rlfleet.services.collector.watchers import ReplicaWatch

    pool, fanout = _Pool(serving, on_probe), _Fanout()
    fanout.busy = busy
    watch = ReplicaWatch(pool, None, fanout, None, check_seconds=1, refresh_seconds=1, startup_seconds=1)
    replica = Replica("gen:1", None, None, healthy=True, policy_version=7)
    if on_probe is not None:
        pool.on_probe = lambda: on_probe(fanout)
    run(watch.check_in_rotation(replica))
    return replica.healthy, pool.failed


def test_a_replica_in_rotation_that_restarted_is_taken_out_for_a_resync():
    assert check_in_rotation(7) == (True, [])
    assert check_in_rotation(0) == (False, ["serves version 0, not 7 (restarted?)"])
    assert check_in_rotation(None) == (True, [])  # unreachable: its calls will tell
    assert check_in_rotation(0, busy=True) == (True, [])  # a push in flight: versions are moving

    def push_meanwhile(fanout):
        fanout.pushes += 1
    assert check_in_rotation(8, on_probe=push_meanwhile) == (True, [])  # judged at the next check


@pytest.mark.parametrize("field,value,message", [
    ("temperature", 2.5, "prompts[3].sampling.temperature must be 0 (greedy) or in [0.01, 2.0]"),
    ("temperature", float("nan"), "prompts[3].sampling.temperature"),
    ("top_p", 1.5, "prompts[3].sampling.top_p must be in (0, 1]"),
    ("max_tokens", -1, "prompts[3].sampling.max_tokens must be >= 1"),
    ("stop", [""], "prompts[3].sampling.stop must not contain empty strings"),
    ("stop", ["x"] * 17, "prompts[3].sampling.stop has 17 strings, at most 16"),
    ("min_tokens", 100, "prompts[3].sampling.min_tokens must be in [0, max_tokens=64]"),
])
def test_submitted_prompts_are_refused_at_once_by_the_generation_rules_naming_the_field(field, value, message):
    from rlfleet.services.collector.prompt_item import from_spec
    from rlfleet.v1 import collector_pb2, sampling_pb2

    defaults = {"temperature": 1.0, "max_tokens": 64}
    check = dict(max_prompt_bytes=1 << 20, sampling_defaults=defaults, group_size=4)
    spec = collector_pb2.PromptSpec(prompt=sampling_pb2.Prompt(text="hi"), sampling=sampling_pb2.SamplingParams())
    if isinstance(value, list):
        getattr(spec.sampling, field).extend(value)
    else:
        setattr(spec.sampling, field, value)
    with pytest.raises(InvalidArgument) as err:
        from_spec(spec, "prompts[3]", **check)
    assert message in str(err.value)
    good = collector_pb2.PromptSpec(prompt_id="p", prompt=sampling_pb2.Prompt(text="hi"),
                                    sampling=sampling_pb2.SamplingParams(n=8, temperature=0.01, max_tokens=4))
    assert from_spec(good, "p", **check).sampling == {"temperature": pytest.approx(0.01), "max_tokens": 4}  # n: the group's
    with pytest.raises(InvalidArgument, match="max_prompt_bytes"):
        from_spec(collector_pb2.PromptSpec(prompt=sampling_pb2.Prompt(text="x" * 2000)), "prompts[0]",
                  **{**check, "max_prompt_bytes": 1000})
    with pytest.raises(InvalidArgument, match=r"prompts\[0\].prompt.chat.messages\[0\].role: 'robot'"):
        from_spec(collector_pb2.PromptSpec(prompt=sampling_pb2.Prompt(chat=sampling_pb2.ChatMessages(
            messages=[sampling_pb2.ChatMessage(role="robot", content="hi")]))), "prompts[0]", **check)


def test_repeated_sampling_overrides_are_kept_as_lists_that_the_ledger_can_store(tmp_path):
    """The fuzz found SubmitPrompts answering INTERNAL for a prompt overriding ``stop``: the repeated
    field went to the ledger's JSON as a protobuf container. It is a list now, and round-trips."""
    from rlfleet.services.collector.prompt_item import from_spec
    from rlfleet.v1 import collector_pb2, sampling_pb2

    spec = collector_pb2.PromptSpec(prompt_id="s", prompt=sampling_pb2.Prompt(text="hi"),
                                    sampling=sampling_pb2.SamplingParams(stop=["\n", "END"], stop_token_ids=[7]))
    item = from_spec(spec, "prompts[0]", max_prompt_bytes=1 << 20, sampling_defaults={"max_tokens": 8}, group_size=2)
    assert item.sampling == {"stop": ["\n", "END"], "stop_token_ids": [7]}

    async def scenario():
        store = PromptLedger(tmp_path / "prompts.sqlite3")
        await store.add([item])
        (back,) = await store.pending()
        store.close()
        return back
    assert run(scenario()).sampling == {"stop": ["\n", "END"], "stop_token_ids": [7]}


class _UpstreamEndedFirst:
    """A StreamBatches call to the trajectory service that refuses the first message: a write racing
    its end fails, and grpc's aio client then reports the call as INTERNAL, the real status lost."""

    def __init__(self):
        self.written = []
        self.ended = asyncio.Event()

    def _lost(self):
        import grpc
        return grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                    details="Internal error from Core")

    async def write(self, message):
        if self.written:
            self.ended.set()
            raise self._lost()
        self.written.append(message)

    async def read(self):
        await self.ended.wait()
        raise self._lost()

    async def done_writing(self):
        pass

    def cancel(self):
        pass


def test_the_batch_proxy_answers_aborted_not_internal_when_the_upstream_ends_the_stream_first():
    """Fuzz finding: a trainer's bad first message through the collector sometimes got INTERNAL."""
    from types import SimpleNamespace

    from rlfleet.services.collector.servicer import TrajectoryProxyServicer
    from rlfleet.services.common.errors import Aborted
    from rlfleet.v1 import trajectory_pb2

    upstream = _UpstreamEndedFirst()
    collector = SimpleNamespace(trajectory=SimpleNamespace(StreamBatches=lambda metadata: upstream),
                                settings=SimpleNamespace(metadata=lambda: ()), gate=VersionGate(),
                                check_trainer_call=lambda metadata: None, failed=asyncio.Event(), commits=None)

    async def trainer():
        yield trajectory_pb2.StreamBatchesRequest(nack=trajectory_pb2.NackBatch(lease_id="no-such-lease"))
        yield trajectory_pb2.StreamBatchesRequest(open=trajectory_pb2.OpenBatchStream(batch_size=1))

    async def stream():
        return [r async for r in TrajectoryProxyServicer(collector).StreamBatches(trainer(), SimpleNamespace(invocation_metadata=tuple))]

    with pytest.raises(Aborted, match="ended the batch stream before message 1 was forwarded"):
        asyncio.run(stream())


class _UpstreamOneBatch:
    """A StreamBatches call to the trajectory service that delivers one batch, then keeps the stream open."""

    def __init__(self):
        self.written = []
        self.delivered = False

    async def write(self, message):
        self.written.append(message)

    async def read(self):
        if not self.delivered:
            self.delivered = True
            from rlfleet.v1 import trajectory_pb2
            return trajectory_pb2.StreamBatchesResponse(lease_id="lease-1")
        await asyncio.Event().wait()  # nothing more: open until cancelled

    async def done_writing(self):
        pass

    def cancel(self):
        pass


def test_the_batch_proxy_ends_at_once_on_a_bad_message_that_came_while_it_yielded_a_batch():
    """The trainer's bad message arrived while the proxy was handing a batch over: it used to be missed,
    and the stream hung (the upstream keeps it open) until the trainer's deadline."""
    from types import SimpleNamespace

    from rlfleet.services.collector.servicer import TrajectoryProxyServicer
    from rlfleet.services.common.errors import InvalidArgument
    from rlfleet.v1 import trajectory_pb2

    upstream = _UpstreamOneBatch()
    collector = SimpleNamespace(trajectory=SimpleNamespace(StreamBatches=lambda metadata: upstream),
                                settings=SimpleNamespace(metadata=lambda: ()), gate=VersionGate(),
                                check_trainer_call=lambda metadata: None, failed=asyncio.Event(), commits=None)
    batch_read, bad_message_read = asyncio.Event(), asyncio.Event()

    async def trainer():
        yield trajectory_pb2.StreamBatchesRequest(open=trajectory_pb2.OpenBatchStream(batch_size=1))
        await batch_read.wait()
        bad_message_read.set()  # the proxy's reader gets the raise below in this same step, and ends with it
        raise InvalidArgument("TrajectoryService/StreamBatches: the request is not a valid protobuf message")

    async def stream():
        responses = TrajectoryProxyServicer(collector).StreamBatches(trainer(), SimpleNamespace(invocation_metadata=tuple))
        assert (await anext(responses)).lease_id == "lease-1"
        batch_read.set()
        await asyncio.wait_for(bad_message_read.wait(), 10)  # read while the proxy is suspended at its yield
        await asyncio.wait_for(anext(responses), 10)

    with pytest.raises(InvalidArgument, match="not a valid protobuf message"):
        asyncio.run(stream())


def test_response_versions_expand_the_replicas_spans_and_refuse_a_gap():
    sample = generation_pb2.GenerateResponse(policy_version_start=4, policy_version_end=5)
    assert response_versions(sample, 3).tolist() == [4, 4, 4]  # no spans (no token labelled): the start version
    sample.policy_version_spans.add(version=4, start=0, end=2)
    sample.policy_version_spans.add(version=5, start=2, end=5)
    assert response_versions(sample, 5).tolist() == [4, 4, 5, 5, 5]
    with pytest.raises(WireError, match=r"policy_version_spans: cover tokens \[0, 5\) of 6"):
        response_versions(sample, 6)
    sample.policy_version_spans[1].start = 3
    with pytest.raises(WireError, match=r"policy_version_spans\[1\]: starts at token 3, not 2"):
        response_versions(sample, 5)
