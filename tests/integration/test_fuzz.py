"""Property-based fuzz (hypothesis) of every RPC of real trajectory, reward and reference processes.

Each RPC of each service, the shared ones included (grpc.health.v1.Health, rlfleet.v1.DiagnosticsService,
server reflection), gets requests built from its protobuf descriptor by ``tests/fuzz_messages.py``: random
bytes, the empty message, generated messages with boundary values, valid messages with fields replaced,
valid serializations corrupted; client streams get short sequences of them. For every request:

- the status is never UNKNOWN, INTERNAL (a bug), UNAVAILABLE or DATA_LOSS (a crashed or broken server), and
  the process is still alive;
- no call runs into its deadline, except where waiting is the RPC's job (a StreamBatches stream kept open
  after a valid ``open``; Health/Watch is read to its first answer, then cancelled);

and after the fuzz every service is SERVING and answers a normal request as it did before, and the
trajectories appended before the fuzz are still there byte for byte. The environment service (root only, like
``test_environment_service.py``: its sandbox drops to uid 65534) is fuzzed on its own RPCs (the shared ones run
the same code as elsewhere), with counter episodes of ``tests/environments.py`` opened before the fuzz for the
Step and CloseEpisode seeds to name; afterwards a fresh counter episode still runs its three turns token-exactly.
DropStale deletes data by design: it is fuzzed against a trajectory instance of its own, and against a third one
started with ``--batch-schema false`` (any layout is stored: Append, StreamBatches and DropStale then handle rows
that are not the documented ones). Generation and collector need the whole suite with a vLLM engine:
``test_fuzz_suite.py`` fuzzes them with the same machinery (``fuzzing.py``). The status histogram per RPC is printed
at the end of the module and written to ``fuzz-summary.json`` in the module's temporary directory.

``RLFLEET_FUZZ_EXAMPLES`` sets the number of examples (default 150 per RPC of a service's own, a third of
that for the shared services after the first); the run is deterministic unless ``RLFLEET_FUZZ_SEED`` picks
another seed (to explore: ``RLFLEET_FUZZ_SEED=7 RLFLEET_FUZZ_EXAMPLES=2000``).
"""

from __future__ import annotations

import collections
import json
import math
import os
import threading

import pytest
import torch
from grpc_health.v1 import health_pb2
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from rlfleet.services.launch import ServiceProcess
from rlfleet.services.trajectory.rows import concat_rows, split_rows
from rlfleet.v1 import diagnostics_pb2, environment_pb2, reference_pb2, reward_pb2, tensor_pb2, trajectory_pb2
from rlfleet.wire import decode_ragged, decode_tensor
from tests import fuzz_messages
from tests.integration.fuzzing import (CALL_TIMEOUT, CLOSED_EPISODES, DIAGNOSTICS, ENVIRONMENT, FUZZ_SETTINGS, HEALTH,
                                       HELD_OPEN_TIMEOUT, REFERENCE, REWARD, SEED, SHARED, STEPPED_EPISODES,
                                       TRAJECTORY, Fuzzed, check_outcome, episode_request, open_request,
                                       request_plans, reward_request, score_request, send, step_request)
from tests.trajectories import check_rows, groups, make_trajectories
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("RLFLEET_FUZZ_EXAMPLES", "150"))
MAX_LEN = 256
RELEASE_TIMEOUT = HELD_OPEN_TIMEOUT + 3 * CALL_TIMEOUT
"""After the fuzz, until every fuzzed stream's leases are released: a stream held open ends at its deadline,
then the release is one store call (each well under a call's timeout)."""

OWN = {"trajectory": TRAJECTORY, "reward": REWARD, "reference": REFERENCE, "environment": ENVIRONMENT}
AS_ROOT = os.geteuid() == 0
ROOT_ONLY = pytest.mark.skipif(not AS_ROOT, reason="the environment service's sandbox drops to uid 65534: needs root")
ENVIRONMENTS = {"counter": "tests.environments:CounterEnv"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRE_FUZZ = [  # (idempotency key, group ids, first trajectory number, policy version)
    ("pre/0", groups(0, 2, 2), 1000, 0), ("pre/1", groups(2, 2, 2), 1004, 0), ("pre/2", groups(4, 2, 2), 1008, 3)]


def _targets():
    params = []
    for name, own in OWN.items():
        # The shared services run the same code everywhere: fuzzed hardest on the first service, not at all on
        # the environment service (its RPCs are the ones new there).
        for service in (own,) if own is ENVIRONMENT else (own, *SHARED):
            examples = EXAMPLES if service is own or name == "trajectory" else max(1, EXAMPLES // 3)
            for method in service.methods:
                target = "drop" if method.name == "DropStale" else name
                params.append(pytest.param(target, service, method, examples, marks=ROOT_ONLY if own is ENVIRONMENT
                                           else (), id=f"{target}:{service.name}.{method.name}"))
    for method in ("Append", "StreamBatches", "DropStale"):  # in this order: rows of any layout, then their drop
        params.append(pytest.param("loose", TRAJECTORY, TRAJECTORY.methods_by_name[method], max(1, EXAMPLES // 2),
                                   id=f"loose:TrajectoryService.{method}"))
    return params


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    """The services under fuzz, started together; the trajectories of PRE_FUZZ appended and the episodes the
    Step and CloseEpisode seeds name opened before any fuzz."""
    root = tmp_path_factory.mktemp("fuzzed")
    quick = ["--log-format", "text", "--grace-seconds", "1"]  # nothing is in flight at the end: stop fast
    procs = {
        "trajectory": ServiceProcess("trajectory", ["--db-path", str(root / "t.sqlite3"), *quick]),
        "drop": ServiceProcess("trajectory", ["--db-path", str(root / "drop.sqlite3"), *quick]),
        "loose": ServiceProcess("trajectory", ["--db-path", str(root / "loose.sqlite3"), "--batch-schema", "false",
                                               *quick]),
        "reward": ServiceProcess("reward", ["--tokenizer-path", str(tiny_model_dir), "--kl-controller", "adaptive",
                                            "--kl-state-path", str(root / "kl.json"), *quick]),
        "reference": ServiceProcess("reference", ["--model-path", str(tiny_model_dir), *quick],
                                    env={"RLFLEET_REFERENCE_MAX_LEN": str(MAX_LEN),
                                         "RLFLEET_REFERENCE_MAX_REQUEST_TOKENS": "4096"}),
    }
    if AS_ROOT:  # a hanging step would answer DEADLINE_EXCEEDED naming its episode, well within a call's timeout
        procs["environment"] = ServiceProcess(
            "environment", ["--tokenizer-path", str(tiny_model_dir), "--step-timeout-seconds", "5", *quick],
            env={"RLFLEET_ENVIRONMENT_ENVIRONMENTS": json.dumps(ENVIRONMENTS),
                 "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))})
    try:
        for name, proc in procs.items():
            proc.start(root / name)
        fuzzed = {name: Fuzzed(proc.wait_ready(300)) for name, proc in procs.items()}
        trajectory = fuzzed["trajectory"]
        for key, group_ids, first_id, version in PRE_FUZZ:
            trajectories = make_trajectories(group_ids, first_id=first_id, policy_version=version)
            request = trajectory_pb2.AppendRequest(trajectories=trajectories, idempotency_key=key)
            assert trajectory.unary(TRAJECTORY, "Append", request).appended == len(group_ids)
        baselines = {"reward": fuzzed["reward"].unary(REWARD, "ComputeRewards", reward_request()),
                     "reference": fuzzed["reference"].unary(REFERENCE, "ScoreLogProbs", score_request(True))}
        if AS_ROOT:
            openings = [fuzzed["environment"].unary(ENVIRONMENT, "OpenEpisode", episode_request(episode_id))
                        for episode_id in STEPPED_EPISODES + CLOSED_EPISODES]
            assert all(opening == openings[0] for opening in openings)
            baselines["environment"] = openings[0]
        yield fuzzed, baselines
        for target in fuzzed.values():
            target.channel.close()
    finally:
        for proc in procs.values():
            proc.stop()


# ------------------------------------------------------------------ the fuzz


@pytest.mark.parametrize("name,service,method,examples", _targets())
def test_fuzz(fleet, fuzz_log, name, service, method, examples):
    fuzzed, _ = fleet
    target = fuzzed[name]
    rpc = f"{name}:{service.name}.{method.name}"
    plans = request_plans(method)
    if name == "drop":  # rows to drop: sometimes a group at any int64 version first
        versions = st.one_of(st.none(), fuzz_messages.scalars(tensor_pb2.Tensor.DESCRIPTOR.fields_by_name["shape"]))
        plans = st.tuples(plans, versions)
    else:
        plans = st.tuples(plans, st.none())
    appended = iter(range(10**6))

    @settings(max_examples=examples, **FUZZ_SETTINGS)
    @given(plans)
    def fuzz(plan):
        (messages, hold_open), version = plan
        if version is not None:
            group = next(appended)
            request = trajectory_pb2.AppendRequest(
                trajectories=make_trajectories([group, group], first_id=2 * group, policy_version=version))
            target.unary(TRAJECTORY, "Append", request)
        code, details = send(target, service, method, messages, hold_open)
        fuzz_log.record(rpc, code.name + (" (held open)" if hold_open else ""), len(messages))
        check_outcome(target, rpc, messages, hold_open, code, details)

    (fuzz if SEED is None else seed(int(SEED))(fuzz))()


def test_big_requests_below_the_message_limit(fleet, fuzz_log):
    """One request of ~48 MiB per service (the limit is 64 MiB): a status that is not a crash."""
    fuzzed, _ = fleet
    payload = tensor_pb2.TensorDict(batch_size=[1], entries={"blob": tensor_pb2.TensorDictValue(
        tensor=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UINT8, shape=[1, 48 << 20], data=b"\x7f" * (48 << 20)))})
    big = [("trajectory", DIAGNOSTICS, "Echo", diagnostics_pb2.EchoRequest(payload=payload)),
           ("trajectory", TRAJECTORY, "Append", trajectory_pb2.AppendRequest(trajectories=payload)),
           ("reward", REWARD, "ComputeRewards", reward_pb2.ComputeRewardsRequest(prompt_texts=["x" * (48 << 20)])),
           ("reference", REFERENCE, "ScoreLogProbs",
            reference_pb2.ScoreLogProbsRequest(response_starts=[2**62] * (5 << 20)))]
    if "environment" in fuzzed:
        big.append(("environment", ENVIRONMENT, "Step", step_request(STEPPED_EPISODES[0], [5], text="x" * (48 << 20))))
    for name, service, method, request in big:
        raw = request.SerializeToString()
        assert 40 << 20 < len(raw) < 64 << 20
        rpc = f"{name}:{service.name}.{method} (~48 MiB)"
        code, details = send(fuzzed[name], service, service.methods_by_name[method], [raw], hold_open=False)
        fuzz_log.record(rpc, code.name)
        check_outcome(fuzzed[name], rpc, [raw], False, code, details)


# ------------------------------------------------------------------ after the fuzz


def read_batches(target: Fuzzed, opened: trajectory_pb2.StreamBatchesRequest, count: int) -> list:
    """The first ``count`` batches of a stream opened with ``opened`` (none acked), then the stream ends."""
    call = target.channel.stream_stream(f"/{TRAJECTORY.full_name}/StreamBatches",
                                        request_serializer=trajectory_pb2.StreamBatchesRequest.SerializeToString,
                                        response_deserializer=trajectory_pb2.StreamBatchesResponse.FromString)
    read = threading.Event()

    def requests():  # kept open until the batches are read: a half-close would end the stream at once
        yield opened
        read.wait(CALL_TIMEOUT * 3)

    responses = call(requests(), timeout=CALL_TIMEOUT * 3)
    try:
        return [next(responses) for _ in range(count)]
    finally:
        read.set()
        responses.cancel()


def test_every_service_is_serving_and_answers_after_the_fuzz(fleet):
    fuzzed, baselines = fleet
    for name, target in fuzzed.items():
        target.alive()
        own = OWN.get(name, TRAJECTORY)
        for service_name in ("", own.full_name):
            answer = target.unary(HEALTH, "Check", health_pb2.HealthCheckRequest(service=service_name))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, (name, service_name)
        payload = make_trajectories([1, 1, 2], first_id=3)
        echo = target.unary(DIAGNOSTICS, "Echo", diagnostics_pb2.EchoRequest(payload=payload))
        assert echo.payload == payload and echo.decoded_bytes > 0

    reward = fuzzed["reward"]
    after = reward.unary(REWARD, "ComputeRewards", reward_request())
    before = baselines["reward"]
    request = reward_request()
    expected_kl = (decode_ragged(request.behavior_log_probs).values - decode_ragged(request.ref_log_probs).values)
    assert torch.equal(decode_ragged(after.kl).values, expected_kl)  # k1, exactly
    for field in ("kl", "scores", "clipped_scores", "advantages", "kl_mean", "kl_sum"):
        assert getattr(after, field) == getattr(before, field), field
    controller = reward.unary(REWARD, "GetKLController", reward_pb2.GetKLControllerRequest())
    assert math.isfinite(controller.coef) and controller.coef >= 0 and after.kl_coef == controller.coef

    scored = fuzzed["reference"].unary(REFERENCE, "ScoreLogProbs", score_request(True))
    for field in ("ref_log_probs", "entropies"):
        torch.testing.assert_close(decode_ragged(getattr(scored, field)).values,
                                   decode_ragged(getattr(baselines["reference"], field)).values, atol=1e-5, rtol=0)

    drop = fuzzed["drop"]  # DropStale still does its job: everything below 2^64-1 goes, then a group by version
    drop.unary(TRAJECTORY, "DropStale", trajectory_pb2.DropStaleRequest(below_policy_version=2**64 - 1))
    stats = drop.unary(TRAJECTORY, "GetStats", trajectory_pb2.GetStatsRequest())
    assert (stats.ready, stats.leased) == (0, 0)
    append = trajectory_pb2.AppendRequest(trajectories=make_trajectories([77, 77], first_id=0, policy_version=5))
    assert drop.unary(TRAJECTORY, "Append", append).appended == 2
    for below, dropped in [(5, 0), (6, 2)]:
        answer = drop.unary(TRAJECTORY, "DropStale", trajectory_pb2.DropStaleRequest(below_policy_version=below))
        assert answer.dropped == dropped and list(answer.group_ids) == ([77] if dropped else [])


@ROOT_ONLY
def test_the_environment_service_still_runs_a_counter_episode_after_the_fuzz(fleet, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    fuzzed, baselines = fleet
    environment = fuzzed["environment"]
    assert environment.unary(ENVIRONMENT, "OpenEpisode", episode_request("after-fuzz")) == baselines["environment"]
    for turn in (1, 2, 3):
        sampled = tokenizer(f"one {turn}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        answer = environment.unary(ENVIRONMENT, "Step", step_request("after-fuzz", sampled))
        assert (answer.reward, answer.has_reward, answer.done, answer.truncated) == (turn, True, turn == 3, False)
        assert (answer.info["turn"], answer.info["text"]) == (str(turn), f"one {turn}")  # the content, end-of-turn token left out
        observation = tokenizer.decode(decode_tensor(answer.observation_token_ids).tolist())
        if turn < 3:
            assert [(m.role, m.content) for m in answer.observation] == [("user", f"turn {turn}")]
            assert observation == f"\n<|im_start|>user\nturn {turn}<|im_end|>\n<|im_start|>assistant\n"
        else:
            assert (list(answer.observation), observation) == ([], "")
    closed = environment.unary(ENVIRONMENT, "CloseEpisode",
                               environment_pb2.CloseEpisodeRequest(episode_id="after-fuzz"))
    assert (closed.final_reward, closed.has_final_reward) == (30.0, True)


def test_an_instance_storing_any_layout_still_round_trips_after_the_fuzz(fleet):
    loose = fleet[0]["loose"]
    loose.unary(TRAJECTORY, "DropStale", trajectory_pb2.DropStaleRequest(below_policy_version=2**64 - 1))
    stats = loose.unary(TRAJECTORY, "GetStats", trajectory_pb2.GetStatsRequest())
    assert (stats.ready, stats.leased) == (0, 0)
    appended = make_trajectories(groups(0, 2, 2), first_id=0, prompt_ids=True)
    assert loose.unary(TRAJECTORY, "Append", trajectory_pb2.AppendRequest(trajectories=appended)).appended == 4
    (delivered,) = read_batches(loose, open_request(batch_size=4, whole_groups=True), 1)
    assert split_rows(delivered.batch) == split_rows(appended)


def test_trajectories_appended_before_the_fuzz_are_intact(fleet):
    fuzzed, _ = fleet
    trajectory = fuzzed["trajectory"]
    expected: dict[str, bytes] = {}
    for _, group_ids, first_id, version in PRE_FUZZ:
        rows = split_rows(make_trajectories(group_ids, first_id=first_id, policy_version=version))
        expected.update((f"traj-{first_id + i}", row) for i, row in enumerate(rows))

    def stats():
        return trajectory.unary(TRAJECTORY, "GetStats", trajectory_pb2.GetStatsRequest())

    wait_for(lambda: not stats().leased, RELEASE_TIMEOUT, "the leases of ended fuzz streams to be released")
    ready = stats().ready
    # Every ready row, one per batch, all at once (prefetch): nothing is acked, so nothing is deleted.
    delivered: dict[str, list[bytes]] = collections.defaultdict(list)
    for response in read_batches(trajectory, open_request(batch_size=1, prefetch=ready, consumer="after-fuzz"), ready):
        (row,) = split_rows(response.batch)
        delivered[response.batch.entries["trajectory_id"].strings.values[0]].append(row)
    assert sum(map(len, delivered.values())) == ready
    for trajectory_id, row in expected.items():
        assert row in delivered.get(trajectory_id, []), f"{trajectory_id}: missing or changed after the fuzz"
    check_rows(concat_rows(list(expected.values())))  # the rows compared are the ones make_trajectories built
    for key, group_ids, first_id, version in PRE_FUZZ:  # the idempotency keys survived too
        request = trajectory_pb2.AppendRequest(
            trajectories=make_trajectories(group_ids, first_id=first_id, policy_version=version), idempotency_key=key)
        assert trajectory.unary(TRAJECTORY, "Append", request).appended == 0
