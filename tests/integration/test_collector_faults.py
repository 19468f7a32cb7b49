"""The collector's failure modes, each through a real collector process beside real services:
a SIGKILL right after a push returned and in the middle of one, a collector on PostgreSQL SIGKILLed
and restarted on "another node" (an empty state directory) from the database alone, malformed dataset
rows, an unparseable dataset and a bad sampling config at start, and a background task that dies."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from rlfleet.client import connect
from rlfleet.client.errors import FailedPreconditionError
from rlfleet.services.launch import ServiceProcess
from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite
from rlfleet.v1 import (collector_pb2, collector_pb2_grpc, generation_pb2, generation_pb2_grpc, sampling_pb2,
                        trajectory_pb2, trajectory_pb2_grpc, weights_pb2)
from rlfleet.wire import decode_tensor
from rlfleet.wire.push_messages import iter_push_messages
from tests.hf_reference import load_hf
from tests.interposer import Interposer
from tests.waiting import wait_for

GROUP = 2
ENGINE_START_SECONDS = 300
"""A vLLM engine start here is ~30 s; a loaded 2-core CI machine can take several times that."""
SETTLE_SECONDS = 180
"""A few groups of 2 x 16 tokens through the whole pipeline, or a replica re-sync (probed every 0.5 s)."""


@pytest.fixture(scope="module")
def backends(tiny_model_dir, tmp_path_factory):
    """reference, reward, trajectory and one generation replica (shared); collectors are per test."""
    options = SuiteOptions(model_dir=tiny_model_dir, generation_replicas=1, kv_cache_bytes=128 << 20,
                           generation_args=["--max-num-seqs", "16"])
    procs = start_suite(options, tmp_path_factory.mktemp("faults"), without_collector=True)
    yield procs
    stop_suite(procs)


def collector_args(backends, state_dir, *extra: str) -> list[str]:
    return ["--generation-addresses", json.dumps([backends["generation-0"].address]),
            "--reference-address", backends["reference"].address, "--reward-address", backends["reward"].address,
            "--trajectory-address", backends["trajectory"].address, "--state-dir", str(state_dir),
            "--group-size", str(GROUP), "--sampling", json.dumps({"temperature": 1.0, "max_tokens": 16}),
            "--reward-fn", "char_fraction", "--replica-check-seconds", "0.5", "--log-format", "text", *extra]


def start_collector(backends, workdir, *extra: str, port: int | None = None, preexec_fn=None) -> ServiceProcess:
    args = collector_args(backends, workdir / "state", *extra) + (["--port", str(port)] if port else [])
    return ServiceProcess("collector", args, preexec_fn=preexec_fn).start(workdir / "proc")


def ready(proc: ServiceProcess) -> ServiceProcess:
    proc.wait_ready(ENGINE_START_SECONDS)
    return proc


def groups_read(client, prompt_ids: set[str]) -> dict[str, set[int]]:
    """Read (and ack) batches until every one of ``prompt_ids`` arrived as a whole group; the group
    ids of each. Rows of other prompts (left in the shared buffer by another test) are acked too."""
    seen: dict[str, list[int]] = {p: [] for p in prompt_ids}
    with client.batches(batch_size=GROUP, whole_groups=True, idle_timeout=SETTLE_SECONDS) as batches:
        for batch in batches:
            for prompt_id, group_id in zip(batch["prompt_id"], batch["group_id"].tolist()):
                if prompt_id in seen:
                    seen[prompt_id].append(group_id)
            if all(len(rows) >= GROUP for rows in seen.values()):
                break
    return {p: set(rows) for p, rows in seen.items()}


@pytest.mark.slow
@pytest.mark.vllm
def test_a_collector_killed_right_after_a_push_returned_comes_back_at_that_version(
        backends, tmp_path, tiny_model_dir):
    """The version the trainer was told is committed survives a SIGKILL at once after the push
    returns: the restarted collector serves it, its replica stays in rotation, nothing submitted
    is lost and the next push commits the version after it (before: it came back one version
    behind its replica, could never re-sync it, and every later push failed)."""
    state = load_hf(tiny_model_dir).state_dict()
    collector = ready(start_collector(backends, tmp_path))
    port = collector.port
    with connect(collector.address, timeout=60) as client:
        client.wait_ready(timeout=SETTLE_SECONDS)
        before = client.policy_version
        pushed = client.push_weights(state, progress=False)
        collector.kill()  # at once: the reply was the last thing it sent
        assert pushed.version == before + 1
    prompt_ids = [f"after-push-{i}" for i in range(3)]
    collector = ready(start_collector(backends, tmp_path, port=port))
    try:
        with connect(collector.address, timeout=60) as client:
            client.wait_ready(timeout=SETTLE_SECONDS)
            assert client.policy_version == pushed.version
            status = client.status()
            assert [(r.healthy, r.policy_version) for r in status.replicas] == [(True, pushed.version)]
            client.submit_prompts([{"prompt_id": p, "prompt": f"say {i}"} for i, p in enumerate(prompt_ids)])
            groups = groups_read(client, set(prompt_ids))
            assert all(len(ids) == 1 for ids in groups.values()), groups  # one whole group each
            assert client.push_weights(state, progress=False).version == pushed.version + 1
    finally:
        collector.stop()


@pytest.mark.slow
@pytest.mark.vllm
def test_a_collector_killed_in_the_middle_of_a_push_keeps_the_old_version_and_goes_on(
        backends, tmp_path, tiny_model_dir):
    """Killed while the trainer's chunks still come (half of them sent): nothing committed, the
    replica serves the old version, prompts submitted before the kill are all generated after the
    restart, and the trainer's retried push commits."""
    state = load_hf(tiny_model_dir).state_dict()
    collector = ready(start_collector(backends, tmp_path, "--mode", "sync", "--groups-per-step", "1"))
    port = collector.port
    prompt_ids = [f"mid-push-{i}" for i in range(4)]
    with connect(collector.address, timeout=60) as client:
        client.wait_ready(timeout=SETTLE_SECONDS)
        before = client.policy_version
        client.submit_prompts([{"prompt_id": p, "prompt": f"count to {i}"} for i, p in enumerate(prompt_ids)])
    messages = list(iter_push_messages(list(state.items()), version=0, chunk_bytes=64 << 10))
    assert len(messages) > 4
    half_sent, never = threading.Event(), threading.Event()

    def requests():
        for index, (kind, message) in enumerate(messages):
            if index == len(messages) // 2:
                half_sent.set()
                never.wait(SETTLE_SECONDS)  # the collector dies meanwhile
                return
            yield collector_pb2.PushWeightsRequest(**{kind: message})

    outcome: list[BaseException] = []

    def push():
        channel = grpc.insecure_channel(collector.address)
        try:
            collector_pb2_grpc.CollectorServiceStub(channel).PushWeights(requests(), timeout=SETTLE_SECONDS)
        except grpc.RpcError as exc:
            outcome.append(exc)
        finally:
            channel.close()

    pusher = threading.Thread(target=push)
    pusher.start()
    assert half_sent.wait(SETTLE_SECONDS)
    collector.kill()
    never.set()
    pusher.join(SETTLE_SECONDS)
    assert outcome and outcome[0].code() == grpc.StatusCode.UNAVAILABLE
    collector = ready(start_collector(backends, tmp_path, "--mode", "sync", "--groups-per-step", "1", port=port))
    try:
        with connect(collector.address, timeout=60) as client:
            client.wait_ready(timeout=SETTLE_SECONDS)
            assert client.policy_version == before
            status = client.status()
            assert [(r.healthy, r.policy_version) for r in status.replicas] == [(True, before)]
            got: set[str] = set()
            while got != set(prompt_ids):  # sync mode, one group per step: a push after each
                got |= _one_group(client, set(prompt_ids) - got)
                client.push_weights(state, progress=False)
            assert client.policy_version > before
            assert client.failures()[1] == 0
    finally:
        collector.stop()


@pytest.mark.slow
@pytest.mark.vllm
def test_a_collector_on_postgresql_killed_mid_run_resumes_on_another_node_from_the_database_alone(
        backends, tmp_path, tiny_model_dir, postgres):
    """The collector's node is lost: SIGKILLed with prompts in flight, its state directory gone with it. A
    new collector with another, empty state directory and the same database resumes at the committed
    version; the replica, meanwhile given other weights under another version (as a replica restarted
    from another checkpoint would serve), is re-synced from the weights spooled in PostgreSQL (its
    log-probs are the committed weights' again), and the run goes on: every prompt submitted is generated,
    each group arrives once, nothing is dead-lettered, and the next push commits."""
    url = postgres.create_database()
    state = load_hf(tiny_model_dir).state_dict()
    replica = backends["generation-0"]
    first = ready(ServiceProcess("collector", collector_args(backends, tmp_path / "node-a", "--database-url", url))
                  .start(tmp_path / "proc-a"))
    early, late = [f"pg-early-{i}" for i in range(2)], [f"pg-late-{i}" for i in range(4)]
    with connect(first.address, timeout=60) as client:
        client.wait_ready(timeout=SETTLE_SECONDS)
        pushed = client.push_weights(state, progress=False).version
        committed_weights = _seeded_sample(replica)
        client.submit_prompts([{"prompt_id": p, "prompt": f"say {p}"} for p in early])
        assert all(len(ids) == 1 for ids in groups_read(client, set(early)).values())
        client.submit_prompts([{"prompt_id": p, "prompt": f"say {p}"} for p in late])
    first.kill()  # the node is lost: whatever was in flight, and its state directory with it
    assert not (tmp_path / "node-a").exists()  # nothing durable was there: the database holds it all

    _push_to_replica(replica, {name: tensor * 0.5 for name, tensor in state.items()}, pushed + 5)
    assert not _same_sample(_seeded_sample(replica), committed_weights)

    second = ready(ServiceProcess("collector", collector_args(backends, tmp_path / "node-b", "--database-url", url))
                   .start(tmp_path / "proc-b"))
    try:
        with connect(second.address, timeout=60) as client:
            assert client.policy_version == pushed
            wait_for(lambda: [(r.healthy, r.policy_version) for r in client.status().replicas] == [(True, pushed)],
                     SETTLE_SECONDS, "the replica re-synced from the database's spool, in rotation")
            assert f"re-synced to version {pushed}" in second.log_path.read_text()
            assert _same_sample(_seeded_sample(replica), committed_weights)
            seen: dict[str, set[int]] = {p: set() for p in early + late}
            with client.batches(batch_size=GROUP, whole_groups=True, idle_timeout=SETTLE_SECONDS) as batches:
                for batch in batches:
                    for prompt_id, group_id in zip(batch["prompt_id"], batch["group_id"].tolist()):
                        if prompt_id in seen:
                            seen[prompt_id].add(group_id)
                    if all(seen[p] for p in late):
                        break
            assert all(len(seen[p]) == 1 for p in late) and not any(seen[p] for p in early), seen
            wait_for(lambda: client.status().pending_prompts == 0, SETTLE_SECONDS, "the ledger to empty")
            assert client.failures()[1] == 0
            assert client.push_weights(state, progress=False).version == pushed + 1
            assert client.status().spool_error == ""
        assert not (tmp_path / "node-b").exists()
    finally:
        second.stop()


def _push_to_replica(replica: ServiceProcess, state: dict, version: int) -> None:
    """Weights straight to the replica (no collector), as its own checkpoint at another version."""
    requests = (generation_pb2.UpdateWeightsRequest(**{kind: message})
                for kind, message in iter_push_messages(list(state.items()), version=version, chunk_bytes=1 << 20))
    with grpc.insecure_channel(replica.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        replies = list(stub.UpdateWeights(requests, timeout=SETTLE_SECONDS))
    assert replies[-1].phase == weights_pb2.WEIGHT_PHASE_APPLIED


def _seeded_sample(replica: ServiceProcess) -> tuple[list[int], torch.Tensor]:
    """One seeded sample's tokens and behaviour log-probs: what the replica's weights compute."""
    request = generation_pb2.GenerateRequest(
        prompt=sampling_pb2.Prompt(text="the weights say"),
        sampling=sampling_pb2.SamplingParams(temperature=1.0, seed=7, max_tokens=8))
    with grpc.insecure_channel(replica.address) as channel:
        (sample,) = list(generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=SETTLE_SECONDS))
    return decode_tensor(sample.response_token_ids).tolist(), decode_tensor(sample.behavior_log_probs).clone()


def _same_sample(a: tuple[list[int], torch.Tensor], b: tuple[list[int], torch.Tensor]) -> bool:
    return a[0] == b[0] and torch.allclose(a[1], b[1], atol=1e-4)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("fault", ["confirmed-late", "killed-before-confirming"])
def test_a_group_a_commit_drops_before_its_prompt_is_confirmed_is_generated_again(
        backends, tmp_path, tiny_model_dir, fault):
    """Sync mode. The trajectory service has appended a group (durable) and its answer has not reached
    the collector when a push commits and drops the group as stale. The answer then arrives late; or
    the collector is SIGKILLed first and restarts, generates the prompt again and that Append finds the
    dropped group's key. Either way the prompt is generated again and the trainer gets one whole group
    of it, at the new version. (Before: the prompt's row was still pending when the drop looked for it,
    "not generated again", and the late end removed it: the group was lost and a sync trainer's batch
    never filled.) An interposer between the collector and the store holds the Append's answer."""
    state = load_hf(tiny_model_dir).state_dict()
    interposer = Interposer(backends["trajectory"].address, [
        trajectory_pb2.DESCRIPTOR.services_by_name["TrajectoryService"],
        health_pb2.DESCRIPTOR.services_by_name["Health"]])
    args = ("--mode", "sync", "--groups-per-step", "1", "--trajectory-address", interposer.address)
    held = interposer.hold("Append")
    collector = ready(start_collector(backends, tmp_path, *args))
    prompt_id = f"dropped-{fault}"
    try:
        with connect(collector.address, timeout=60) as client:
            client.wait_ready(timeout=SETTLE_SECONDS)
            before = client.policy_version
            client.submit_prompts([{"prompt_id": prompt_id, "prompt": "spell it"}])
            assert held.answered.wait(SETTLE_SECONDS), "the group's Append never reached the store"
        if fault == "killed-before-confirming":
            collector.kill()  # the store has the group; its answer never reaches the collector
            held.release()
            held = interposer.hold("Append")  # the restarted collector's Append of the same prompt
            collector = ready(start_collector(backends, tmp_path, *args, port=collector.port))
        with connect(collector.address, timeout=60) as client:
            client.wait_ready(timeout=SETTLE_SECONDS)
            if fault == "killed-before-confirming":
                assert held.answered.wait(SETTLE_SECONDS), "the restarted collector never appended"
            drops = interposer.answered["DropStale"]
            assert client.push_weights(state, progress=False).version == before + 1
            interposer.wait_answered("DropStale", drops + 1, SETTLE_SECONDS)  # the group is deleted
            wait_for(lambda: "prompts generated again" in collector.log_tail(400), SETTLE_SECONDS,
                     "the collector to regenerate the dropped group's prompt")
            held.release()  # now the Append's answer arrives
            groups = groups_read(client, {prompt_id})
            assert len(groups[prompt_id]) == 1, groups  # one whole group, not none and not two
            wait_for(lambda: client.status().pending_prompts == 0, SETTLE_SECONDS, "the ledger to empty")
    finally:
        collector.stop()
        interposer.close()


def _one_group(client, prompt_ids: set[str]) -> set[str]:
    """Read until one whole group of ``prompt_ids`` arrived; its prompt id."""
    with client.batches(batch_size=GROUP, whole_groups=True, idle_timeout=SETTLE_SECONDS) as batches:
        for batch in batches:
            arrived = set(batch["prompt_id"]) & prompt_ids
            if arrived:
                return arrived
    return set()


BAD_ROWS = [
    {"prompt": 42},                                          # not a prompt
    {"prompt": [{"role": "user"}]},                          # a chat message without content
    ["a", "row", "that", "is", "a", "list"],                 # not an object
    {"question": "where is the prompt field?"},              # no prompt field
]


@pytest.mark.slow
@pytest.mark.vllm
def test_malformed_dataset_rows_are_dead_lettered_with_their_reasons_while_the_good_rows_flow(
        backends, tmp_path):
    """Rows 2-5 malformed, 1 and 6-8 good (the outsider's dataset that used to stall a SERVING
    collector forever): the four good rows arrive as groups, the four bad ones are dead letters
    naming the row and what is wrong, and the collector serves throughout."""
    good = [{"prompt": f"good row {i}", "answer": str(i)} for i in range(4)]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps(row) for row in [good[0], *BAD_ROWS, *good[1:]]) + "\n")
    collector = ready(start_collector(backends, tmp_path, "--dataset-path", str(dataset), "--epochs", "1",
                                      "--shuffle", "false"))
    try:
        with connect(collector.address, timeout=60) as client:
            client.wait_ready(timeout=SETTLE_SECONDS)
            groups = groups_read(client, {"row0@e0", "row5@e0", "row6@e0", "row7@e0"})
            assert all(len(ids) == 1 for ids in groups.values()), groups
            failures, total = client.failures()
            assert total == 4
            reasons = {f.prompt_id: (f.stage, f.code, f.error) for f in failures}
            assert set(reasons) == {"row1@e0", "row2@e0", "row3@e0", "row4@e0"}
            assert {stage for stage, _, _ in reasons.values()} == {"dataset"}
            assert {code for _, code, _ in reasons.values()} == {"INVALID_ARGUMENT"}
            assert "dataset row 1.prompt: must be a non-empty string or a list of chat messages, got int" \
                in reasons["row1@e0"][2]
            assert "dataset row 2.prompt[0].content: must be a string, got nothing" in reasons["row2@e0"][2]
            assert "dataset row 3: a row must be an object, got list" in reasons["row3@e0"][2]
            assert "dataset row 4: no field 'prompt'" in reasons["row4@e0"][2]
            status = client.status()
            assert status.serving and status.failed_prompts == 4
    finally:
        collector.stop()


@pytest.mark.slow
@pytest.mark.vllm
def test_a_background_task_that_dies_takes_the_collector_to_not_serving_and_every_call_says_why(
        backends, tmp_path):
    """The collector's disk fills up (a file-size limit on its process: writes past 256 KiB fail)
    while it draws dataset prompts into its ledger: the rollout loop dies. Health turns NOT_SERVING,
    GetStatus and every trainer call (policy version, push, submit, batch stream) answer
    FAILED_PRECONDITION naming the task and the error, and the log holds the traceback. Never a
    SERVING collector that silently generates nothing."""
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"prompt number {i} " + "x" * 2000}) + "\n" for i in range(64)))

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

    collector = start_collector(backends, tmp_path, "--dataset-path", str(dataset), "--groups-per-step", "1000",
                                "--log-level", "WARNING", preexec_fn=small_disk)
    try:
        collector.wait_listening(ENGINE_START_SECONDS)
        channel = grpc.insecure_channel(collector.address)
        stub = collector_pb2_grpc.CollectorServiceStub(channel)
        status = wait_for(lambda: _failed_status(stub), SETTLE_SECONDS, "the collector to report its failure")
        # The rollout loop (drawing a prompt) or a group's task (ending one) met the full disk first.
        assert re.search(r"the rollout (loop|task of prompt '\w+@e0') died: OperationalError", status.not_serving_reason)
        assert collector.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        with connect(collector.address, timeout=30) as client:
            assert client.status().failed
            for call in (lambda: client.wait_ready(timeout=30), lambda: client.policy_version,
                         lambda: client.submit_prompts(["hello"]),
                         lambda: client.push_weights({"w": torch.zeros(4)}, progress=False),
                         lambda: next(iter(client.batches(batch_size=GROUP)))):
                with pytest.raises(FailedPreconditionError, match=r"the rollout (loop|task of prompt .*) died: OperationalError"):
                    call()
        stream = trajectory_pb2_grpc.TrajectoryServiceStub(channel).StreamBatches(iter([
            trajectory_pb2.StreamBatchesRequest(open=trajectory_pb2.OpenBatchStream(batch_size=GROUP))]), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            next(stream)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "Traceback" in collector.log_path.read_text()
        channel.close()
    finally:
        collector.stop()


def _failed_status(stub):
    status = stub.GetStatus(collector_pb2.GetStatusRequest(), timeout=30)
    return status if "died" in status.not_serving_reason else None


def run_collector_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.services.collector", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("sampling,named", [
    ('{"temprature": 1.0, "max_tokens": 16}', "sampling: no field 'temprature'"),
    ('{"temperature": -3, "max_tokens": 16}', "sampling.temperature must be >= 0, got -3.0"),
    ('{"temperature": 1.0, "max_tokens": 0}', "sampling.max_tokens must be >= 1, got 0"),
])
def test_a_bad_sampling_config_is_refused_at_start_naming_the_setting(tmp_path, sampling, named):
    done = run_collector_cli("--sampling", sampling, "--state-dir", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "refusing to start" in done.stderr and "sampling" in done.stderr and named in done.stderr
    assert "Traceback" not in done.stderr


def test_an_unparseable_dataset_is_refused_at_start_naming_the_file_and_line(tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "fine"}\n{"prompt": "fine too"}\n{"prompt": "broken\n')
    done = run_collector_cli("--dataset-path", str(dataset), "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 2, done.stderr
    assert f"dataset_path: {dataset} line 3 column" in done.stderr and "Traceback" not in done.stderr
    nothing = tmp_path / "no-prompt.jsonl"
    nothing.write_text('{"question": "a"}\n{"question": "b"}\n')
    done = run_collector_cli("--dataset-path", str(nothing), "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 2 and "no row of" in done.stderr and "prompt_field 'prompt'" in done.stderr
