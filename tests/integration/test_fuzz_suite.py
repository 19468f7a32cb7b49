"""Property-based fuzz (hypothesis) of every RPC of a real collector and generation replica, in a suite of their own.

``test_fuzz.py`` fuzzes trajectory, reward and reference on their own; this module starts the whole suite
(one vLLM replica) and fuzzes, with the same machinery and rules (``fuzzing.py``: no UNKNOWN / INTERNAL /
UNAVAILABLE / DATA_LOSS, no call past its deadline, the process alive after every request):

- the collector: CollectorService, the TrajectoryService it serves (StreamBatches and GetStats forwarded,
  the others refused), Health, Diagnostics and reflection;
- the replica directly: GenerationService, Health, Diagnostics and reflection.

Pushes (PushWeights to the collector, UpdateWeights to the replica) are fuzzed as whole streams too: a valid
push of the tiny model's weights, as is or with one message replaced, dropped, repeated, swapped or the
stream cut. Valid pushes apply; a push straight to the replica puts it ahead of the collector, which must
take it out of rotation and roll it back to the committed version from its spool. After the fuzz both
services are SERVING, agree on the policy version, the replica generates and the collector takes a prompt
through the whole pipeline to a batch read (and acked) through its StreamBatches.

The collector runs async with no staleness bound and a short prompt queue (``--max-submitted-prompts``):
fuzzed prompts that are valid are generated, at most a queue's worth at a time. Generate may legitimately
ask for ``max_n`` x ``max_model_len`` tokens: its calls get ``GENERATE_TIMEOUT``.

``RLFLEET_FUZZ_EXAMPLES`` (default 50 per own RPC, a fifth of that for the shared services) and
``RLFLEET_FUZZ_SEED`` work as in ``test_fuzz.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from grpc_health.v1 import health_pb2
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite
from rlfleet.v1 import collector_pb2, diagnostics_pb2, generation_pb2, sampling_pb2, tensor_pb2, weights_pb2
from rlfleet.wire import encode_tensor
from rlfleet.wire.push_messages import iter_push_messages
from tests import fuzz_messages
from tests.hf_reference import load_hf
from tests.integration.fuzzing import (CALL_TIMEOUT, DIAGNOSTICS, FUZZ_SETTINGS, HEALTH, SEED, SHARED, TRAJECTORY,
                                       Fuzzed, check_outcome, request_plans, send, valid_requests)
from tests.integration.readers import Reader
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

EXAMPLES = int(os.environ.get("RLFLEET_FUZZ_EXAMPLES", "50"))
MAX_MODEL_LEN = 256
MAX_N = 8
GROUP = 2
GENERATE_TIMEOUT = 120.0
"""A fuzzed Generate may ask for MAX_N samples of up to MAX_MODEL_LEN tokens: more than a quick call's 20 s."""
PUSH_TIMEOUT = 120.0
"""A valid push is staged and applied by vLLM (a pause, a load, the prefix cache reset): seconds, not 20."""
SETTLE_TIMEOUT = 120.0
"""After the fuzz: how long the collector may take to roll its replica back and drain its prompt queue."""
COLLECTOR = collector_pb2.DESCRIPTOR.services_by_name["CollectorService"]
GENERATION = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
OWN = {"collector": (COLLECTOR, TRAJECTORY), "generation": (GENERATION,)}
PUSHES = {"PushWeights": collector_pb2.PushWeightsRequest, "UpdateWeights": generation_pb2.UpdateWeightsRequest}


def _targets():
    params = []
    for name, own in OWN.items():  # the collector first: its pushes fill the spool the replica is rolled back from
        for service in (*own, *SHARED):
            examples = EXAMPLES if service in (COLLECTOR, GENERATION) else max(1, EXAMPLES // 5)
            if service is TRAJECTORY and name == "collector":
                examples = max(1, EXAMPLES // 2)  # StreamBatches and GetStats forwarded; Append and DropStale not
            for method in service.methods:
                params.append(pytest.param(name, service, method, examples,
                                           id=f"{name}:{service.name}.{method.name}"))
    return params


# ------------------------------------------------------------------ valid requests (seeds)


def _prompt(kind: str) -> sampling_pb2.Prompt:
    if kind == "chat":
        return sampling_pb2.Prompt(chat=sampling_pb2.ChatMessages(messages=[
            sampling_pb2.ChatMessage(role="system", content="add"),
            sampling_pb2.ChatMessage(role="user", content="2+2")]))
    if kind == "token_ids":
        return sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor([5, 17, 40, 3], dtype=torch.int64)))
    return sampling_pb2.Prompt(text="what is 1 plus 2")


def _own_seeds(method) -> list:
    """Valid requests of the collector's and generation's own RPCs and Health (the others: ``valid_requests``)."""
    cp, gp, sp = collector_pb2, generation_pb2, sampling_pb2
    short = sp.SamplingParams(max_tokens=8, temperature=1.0)
    table = {
        "SubmitPrompts": [
            cp.SubmitPromptsRequest(prompts=[cp.PromptSpec(prompt_id="fuzz-text", prompt=_prompt("text"),
                                                           ground_truth="3")]),
            cp.SubmitPromptsRequest(prompts=[cp.PromptSpec(prompt=_prompt("chat"), ground_truth="4"),
                                             cp.PromptSpec(prompt=_prompt("token_ids"), ground_truth="9")]),
            cp.SubmitPromptsRequest(prompts=[cp.PromptSpec(
                prompt_id="fuzz-override", prompt=_prompt("text"), reward_fn="char_fraction",
                reward_args={"pattern": "[0-9]"}, sampling=sp.SamplingParams(max_tokens=4, top_p=0.9, seed=3))])],
        "GetStatus": [cp.GetStatusRequest()],
        "GetPolicyVersion": [cp.GetPolicyVersionRequest()],
        "ListFailures": [cp.ListFailuresRequest(), cp.ListFailuresRequest(after_seq=1, limit=10),
                         cp.ListFailuresRequest(limit=1000)],
        "ReportMismatch": [
            cp.ReportMismatchRequest(policy_version=1, lags=[cp.LagMismatch(lag=0, kl_k3=1e-4, kl_k1=1e-4,
                                                                            ess_token=0.99, tokens=64)]),
            cp.ReportMismatchRequest(policy_version=3, lags=[
                cp.LagMismatch(lag=0, kl_k3=0.02, kl_k1=0.01, ess_token=0.9, tokens=32),
                cp.LagMismatch(lag=2, kl_k3=0.3, kl_k1=0.2, ess_token=0.5, tokens=8)])],
        "CloseMismatchBreaker": [cp.CloseMismatchBreakerRequest()],
        "JoinRun": [cp.JoinRunRequest(), cp.JoinRunRequest(run_id="run-20261128-120000-abcdef", policy_version=3)],
        "GetPassRates": [cp.GetPassRatesRequest(), cp.GetPassRatesRequest(prompt_keys=["fuzz-text", "none"]),
                         cp.GetPassRatesRequest(after_key="fuzz", limit=1000)],
        "Generate": [gp.GenerateRequest(prompt=_prompt("text"), sampling=short),
                     gp.GenerateRequest(request_id="fuzz", prompt=_prompt("chat"),
                                        sampling=sp.SamplingParams(n=4, max_tokens=16, seed=7, top_k=5)),
                     gp.GenerateRequest(prompt=_prompt("token_ids"),
                                        sampling=sp.SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True,
                                                                   stop=["9"], stop_token_ids=[3]))],
        "GetEngineStatus": [gp.GetEngineStatusRequest()],
        "EndRun": [gp.EndRunRequest(run_id="run-20261202-120000-abcdef"), gp.EndRunRequest()],
        # No push is staged under these ids: NOT_FOUND at once (never a wait), whatever follows the header.
        "RelayWeights": [gp.RelayWeightsRequest(header=gp.RelayHeader(push_id="fuzz", version=1,
                                                                     downstream=["127.0.0.1:1"],
                                                                     downstream_tls_names=["generation"])),
                         gp.RelayWeightsRequest(chunk=weights_pb2.WeightChunk(offset=0, data=b"fuzz"))],
        # Versions this replica may keep, sent to an address nobody listens on (cut out at once), or to none.
        # A TLS name per replica, or one too many (INVALID_ARGUMENT).
        "ShareWeights": [gp.ShareWeightsRequest(push_id="fuzz", version=v, downstream=["127.0.0.1:1"])
                         for v in (1, 2, 3)] + [gp.ShareWeightsRequest(push_id="fuzz", version=1),
                                                gp.ShareWeightsRequest(push_id="fuzz", version=1,
                                                                       downstream=["127.0.0.1:1"],
                                                                       downstream_tls_names=["generation"]),
                                                gp.ShareWeightsRequest(push_id="fuzz", version=1,
                                                                       downstream=["127.0.0.1:1"],
                                                                       downstream_tls_names=["a", "b"])],
        "Check": [health_pb2.HealthCheckRequest(service=s) for s in ("", COLLECTOR.full_name, GENERATION.full_name)],
        "Watch": [health_pb2.HealthCheckRequest(service=s) for s in ("", TRAJECTORY.full_name, "nope")],
    }
    return table[method.name] if method.name in table else valid_requests(method)


class AtNextVersion:
    """In an UpdateWeights plan: a valid manifest (or commit), given the replica's next version when sent
    (a replica takes only newer versions; the fuzz and the collector's roll-backs move it meanwhile)."""

    def __init__(self, request: generation_pb2.UpdateWeightsRequest):
        self.request = request

    def resolve(self, version: int) -> bytes:
        request = generation_pb2.UpdateWeightsRequest()
        request.CopyFrom(self.request)
        getattr(request, request.WhichOneof("payload")).version = version
        return request.SerializeToString()

    def __repr__(self) -> str:
        return f"AtNextVersion({self.request.WhichOneof('payload')})"


def _valid_pushes(method, state: list[tuple[str, torch.Tensor]]) -> list[list]:
    """Whole valid pushes of the tiny model's weights, one message per item (bytes, or AtNextVersion)."""
    wrap = PUSHES[method.name]
    pushes = []
    for mode, chunk_bytes, checksum, two_phase in [
            (weights_pb2.UPDATE_MODE_KEEP, 1 << 20, "crc32", False),
            (weights_pb2.UPDATE_MODE_ABORT, 1 << 18, None, False),
            (weights_pb2.UPDATE_MODE_WAIT, 1 << 20, "sha256", True)]:
        if two_phase and wrap is not generation_pb2.UpdateWeightsRequest:
            continue  # the collector refuses two_phase from a trainer: that is for its replicas
        push = []
        for kind, message in iter_push_messages(state, version=0, mode=mode, chunk_bytes=chunk_bytes,
                                                checksum_algo=checksum):
            if kind == "manifest":
                message.two_phase = two_phase
            request = wrap(**{kind: message})
            # The collector numbers a push itself (version 0); a replica must be given its next version.
            push.append(AtNextVersion(request) if kind == "manifest" and wrap is not collector_pb2.PushWeightsRequest
                        else request.SerializeToString())
        if two_phase:
            push.append(AtNextVersion(generation_pb2.UpdateWeightsRequest(commit=weights_pb2.WeightCommit())))
        pushes.append(push)
    return pushes


def _push_plans(method, state) -> st.SearchStrategy:
    """A push stream: fuzzed messages (as every client stream), or a valid push, as is or edited once."""
    pushes = _valid_pushes(method, state)
    # Seeds of single messages: each push's manifest (version 1 for a replica) and its first chunk.
    seeds = [PUSHES[method.name].FromString(m.resolve(1) if isinstance(m, AtNextVersion) else m)
             for push in pushes for m in push[:2]]
    one = fuzz_messages.requests(method.input_type, seeds)

    def edit(plan):
        push, how, index, replacement = plan
        push = list(push)
        index %= len(push)
        if how == "replace":
            push[index] = replacement
        elif how == "drop":
            del push[index]
        elif how == "repeat":
            push.insert(index, push[index])
        elif how == "swap":
            push[index], push[-1] = push[-1], push[index]
        elif how == "cut":
            del push[index:]
        else:  # a fuzzed message in between
            push.insert(index, replacement)
        return push

    edited = st.tuples(st.sampled_from(pushes), st.sampled_from(["replace", "drop", "repeat", "swap", "cut", "insert"]),
                       st.integers(0, 64), one).map(edit)
    whole = st.one_of(st.sampled_from(pushes), edited, edited).map(lambda push: (push, False))
    return st.one_of(request_plans(method, seeds), whole)


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def suite(tiny_model_dir, tmp_path_factory):
    """The whole suite (one replica); the collector and the replica under fuzz, with a channel each."""
    quick = ["--grace-seconds", "1"]
    options = SuiteOptions(
        model_dir=tiny_model_dir, generation_replicas=1, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=128 << 20,
        generation_args=["--max-num-seqs", "16", "--max-n", str(MAX_N), *quick],
        collector_args=["--group-size", str(GROUP), "--sampling", json.dumps({"temperature": 1.0, "max_tokens": 8}),
                        "--max-staleness", "1000000", "--mismatch-kl-target", "null", "--max-submitted-prompts", "32",
                        "--replica-check-seconds", "0.5", *quick])
    procs = start_suite(options, tmp_path_factory.mktemp("fuzz-suite"))
    fuzzed = {"collector": Fuzzed(procs["collector"]), "generation": Fuzzed(procs["generation-0"])}
    try:
        yield fuzzed
    finally:
        for target in fuzzed.values():
            target.channel.close()
        stop_suite(procs)


@pytest.fixture(scope="module")
def weights(tiny_model_dir) -> list[tuple[str, torch.Tensor]]:
    return list(load_hf(tiny_model_dir).state_dict().items())


# ------------------------------------------------------------------ the fuzz


def _engine_version(replica: Fuzzed) -> int:
    return replica.unary(GENERATION, "GetEngineStatus", generation_pb2.GetEngineStatusRequest()).policy_version


@pytest.mark.parametrize("name,service,method,examples", _targets())
def test_fuzz(suite, weights, fuzz_log, name, service, method, examples):
    target = suite[name]
    rpc = f"{name}:{service.name}.{method.name}"
    if method.name in PUSHES:
        plans, timeout = _push_plans(method, weights), PUSH_TIMEOUT
    else:
        plans = request_plans(method, _own_seeds(method))
        timeout = GENERATE_TIMEOUT if method.name == "Generate" else CALL_TIMEOUT

    @settings(max_examples=examples, **FUZZ_SETTINGS)
    @given(plans)
    def fuzz(plan):
        messages, hold_open = plan
        if any(isinstance(m, AtNextVersion) for m in messages):
            version = _engine_version(target) + 1
            messages = [m.resolve(version) if isinstance(m, AtNextVersion) else m for m in messages]
        code, details = send(target, service, method, messages, hold_open, timeout=timeout)
        fuzz_log.record(rpc, code.name + (" (held open)" if hold_open else ""), len(messages))
        check_outcome(target, rpc, messages, hold_open, code, details)

    (fuzz if SEED is None else seed(int(SEED))(fuzz))()


# ------------------------------------------------------------------ after the fuzz


def _serving(target: Fuzzed, service_name: str) -> bool:
    answer = target.unary(HEALTH, "Check", health_pb2.HealthCheckRequest(service=service_name))
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def test_both_services_serve_and_agree_on_the_version_after_the_fuzz(suite):
    collector, replica = suite["collector"], suite["generation"]
    for target, own in ((collector, COLLECTOR), (replica, GENERATION)):
        target.alive()
        for service_name in ("", own.full_name):
            wait_for(lambda: _serving(target, service_name), SETTLE_TIMEOUT, f"{own.name} {service_name!r} SERVING",
                     interval=0.5)
        payload = tensor_pb2.TensorDict(batch_size=[0])
        assert target.unary(DIAGNOSTICS, "Echo", diagnostics_pb2.EchoRequest(payload=payload)).payload == payload

    def agreed():  # the replica pushed to directly is rolled back to the committed version, back in rotation
        status = collector.unary(COLLECTOR, "GetStatus", collector_pb2.GetStatusRequest())
        version = collector.unary(COLLECTOR, "GetPolicyVersion", collector_pb2.GetPolicyVersionRequest()).version
        return (status.serving and all(r.healthy for r in status.replicas) and version == status.policy_version
                == _engine_version(replica))

    wait_for(agreed, SETTLE_TIMEOUT, "the collector's policy version equals the replica's, the replica in rotation",
             interval=0.5)

    request = generation_pb2.GenerateRequest(prompt=_prompt("text"), sampling=sampling_pb2.SamplingParams(
        n=2, max_tokens=4, ignore_eos=True, seed=1))
    call = replica.channel.unary_stream(f"/{GENERATION.full_name}/Generate",
                                        request_serializer=generation_pb2.GenerateRequest.SerializeToString,
                                        response_deserializer=generation_pb2.GenerateResponse.FromString)
    samples = list(call(request, timeout=GENERATE_TIMEOUT))
    assert sorted(s.sample_index for s in samples) == [0, 1]
    assert all(list(s.response_token_ids.shape) == [4] and s.policy_version_end == _engine_version(replica)
               for s in samples)


def test_the_collector_still_takes_a_prompt_to_a_batch_after_the_fuzz(suite):
    collector = suite["collector"]
    prompt_id = "after-the-fuzz"
    spec = collector_pb2.PromptSpec(prompt_id=prompt_id, prompt=_prompt("text"), ground_truth="3")
    assert list(collector.unary(COLLECTOR, "SubmitPrompts", collector_pb2.SubmitPromptsRequest(
        prompts=[spec])).prompt_ids) == [prompt_id]

    def status():
        return collector.unary(COLLECTOR, "GetStatus", collector_pb2.GetStatusRequest())

    wait_for(lambda: status().pending_prompts == 0, SETTLE_TIMEOUT, "the collector's prompt queue to drain",
             interval=0.5)
    failures = collector.unary(COLLECTOR, "ListFailures", collector_pb2.ListFailuresRequest(limit=1000)).failures
    assert prompt_id not in [f.prompt_id for f in failures]
    reader = Reader(collector.channel, batch_size=GROUP)  # acks each batch it reads (and checks the ack applied)
    try:
        while prompt_id not in list((batch := reader.next())["prompt_id"]):
            pass
        assert list(batch["prompt_id"]) == [prompt_id] * GROUP
    finally:
        reader.close()
