"""The fuzz machinery of ``test_fuzz.py`` and ``test_fuzz_suite.py``: valid requests to start from, what one
example sends (hypothesis strategies over ``tests/fuzz_messages.py``), sending raw bytes to any RPC, and the rules
every answer must keep.

The rules: the status is never UNKNOWN, INTERNAL (a bug), UNAVAILABLE or DATA_LOSS (a crashed or broken server),
the process is still alive, and no call runs into its deadline, except where waiting is the RPC's job (a
StreamBatches stream kept open after a valid ``open``; Health/Watch is read to its first answer, then cancelled).
``RLFLEET_FUZZ_SEED`` picks another seed than the deterministic default.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st

from rlfleet.services.launch import ServiceProcess
from rlfleet.v1 import (diagnostics_pb2, environment_pb2, reference_pb2, reward_pb2, sampling_pb2, tensor_pb2,
                        trajectory_pb2)
from rlfleet.wire import Ragged, encode_ragged, encode_tensor
from tests import fuzz_messages
from tests.trajectories import groups, make_trajectories

CALL_TIMEOUT = 20.0
"""Per call: every RPC here answers a request in well under a second; 20 s absorbs a loaded machine."""
HELD_OPEN_TIMEOUT = 1.0
"""A StreamBatches stream left open after a valid ``open`` waits for batches and acks by design."""
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
             grpc.StatusCode.DATA_LOSS}
VOCAB = 512  # the tiny model's
TRAILER_TOO_BIG = "received metadata size exceeds"
"""grpc's client, on an error message past 16 KiB (one echoing a huge request field whole): the precise status
is lost, RESOURCE_EXHAUSTED "Stream removed" arrives instead."""

TRAJECTORY = trajectory_pb2.DESCRIPTOR.services_by_name["TrajectoryService"]
REWARD = reward_pb2.DESCRIPTOR.services_by_name["RewardService"]
REFERENCE = reference_pb2.DESCRIPTOR.services_by_name["ReferenceService"]
ENVIRONMENT = environment_pb2.DESCRIPTOR.services_by_name["EnvironmentService"]
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
DIAGNOSTICS = diagnostics_pb2.DESCRIPTOR.services_by_name["DiagnosticsService"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
SHARED = (HEALTH, DIAGNOSTICS, REFLECTION)
NACK_DELIVERED = object()
"""In a StreamBatches plan: a nack of the lease the stream was delivered (once it was)."""


# ------------------------------------------------------------------ valid requests (seeds)


def reward_request(**fields) -> reward_pb2.ComputeRewardsRequest:
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


def score_request(with_entropy=False) -> reference_pb2.ScoreLogProbsRequest:
    """Three sequences of the tiny model's vocabulary, scored from their response starts."""
    sequences = [torch.arange(6) * 7 % VOCAB, torch.tensor([1, 2]), torch.arange(40) * 13 % VOCAB]
    return reference_pb2.ScoreLogProbsRequest(token_ids=encode_ragged(Ragged.from_list(sequences, torch.int64)),
                                              response_starts=[2, 1, 30], with_entropy=with_entropy)


def open_request(**fields) -> trajectory_pb2.StreamBatchesRequest:
    """A StreamBatches ``open`` with ``fields``."""
    return trajectory_pb2.StreamBatchesRequest(open=trajectory_pb2.OpenBatchStream(**fields))


def episode_request(episode_id: str, environment: str = "counter", content: str = "count to three",
                    **fields) -> environment_pb2.OpenEpisodeRequest:
    """An OpenEpisode of ``environment`` (``tests.environments``' scripted counter by default)."""
    return environment_pb2.OpenEpisodeRequest(environment=environment, episode_id=episode_id,
                                              prompt=[sampling_pb2.ChatMessage(role="user", content=content)],
                                              **fields)


def step_request(episode_id: str, token_ids, dtype=torch.int64, **fields) -> environment_pb2.StepRequest:
    """A Step of ``episode_id`` that sampled ``token_ids``."""
    request = environment_pb2.StepRequest(episode_id=episode_id, **fields)
    encode_tensor(torch.tensor(token_ids, dtype=dtype), out=request.token_ids)
    return request


STEPPED_EPISODES = [f"fuzz-step-{i}" for i in range(24)]
"""Counter episodes opened before the fuzz for the Step seeds, one seed each: a counter episode takes three
steps, and the Step seeds spread the fuzz's valid steps over all of them, so that most stay open throughout."""
CLOSED_EPISODES = [f"fuzz-close-{i}" for i in range(4)]
"""Counter episodes opened before the fuzz for the CloseEpisode seeds (the first valid close of each closes it)."""
_TURNS = [[326, 269, 2], [86, 357, 287], [430, 368, 289, 2], [2], [1, 0, 511]]  # of the tiny vocabulary; 2: <|im_end|>


def _step_seed(index: int, episode_id: str) -> environment_pb2.StepRequest:
    fields = [{}, {"finish_reason": "stop"}, {"finish_reason": "length", "dtype": torch.int32},
              {"text": "one 1", "finish_reason": "stop"}][index % 4]
    return step_request(episode_id, _TURNS[index % len(_TURNS)], **fields)


VALID_OPENS = [open_request(batch_size=1), open_request(batch_size=4, prefetch=2, consumer="fuzz"),
               open_request(batch_size=2, whole_groups=True, lease_seconds=0.5),
               open_request(batch_size=3, whole_groups=True), open_request(batch_size=8, min_policy_version=3),
               open_request(batch_size=12, prefetch=1, lease_seconds=60)]


def valid_requests(method) -> list:
    """Valid requests of ``method``: what mutation and corruption start from."""
    tp, rp = trajectory_pb2, reward_pb2
    table = {
        "Append": [tp.AppendRequest(trajectories=make_trajectories(groups(g, 2, 2), first_id=4 * g), idempotency_key=k)
                   for g, k in [(0, ""), (1, "fuzz/1"), (2, "pre/0")]]
                  + [tp.AppendRequest(trajectories=make_trajectories([7], first_id=9, prompt_ids=True)),
                     tp.AppendRequest(trajectories=make_trajectories([8, 8], first_id=5, policy_version=2**62)),
                     tp.AppendRequest(trajectories=make_trajectories([11, 11, 12, 12], first_id=20),
                                      group_keys=["fuzz/g11", "fuzz/g12"]),
                     tp.AppendRequest(trajectories=make_trajectories([13, 13, 14, 14], first_id=24),
                                      group_keys=["fuzz/g13", "fuzz/g14"], filtered_groups=[True, False])],
        "StreamBatches": VALID_OPENS + [tp.StreamBatchesRequest(ack=tp.AckBatch(lease_id="0" * 32)),
                                        tp.StreamBatchesRequest(nack=tp.NackBatch(lease_id="no-such-lease"))],
        "GetStats": [tp.GetStatsRequest()],
        "DropStale": [tp.DropStaleRequest(below_policy_version=v) for v in (0, 1, 4, 2**63 - 1, 2**63, 2**64 - 1)],
        "GetVersionStats": [tp.GetVersionStatsRequest(), tp.GetVersionStatsRequest(min_version=3, limit=10),
                            tp.GetVersionStatsRequest(min_version=2**63 - 1, limit=10_000)],
        "ListSamples": [tp.ListSamplesRequest(), tp.ListSamplesRequest(before_cursor=2**63 - 1, limit=1000),
                        tp.ListSamplesRequest(min_version=0, max_version=3, min_score=0.5, max_score=2.0,
                                              filter=tp.SAMPLE_FILTER_FILTERED, limit=5)],
        "GetSample": [tp.GetSampleRequest(cursor=c) for c in (0, 1, 2, 2**63 - 1)],
        "ComputeRewards": [reward_request(),
                           reward_request(kl_estimator=rp.KL_ESTIMATOR_K3, update_kl_controller=True),
                           reward_request(response_texts=[], advantage_mode=rp.ADVANTAGE_MODE_RLOO),
                           reward_request(tasks=[rp.Task(reward_fn="regex_match", ground_truth="(a+)+$")] * 4),
                           reward_request(tasks=[rp.Task(reward_fn="reward_model", args={"path": "/"})] * 4),
                           reward_request(environment_rewards=[0.5, -1.0, 2.0, 0.0],
                                          tasks=[rp.Task(reward_fn="none")])],
        "GetKLController": [rp.GetKLControllerRequest()],
        "CheckTasks": [rp.CheckTasksRequest(tasks=[rp.Task(reward_fn="char_fraction", args={"pattern": "[0-9]"}),
                                                   rp.Task(reward_fn="os:system", ground_truth="true")])],
        "ScoreLogProbs": [score_request(), score_request(with_entropy=True)],
        "OpenEpisode": [episode_request("fuzz-open-0"),
                        episode_request("fuzz-open-1", ground_truth="3", metadata={"id": "7", "level": "easy"}),
                        episode_request(STEPPED_EPISODES[0]),  # open already: the same answer again
                        episode_request("fuzz-open-2", environment="tool_calling", content="what is 6 times 7?"),
                        environment_pb2.OpenEpisodeRequest(
                            environment="counter", episode_id="fuzz-open-3",
                            prompt=[sampling_pb2.ChatMessage(role=role, content=content) for role, content in
                                    [("system", "be brief"), ("user", "count"), ("assistant", "1"), ("user", "go")]])],
        "Step": [_step_seed(index, episode_id) for index, episode_id in enumerate(STEPPED_EPISODES)],
        "CloseEpisode": [environment_pb2.CloseEpisodeRequest(episode_id=episode_id) for episode_id in CLOSED_EPISODES],
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


def request_plans(method, seeds: list | None = None) -> st.SearchStrategy:
    """What one example sends: a list of request bytes (and markers), and whether the stream stays open.

    ``seeds``: the valid requests to start from (default ``valid_requests(method)``; a module fuzzing other
    services passes theirs)."""
    one = fuzz_messages.requests(method.input_type, valid_requests(method) if seeds is None else seeds)
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


# ------------------------------------------------------------------ a service under fuzz


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

    def write(self, path: Path) -> str:
        """Write the summary to ``path`` as JSON; the same as a table to print."""
        summary = self.summary()
        path.write_text(json.dumps(summary, indent=1))
        lines = [f"fuzz summary ({sum(s['requests'] for s in summary.values())} requests; {path}):",
                 f"  {'rpc':<52} {'calls':>5} {'msgs':>5}  statuses"]
        lines += [f"  {rpc:<52} {s['requests']:>5} {s['messages']:>5}  "
                  + ", ".join(f"{status} {count}" for status, count in s["statuses"].items())
                  for rpc, s in summary.items()]
        return "\n".join(lines)


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
    """The rules (see the module's docstring): no forbidden status, no deadline passed unless held open, no
    error message too big to arrive (``TRAILER_TOO_BIG``), alive."""
    waits = hold_open  # a stream left open after a valid `open` legitimately waits for its deadline
    bad = (code in FORBIDDEN or (code == grpc.StatusCode.DEADLINE_EXCEEDED and not waits)
           or TRAILER_TOO_BIG in details)
    assert not bad, (f"{rpc}: {code.name} {details!r}\nrequest: {_describe(messages)}\n"
                     f"service log tail:\n{target.proc.log_tail(60)}")
    target.alive()


SEED = os.environ.get("RLFLEET_FUZZ_SEED")
FUZZ_SETTINGS = dict(deadline=None, derandomize=SEED is None, database=None,
                     phases=[Phase.explicit, Phase.generate, Phase.shrink],
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much, HealthCheck.large_base_example])
