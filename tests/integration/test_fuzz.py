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
trajectories appended before the fuzz are still there byte for byte. DropStale deletes data by design:
it is fuzzed against a trajectory instance of its own, and against a third one started with
``--batch-schema false`` (any layout is stored: Append, StreamBatches and DropStale then handle rows
that are not the documented ones). Generation and collector need the whole suite with a vLLM engine:
``test_fuzz_suite.py`` fuzzes them with this module's machinery. The status histogram per RPC is printed
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
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from rlfleet.services.launch import ServiceProcess
from rlfleet.services.trajectory.rows import concat_rows, split_rows
from rlfleet.v1 import diagnostics_pb2, reference_pb2, reward_pb2, tensor_pb2, trajectory_pb2
from rlfleet.wire import Ragged, decode_ragged, encode_ragged
from tests import fuzz_messages
from tests.unit.test_trajectory_store import check_rows, groups, make_trajectories

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("RLFLEET_FUZZ_EXAMPLES", "150"))
CALL_TIMEOUT = 20.0
"""Per call: every RPC here answers a request in well under a second; 20 s absorbs a loaded machine."""
HELD_OPEN_TIMEOUT = 1.0
"""A StreamBatches stream left open after a valid ``open`` waits for batches and acks by design."""
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
             grpc.StatusCode.DATA_LOSS}
VOCAB = 512  # the tiny model's
MAX_LEN = 256

TRAJECTORY = trajectory_pb2.DESCRIPTOR.services_by_name["TrajectoryService"]
REWARD = reward_pb2.DESCRIPTOR.services_by_name["RewardService"]
REFERENCE = reference_pb2.DESCRIPTOR.services_by_name["ReferenceService"]
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
DIAGNOSTICS = diagnostics_pb2.DESCRIPTOR.services_by_name["DiagnosticsService"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
SHARED = (HEALTH, DIAGNOSTICS, REFLECTION)
OWN = {"trajectory": TRAJECTORY, "reward": REWARD, "reference": REFERENCE}
PRE_FUZZ = [  # (idempotency key, group ids, first trajectory number, policy version)
    ("pre/0", groups(0, 2, 2), 1000, 0), ("pre/1", groups(2, 2, 2), 1004, 0), ("pre/2", groups(4, 2, 2), 1008, 3)]
NACK_DELIVERED = object()
"""In a StreamBatches plan: a nack of the lease the stream was delivered (once it was)."""


def _targets():
    params = []
    for name, own in OWN.items():
        for service in (own, *SHARED):
            # The shared services run the same code everywhere: fuzzed hardest on the first service.
            examples = EXAMPLES if service is own or name == "trajectory" else max(1, EXAMPLES // 3)
            for method in service.methods:
                target = "drop" if method.name == "DropStale" else name
                params.append(pytest.param(target, service, method, examples,
                                           id=f"{target}:{service.name}.{method.name}"))
    for method in ("Append", "StreamBatches", "DropStale"):  # in this order: rows of any layout, then their drop
        params.append(pytest.param("loose", TRAJECTORY, TRAJECTORY.methods_by_name[method], max(1, EXAMPLES // 2),
                                   id=f"loose:TrajectoryService.{method}"))
    return params


# ------------------------------------------------------------------ valid requests (seeds)


def _reward_request(**fields) -> reward_pb2.ComputeRewardsRequest:
    """Four samples in two groups with hand-picked log-probs: k1 KL is behaviour - ref, exactly."""
    token_ids = [torch.tensor([5, 17, 40]), torch.tensor([6]), torch.tensor([7, 8]), torch.tensor([9, 10, 11, 12])]
    ref = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-3.0]), torch.tensor([-0.25, -1.5]),
           torch.tensor([-2.0, -2.0, -1.0, -4.0])]
    behaviour = [r + 0.125 * (i + 1) for i, r in enumerate(ref)]
    request = reward_pb2.ComputeRewardsRequest(
        response_token_ids=encode_ragged(Ragged.from_list(token_ids, torch.int64)),
        behavior_log_probs=encode_ragged(Ragged.from_list(behaviour, torch.float32)),
        ref_log_probs=encode_ragged(Ragged.from_list(ref, torch.float32)),
        prompt_texts=["2 plus 3?"] * 4, response_texts=[" it is 5", " 7", " 8 it is", " eight"],
        tasks=[reward_pb2.Task(reward_fn="numeric_match", ground_truth=truth) for truth in ["5", "5", "8", "8"]],
        group_ids=[1, 1, 2, 2], kl_estimator=reward_pb2.KL_ESTIMATOR_K1, advantage_mode=reward_pb2.ADVANTAGE_MODE_GRPO)
    for name, value in fields.items():
        if isinstance(value, list):
            del getattr(request, name)[:]
            getattr(request, name).extend(value)
        else:
            setattr(request, name, value)
    return request


def _score_request(with_entropy=False) -> reference_pb2.ScoreLogProbsRequest:
    sequences = [torch.arange(6) * 7 % VOCAB, torch.tensor([1, 2]), torch.arange(40) * 13 % VOCAB]
    return reference_pb2.ScoreLogProbsRequest(token_ids=encode_ragged(Ragged.from_list(sequences, torch.int64)),
                                              response_starts=[2, 1, 30], with_entropy=with_entropy)


def _open(**fields) -> trajectory_pb2.StreamBatchesRequest:
    return trajectory_pb2.StreamBatchesRequest(open=trajectory_pb2.OpenBatchStream(**fields))


VALID_OPENS = [_open(batch_size=1), _open(batch_size=4, prefetch=2, consumer="fuzz"),
               _open(batch_size=2, whole_groups=True, lease_seconds=0.5), _open(batch_size=3, whole_groups=True),
               _open(batch_size=8, min_policy_version=3), _open(batch_size=12, prefetch=1, lease_seconds=60)]


def _seeds(method) -> list:
    """Valid requests of ``method``: what mutation and corruption start from."""
    tp, rp = trajectory_pb2, reward_pb2
    table = {
        "Append": [tp.AppendRequest(trajectories=make_trajectories(groups(g, 2, 2), first_id=4 * g), idempotency_key=k)
                   for g, k in [(0, ""), (1, "fuzz/1"), (2, "pre/0")]]
                  + [tp.AppendRequest(trajectories=make_trajectories([7], first_id=9, prompt_ids=True)),
                     tp.AppendRequest(trajectories=make_trajectories([8, 8], first_id=5, policy_version=2**62))],
        "StreamBatches": VALID_OPENS + [tp.StreamBatchesRequest(ack=tp.AckBatch(lease_id="0" * 32)),
                                        tp.StreamBatchesRequest(nack=tp.NackBatch(lease_id="no-such-lease"))],
        "GetStats": [tp.GetStatsRequest()],
        "DropStale": [tp.DropStaleRequest(below_policy_version=v) for v in (0, 1, 4, 2**63 - 1, 2**63, 2**64 - 1)],
        "ComputeRewards": [_reward_request(),
                           _reward_request(kl_estimator=rp.KL_ESTIMATOR_K3, update_kl_controller=True),
                           _reward_request(response_texts=[], advantage_mode=rp.ADVANTAGE_MODE_RLOO),
                           _reward_request(tasks=[rp.Task(reward_fn="regex_match", ground_truth="(a+)+$")] * 4),
                           _reward_request(tasks=[rp.Task(reward_fn="reward_model", args={"path": "/"})] * 4)],
        "GetKLController": [rp.GetKLControllerRequest()],
        "CheckTasks": [rp.CheckTasksRequest(tasks=[rp.Task(reward_fn="char_fraction", args={"pattern": "[0-9]"}),
                                                   rp.Task(reward_fn="os:system", ground_truth="true")])],
        "ScoreLogProbs": [_score_request(), _score_request(with_entropy=True)],
        "Check": [health_pb2.HealthCheckRequest(service=s) for s in ("", TRAJECTORY.full_name, "nope")],
        "Watch": [health_pb2.HealthCheckRequest(service=s) for s in ("", REWARD.full_name, "nope")],
        "List": [health_pb2.HealthListRequest()],
        "Echo": [diagnostics_pb2.EchoRequest(payload=make_trajectories([1, 1, 2], first_id=3)),
                 diagnostics_pb2.EchoRequest(payload=tensor_pb2.TensorDict(batch_size=[0]))],
        "ServerReflectionInfo": [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=TRAJECTORY.full_name),
            reflection_pb2.ServerReflectionRequest(file_by_filename="rlfleet/v1/tensor.proto"),
            reflection_pb2.ServerReflectionRequest(all_extension_numbers_of_type="rlfleet.v1.Tensor"),
            reflection_pb2.ServerReflectionRequest(file_containing_extension=reflection_pb2.ExtensionRequest(
                containing_type="rlfleet.v1.Tensor", extension_number=1))],
    }
    return table[method.name]


def _plans(method, seeds: list | None = None) -> st.SearchStrategy:
    """What one example sends: a list of request bytes (and markers), and whether the stream stays open.

    ``seeds``: the valid requests to start from (default ``_seeds(method)``; other fuzz modules pass theirs)."""
    one = fuzz_messages.requests(method.input_type, _seeds(method) if seeds is None else seeds)
    if not method.client_streaming:
        return st.tuples(one.map(lambda raw: [raw]), st.just(False))
    if method.name != "StreamBatches":
        return st.tuples(st.lists(one, min_size=1, max_size=4), st.just(False))
    opened = st.sampled_from(VALID_OPENS).map(lambda m: m.SerializeToString())
    lease_ids = fuzz_messages.scalars(trajectory_pb2.AckBatch.DESCRIPTOR.fields_by_name["lease_id"])
    settle = st.one_of(  # well-formed acks and nacks of leases this stream never had: nothing may change
        lease_ids.map(lambda lease: trajectory_pb2.StreamBatchesRequest(ack=trajectory_pb2.AckBatch(lease_id=lease))),
        lease_ids.map(lambda lease: trajectory_pb2.StreamBatchesRequest(nack=trajectory_pb2.NackBatch(lease_id=lease))),
    ).map(lambda m: m.SerializeToString())
    follow = st.one_of(one, settle, settle, st.just(NACK_DELIVERED))
    return st.one_of(
        st.tuples(st.lists(one, min_size=0, max_size=4), st.just(False)),  # anything, from the first message on
        st.tuples(st.tuples(opened, st.lists(follow, max_size=4)).map(lambda p: [p[0], *p[1]]),
                  st.integers(0, 4).map(lambda k: k == 0)))  # kept open one time in five: each waits its deadline


# ------------------------------------------------------------------ fixtures


class Fuzzed:
    """One service process under fuzz and a channel to it."""

    def __init__(self, proc: ServiceProcess):
        self.proc = proc
        # The services send and take up to 64 MiB; grpc's client default would refuse answers past 4 MiB.
        self.channel = grpc.insecure_channel(proc.address, options=[("grpc.max_receive_message_length", -1),
                                                                    ("grpc.max_send_message_length", -1)])

    def unary(self, service, method: str, request):
        """A normal call (serialized and parsed as usual) of a unary ``method`` of ``service``."""
        answer = fuzz_messages.message_class(service.methods_by_name[method].output_type)
        call = self.channel.unary_unary(f"/{service.full_name}/{method}",
                                        request_serializer=type(request).SerializeToString,
                                        response_deserializer=answer.FromString)
        return call(request, timeout=CALL_TIMEOUT)

    def alive(self) -> None:
        assert self.proc.process.poll() is None, f"{self.proc.name} died; log tail:\n{self.proc.log_tail()}"


class FuzzLog:
    """Outcomes per RPC: printed at the end of the module and written as JSON."""

    def __init__(self):
        self.outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.messages: collections.Counter = collections.Counter()

    def record(self, rpc: str, outcome: str, messages: int = 1) -> None:
        self.outcomes[rpc][outcome] += 1
        self.messages[rpc] += messages

    def summary(self) -> dict:
        return {rpc: {"requests": sum(c.values()), "messages": self.messages[rpc], "statuses": dict(c.most_common())}
                for rpc, c in sorted(self.outcomes.items())}


@pytest.fixture(scope="module")
def fuzz_log(request, tmp_path_factory):
    log = FuzzLog()
    yield log
    summary = log.summary()
    path = tmp_path_factory.mktemp("fuzz") / "fuzz-summary.json"
    path.write_text(json.dumps(summary, indent=1))
    lines = [f"fuzz summary ({sum(s['requests'] for s in summary.values())} requests; {path}):",
             f"  {'rpc':<52} {'calls':>5} {'msgs':>5}  statuses"]
    lines += [f"  {rpc:<52} {s['requests']:>5} {s['messages']:>5}  "
              + ", ".join(f"{status} {count}" for status, count in s["statuses"].items()) for rpc, s in summary.items()]
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown by a plain `pytest -q` run, passing or not
        print("\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    """The services under fuzz, started together; the trajectories of PRE_FUZZ appended before any fuzz."""
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
    try:
        for name, proc in procs.items():
            proc.start(root / name)
        fuzzed = {name: Fuzzed(proc.wait_ready(300)) for name, proc in procs.items()}
        trajectory = fuzzed["trajectory"]
        for key, group_ids, first_id, version in PRE_FUZZ:
            trajectories = make_trajectories(group_ids, first_id=first_id, policy_version=version)
            request = trajectory_pb2.AppendRequest(trajectories=trajectories, idempotency_key=key)
            assert trajectory.unary(TRAJECTORY, "Append", request).appended == len(group_ids)
        baselines = {"reward": fuzzed["reward"].unary(REWARD, "ComputeRewards", _reward_request()),
                     "reference": fuzzed["reference"].unary(REFERENCE, "ScoreLogProbs", _score_request(True))}
        yield fuzzed, baselines
        for target in fuzzed.values():
            target.channel.close()
    finally:
        for proc in procs.values():
            proc.stop()


# ------------------------------------------------------------------ sending


def _describe(messages) -> str:
    shown = [m if m is NACK_DELIVERED else f"{len(m)} bytes: {m[:160].hex()}" for m in messages]
    return "; ".join(map(str, shown))


class _Feeder:
    """A StreamBatches request iterator: nacks what it was delivered, half-closes or stays open."""

    def __init__(self, messages, hold_open: bool):
        self.messages, self.hold_open = messages, hold_open
        self.delivered = threading.Event()
        self.ended = threading.Event()
        self.lease_id = "never-delivered"

    def __iter__(self):
        for item in self.messages:
            if item is NACK_DELIVERED:
                self.delivered.wait(1.0)  # no batch may be ready: then a nack of a lease it never had
                item = trajectory_pb2.StreamBatchesRequest(
                    nack=trajectory_pb2.NackBatch(lease_id=self.lease_id)).SerializeToString()
            yield item
        if self.hold_open:
            self.ended.wait(HELD_OPEN_TIMEOUT + 5)  # the call ends at its deadline

    def saw(self, raw: bytes) -> None:
        response = trajectory_pb2.StreamBatchesResponse.FromString(raw)
        if response.lease_id and not self.delivered.is_set():
            self.lease_id = response.lease_id
            self.delivered.set()


def send(target: Fuzzed, service, method, messages, hold_open: bool,
         timeout: float = CALL_TIMEOUT) -> tuple[grpc.StatusCode, str]:
    """Send raw ``messages`` to ``method``; the call's final status (Watch: after its first answer).

    ``timeout``: the deadline of a call not held open (an RPC whose answer takes longer passes more)."""
    kind = ("stream" if method.client_streaming else "unary") + "_" + ("stream" if method.server_streaming else "unary")
    call = getattr(target.channel, kind)(f"/{service.full_name}/{method.name}",
                                         request_serializer=None, response_deserializer=None)
    feeder = _Feeder(messages, hold_open) if method.name == "StreamBatches" else None
    request = iter(feeder or messages) if method.client_streaming else messages[0]
    timeout = HELD_OPEN_TIMEOUT if hold_open else timeout
    try:
        if not method.server_streaming:
            call(request, timeout=timeout)
            return grpc.StatusCode.OK, ""
        responses = call(request, timeout=timeout)
        for raw in responses:
            if feeder is not None:
                feeder.saw(raw)
            if method.name == "Watch":  # answers at once, then waits for changes for ever: enough
                health_pb2.HealthCheckResponse.FromString(raw)
                responses.cancel()
                break
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    finally:
        if feeder is not None:
            feeder.ended.set()


def check_outcome(target: Fuzzed, rpc: str, messages, hold_open: bool, code, details: str) -> None:
    waits = hold_open  # a stream left open after a valid `open` legitimately waits for its deadline
    bad = code in FORBIDDEN or (code == grpc.StatusCode.DEADLINE_EXCEEDED and not waits)
    assert not bad, (f"{rpc}: {code.name} {details!r}\nrequest: {_describe(messages)}\n"
                     f"service log tail:\n{target.proc.log_tail(60)}")
    target.alive()


SEED = os.environ.get("RLFLEET_FUZZ_SEED")
FUZZ_SETTINGS = dict(deadline=None, derandomize=SEED is None, database=None,
                     phases=[Phase.explicit, Phase.generate, Phase.shrink],
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much, HealthCheck.large_base_example])


# ------------------------------------------------------------------ the fuzz


@pytest.mark.parametrize("name,service,method,examples", _targets())
def test_fuzz(fleet, fuzz_log, name, service, method, examples):
    fuzzed, _ = fleet
    target = fuzzed[name]
    rpc = f"{name}:{service.name}.{method.name}"
    plans = _plans(method)
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
    for name, service, method, request in [
            ("trajectory", DIAGNOSTICS, "Echo", diagnostics_pb2.EchoRequest(payload=payload)),
            ("trajectory", TRAJECTORY, "Append", trajectory_pb2.AppendRequest(trajectories=payload)),
            ("reward", REWARD, "ComputeRewards", reward_pb2.ComputeRewardsRequest(prompt_texts=["x" * (48 << 20)])),
            ("reference", REFERENCE, "ScoreLogProbs",
             reference_pb2.ScoreLogProbsRequest(response_starts=[2**62] * (5 << 20)))]:
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
    after = reward.unary(REWARD, "ComputeRewards", _reward_request())
    before = baselines["reward"]
    request = _reward_request()
    expected_kl = (decode_ragged(request.behavior_log_probs).values - decode_ragged(request.ref_log_probs).values)
    assert torch.equal(decode_ragged(after.kl).values, expected_kl)  # k1, exactly
    for field in ("kl", "scores", "clipped_scores", "advantages", "kl_mean", "kl_sum"):
        assert getattr(after, field) == getattr(before, field), field
    controller = reward.unary(REWARD, "GetKLController", reward_pb2.GetKLControllerRequest())
    assert math.isfinite(controller.coef) and controller.coef >= 0 and after.kl_coef == controller.coef

    scored = fuzzed["reference"].unary(REFERENCE, "ScoreLogProbs", _score_request(True))
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


def test_an_instance_storing_any_layout_still_round_trips_after_the_fuzz(fleet):
    loose = fleet[0]["loose"]
    loose.unary(TRAJECTORY, "DropStale", trajectory_pb2.DropStaleRequest(below_policy_version=2**64 - 1))
    stats = loose.unary(TRAJECTORY, "GetStats", trajectory_pb2.GetStatsRequest())
    assert (stats.ready, stats.leased) == (0, 0)
    appended = make_trajectories(groups(0, 2, 2), first_id=0, prompt_ids=True)
    assert loose.unary(TRAJECTORY, "Append", trajectory_pb2.AppendRequest(trajectories=appended)).appended == 4
    (delivered,) = read_batches(loose, _open(batch_size=4, whole_groups=True), 1)
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

    deadline = time.monotonic() + 60
    while stats().leased:  # fuzzed streams that ended release their leases
        assert time.monotonic() < deadline, "leases of ended fuzz streams were not released"
        time.sleep(0.1)
    ready = stats().ready
    # Every ready row, one per batch, all at once (prefetch): nothing is acked, so nothing is deleted.
    delivered: dict[str, list[bytes]] = collections.defaultdict(list)
    for response in read_batches(trajectory, _open(batch_size=1, prefetch=ready, consumer="after-fuzz"), ready):
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
