"""Weight sync through the real suite: transports, version truth, cuts at every phase, kills, re-sync.

Collector + two vLLM replicas (+ reference, reward, trajectory) as real
processes. After every scenario the same invariant is checked: every replica
serves the collector's version, and its log-probs are those of the weights
committed at that version (HF recompute, float32, 1e-4).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import grpc
import pytest
import torch

from rlfleet.client import FailedPreconditionError, RlfleetClientError, connect
from rlfleet.services.launch import ServiceProcess, free_port
from rlfleet.services.suite import SuiteOptions, start_suite, stop_suite
from rlfleet.v1 import (collector_pb2, collector_pb2_grpc, generation_pb2, generation_pb2_grpc, sampling_pb2,
                        tensor_pb2, weights_pb2)
from rlfleet.wire import decode_tensor, encode_tensor, shm
from tests.hf_reference import load_hf, response_log_probs
from tests.interposer import StallingLink
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
PROMPT = [1, 348, 201, 330, 400, 223, 20, 267, 223, 21, 2, 201, 1, 305, 310, 201]
TOLERANCE = 1e-4

# Deadlines, each from what it waits for (the tiny model: a few MB of weights, one engine step is milliseconds),
# with room for a loaded 2-core CI machine.
REPLICA_CHECK_SECONDS = 0.5
"""The collector's monitor period (--replica-check-seconds): each tick it sweeps the shm segments of dead
processes, probes replicas out of rotation (and re-syncs them), and checks those in rotation for a restart."""
QUERY_TIMEOUT = 30.0
"""A status call (GetEngineStatus, GetStatus): answered from memory."""
PUSH_TIMEOUT = 120.0
"""One push of the tiny model through the collector to both replicas (stage, vLLM's pause, load, prefix cache
reset): seconds."""
GENERATE_TIMEOUT = PUSH_TIMEOUT
"""One Generate of 16 tokens: milliseconds per token, but it may wait behind a push's swap (bounded by a push)."""
ENGINE_START_TIMEOUT = 600.0
"""A restarted replica until SERVING: a new process, vLLM's engine core, the model loaded and warmed up; the
slowest thing here (the suite fixture allows 900 s for every service together)."""
RESYNC_TIMEOUT = PUSH_TIMEOUT + 20 * REPLICA_CHECK_SECONDS
"""A restarted replica back at the collector's version and in rotation: noticed within a few monitor ticks (a
tick skips its check while a push moves versions), then one re-sync push from the spool."""
ROLLING_SETTLE_SECONDS = 3.0
"""--rolling-settle-seconds: a rolling update waits this long after a replica switched before draining the next,
the window in which both versions serve (and in which the kill test strikes: the status poll that sees the first
replica switched answers from memory, in far less)."""
DRAIN_TIMEOUT = PUSH_TIMEOUT + 60.0
"""Prompts submitted during an update all ended (each a group of 4 samples of 8 tokens: milliseconds), those
generated on a replica that died or switched included (generated again)."""
SHARE_HELD_AFTER = 256 << 10
"""Bytes of a peer's share (a relay: the tiny model's ~1.8 MB in 1 MiB chunks) that reach a replica before the
test's link holds the rest: far more than the collector's own calls to it carry (probes, a manifest)."""
RELEASE_TIMEOUT = PUSH_TIMEOUT + 20 * REPLICA_CHECK_SECONDS
"""Shared-memory segments of a cut or killed push gone: dropped when the push that staged them ends (bounded
by a push), or swept at the next monitor tick once the process holding them is dead."""


@pytest.fixture(scope="module")
def suite(tiny_model_dir, tmp_path_factory):
    options = SuiteOptions(model_dir=tiny_model_dir, generation_replicas=2, kv_cache_bytes=64 << 20,
                           generation_args=["--max-lora-rank", "8"],  # adapter pushes
                           collector_args=["--replica-check-seconds", str(REPLICA_CHECK_SECONDS), "--mode", "async",
                                           "--rolling-settle-seconds", str(ROLLING_SETTLE_SECONDS),
                                           "--max-staleness", "1000", "--mismatch-kl-target", "null", "--sampling",
                                           '{"temperature": 1.0, "max_tokens": 8}'])
    procs = start_suite(options, tmp_path_factory.mktemp("weight-sync"))
    yield procs
    stop_suite(procs)


@pytest.fixture(scope="module")
def client(suite):
    with connect(suite["collector"].address, timeout=PUSH_TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def committed(tiny_model_dir):
    """version -> the float32 state dict committed at that version (what the engines must compute with),
    or for an adapter push, the peft model (its base weights and the adapter)."""
    return {0: load_hf(tiny_model_dir).state_dict()}


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in base.items()}


def replicas(suite):
    return [p for k, p in suite.items() if k.startswith("generation")]


def replica_version(proc) -> int:
    with grpc.insecure_channel(proc.address) as channel:
        return generation_pb2_grpc.GenerationServiceStub(channel).GetEngineStatus(
            generation_pb2.GetEngineStatusRequest(), timeout=QUERY_TIMEOUT).policy_version


def sample(proc, seed: int):
    with grpc.insecure_channel(proc.address) as channel:
        request = generation_pb2.GenerateRequest(
            prompt=sampling_pb2.Prompt(token_ids=encode_tensor(torch.tensor(PROMPT))),
            sampling=sampling_pb2.SamplingParams(temperature=1.0, max_tokens=16, seed=seed))
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        reply = next(iter(stub.Generate(request, timeout=GENERATE_TIMEOUT)))
    return decode_tensor(reply.response_token_ids).tolist(), decode_tensor(reply.behavior_log_probs).clone(), reply


def assert_serving(suite, client, committed, tiny_model_dir, procs=None):
    """Every (given) replica serves the collector's version and computes with that version's weights."""
    version = client.policy_version
    reference = committed[version]
    model = reference if isinstance(reference, torch.nn.Module) else load_hf(tiny_model_dir, reference)
    for proc in procs or replicas(suite):
        assert replica_version(proc) == version, f"{proc.address} is not at the collector's version {version}"
        tokens, log_probs, reply = sample(proc, seed=version + 1)
        assert reply.policy_version_start == reply.policy_version_end == version
        diff = (log_probs - response_log_probs(model, PROMPT, tokens)).abs().max().item()
        assert diff <= TOLERANCE, f"{proc.address}: log-probs differ from version {version}'s weights by {diff}"


def segment_holders() -> dict[str, set[int]]:
    """Every rlfleet segment name some process holds open, with those processes' PIDs."""
    holders: dict[str, set[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(os.path.join(shm.SHM_DIR, shm.PREFIX)):
                holders.setdefault(target, set()).add(int(pid))
    return holders


def our_segments(suite, before: set[str]) -> set[str]:
    """New segments, less those kept (each held only by its keeper, one per keeper): this process's
    client's and the collector's staging for the next push, and each replica's weights (for deltas)."""
    new = set(shm.list_segments()) - before
    holders = segment_holders()
    kept = {}
    keepers_allowed = {os.getpid(), suite["collector"].process.pid, *(p.process.pid for p in replicas(suite))}
    for path in new:
        keepers = holders.get(path, set())
        if len(keepers) == 1 and keepers <= keepers_allowed:
            kept.setdefault(next(iter(keepers)), []).append(path)
    assert all(len(paths) == 1 for paths in kept.values()), f"more than one segment kept: {kept}"
    return new - {path for paths in kept.values() for path in paths}


class Load:
    """Prompts submitted in a background thread (a few every 50 ms) while the block runs, and the collector's
    status polled meanwhile: what a rolling update looked like from outside."""

    BACKLOG = 32

    def __init__(self, suite, client, tag: str):
        self.client, self.tag = client, tag
        self.stub = collector_pb2_grpc.CollectorServiceStub(grpc.insecure_channel(suite["collector"].address))
        self.polls: list[collector_pb2.GetStatusResponse] = []
        self.submitted = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._submit, daemon=True),
                         threading.Thread(target=self._poll, daemon=True)]

    def status(self) -> collector_pb2.GetStatusResponse:
        return self.stub.GetStatus(collector_pb2.GetStatusRequest(), timeout=QUERY_TIMEOUT)

    def _submit(self) -> None:
        """Keeps about ``BACKLOG`` prompts waiting: the pipeline always has work, and never more than it ends."""
        while not self._stop.wait(0.05):
            if self.polls and self.polls[-1].pending_prompts >= self.BACKLOG:
                continue
            self.client.submit_prompts([{"prompt_id": f"{self.tag}-{self.submitted + i}", "prompt": PROMPT,
                                         "ground_truth": "1"} for i in range(4)])
            self.submitted += 4

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            self.polls.append(self.status())

    def __enter__(self) -> "Load":
        self.before = self.status()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def wait_all_ended(self) -> collector_pb2.GetStatusResponse:
        """Every prompt submitted ended; none as a dead letter."""
        wait_for(lambda: self.status().pending_prompts == 0, DRAIN_TIMEOUT, "the submitted prompts to end")
        after = self.status()
        assert after.failed_prompts == self.before.failed_prompts, "a prompt was dead-lettered"
        return after


def barrier(client) -> None:
    """Returns once no push is in flight at the collector: a stale push waits for the push lock, then fails."""
    with pytest.raises(FailedPreconditionError):
        client.push_weights({"x": torch.zeros(1)}, version=1, transport="grpc", progress=False)


# ---------------------------------------------------------------- transports


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_push_changes_log_probs_to_exactly_the_pushed_weights(suite, client, committed, tiny_model_dir, transport):
    before = set(shm.list_segments())
    weights = perturbed(committed[0], seed=len(committed))
    result = client.push_weights(weights, transport=transport, progress=False)
    committed[result.version] = weights
    assert result.all_applied and len(result.replicas) == 2
    assert result.transport == transport
    # Same host: both replicas map the pages the trainer wrote (shm) or the collector received into (grpc).
    assert all(r.transport == "shm" for r in result.replicas) and result.replica_transport == "shm"
    assert_serving(suite, client, committed, tiny_model_dir)
    assert our_segments(suite, before) == set()  # nothing left in /dev/shm


def test_a_grpc_push_streams_into_the_replicas_on_the_collectors_host_as_it_arrives(suite, client, committed,
                                                                                    tiny_model_dir):
    """The replicas on the collector's host are offered a grpc push's segment as the collector receives it,
    with its watermark, and load the bytes as they arrive (streamed apply: an abort push streams whatever
    runs; a full push before it gives each the weights it keeps, to roll back to). Each logs its streamed
    swap, and serves the pushed weights."""
    weights = perturbed(committed[0], seed=150 + len(committed))
    result = client.push_weights(weights, transport="shm", progress=False)  # kept by each replica
    committed[result.version] = weights
    starts = {proc.address: proc.log_path.stat().st_size for proc in replicas(suite)}
    weights = perturbed(committed[0], seed=160 + len(committed))
    result = client.push_weights(weights, transport="grpc", mode="abort", progress=False)
    committed[result.version] = weights
    assert result.all_applied and {r.transport for r in result.replicas} == {"shm"}
    for proc in replicas(suite):
        said = proc.log_path.read_bytes()[starts[proc.address]:].decode(errors="replace")
        assert f"swapped to policy version {result.version} (abort, shm, streamed" in said, said[-2000:]
    assert_serving(suite, client, committed, tiny_model_dir)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_push_into_a_float32_engine(suite, client, committed, tiny_model_dir, dtype):
    weights = {k: v.to(dtype) for k, v in perturbed(committed[0], seed=100 + len(committed)).items()}
    result = client.push_weights(weights, progress=False)
    # The engine computes in float32 with the pushed values, converted exactly.
    committed[result.version] = {k: v.float() for k, v in weights.items()}
    assert result.all_applied
    assert_serving(suite, client, committed, tiny_model_dir)


def test_bad_push_changes_nothing(suite, client, committed, tiny_model_dir):
    version = client.policy_version
    wrong = dict(committed[version])
    name = "model.layers.0.mlp.up_proj.weight"
    wrong[name] = torch.zeros(wrong[name].shape[0] + 1, wrong[name].shape[1])
    for transport in ("shm", "grpc"):
        with pytest.raises(RlfleetClientError, match=name):
            client.push_weights(wrong, transport=transport, progress=False)
    assert client.policy_version == version
    assert_serving(suite, client, committed, tiny_model_dir)


# ---------------------------------------------------------------- delta pushes


def changed_few(weights: dict[str, torch.Tensor], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator) if k in names else v.clone()
            for k, v in weights.items()}


DELTA_TENSORS = ["model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.gate_proj.weight"]
"""One tensor of a fused qkv_proj and one of a gate_up_proj: their siblings must keep their bytes."""


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_delta_push_sends_only_what_changed_and_serves_what_a_full_push_would(suite, client, committed,
                                                                               tiny_model_dir, transport):
    before = set(shm.list_segments())
    with connect(suite["collector"].address, timeout=PUSH_TIMEOUT) as pusher:  # its own delta base
        base = perturbed(committed[0], seed=300 + len(committed))
        first = pusher.push_weights(base, transport=transport, progress=False, delta=True)
        committed[first.version] = base
        assert first.base_version is None and first.all_applied  # nothing kept yet: full

        after = changed_few(base, DELTA_TENSORS, seed=301)
        delta = pusher.push_weights(after, transport=transport, progress=False, delta=True)
        committed[delta.version] = after
        assert delta.base_version == first.version and delta.tensors == len(DELTA_TENSORS)
        assert delta.bytes == sum(after[name].numel() * 4 for name in DELTA_TENSORS)
        assert delta.all_applied
        assert_serving(suite, client, committed, tiny_model_dir)
        by_delta = [sample(proc, seed=77)[:2] for proc in replicas(suite)]

        # The same weights as a full push: every replica samples the very same tokens and log-probs, bit for bit.
        full = pusher.push_weights(after, transport=transport, progress=False)
        committed[full.version] = after
        assert full.base_version is None and full.all_applied
        for proc, (tokens, log_probs) in zip(replicas(suite), by_delta):
            full_tokens, full_log_probs = sample(proc, seed=77)[:2]
            assert full_tokens == tokens and torch.equal(full_log_probs, log_probs), proc.address

        # That plain push is the next delta's base: only the tensor changed since it goes.
        again = changed_few(after, DELTA_TENSORS[:1], seed=302)
        delta = pusher.push_weights(again, transport=transport, progress=False, delta=True)
        committed[delta.version] = again
        assert (delta.base_version, delta.tensors) == (full.version, 1) and delta.all_applied
        assert delta.bytes == again[DELTA_TENSORS[0]].numel() * 4
        assert_serving(suite, client, committed, tiny_model_dir)
    assert our_segments(suite, before) == set()


def test_a_delta_on_a_version_the_collector_left_goes_full(suite, client, committed, tiny_model_dir):
    """Another pusher moved the version on: the collector refuses the delta (FAILED_PRECONDITION) and the
    client sends the whole state dict instead, in the same call."""
    with connect(suite["collector"].address, timeout=PUSH_TIMEOUT) as pusher:  # its own delta base
        base = perturbed(committed[0], seed=310)
        first = pusher.push_weights(base, progress=False, delta=True)
        committed[first.version] = base
        other = perturbed(committed[0], seed=311)
        with connect(suite["collector"].address, timeout=PUSH_TIMEOUT) as other_client:
            committed[other_client.push_weights(other, progress=False).version] = other
        after = changed_few(base, DELTA_TENSORS, seed=312)
        result = pusher.push_weights(after, progress=False, delta=True)
        committed[result.version] = after
        assert result.base_version is None and result.all_applied
        assert result.bytes == sum(t.numel() * 4 for t in after.values())
        assert_serving(suite, client, committed, tiny_model_dir)


def test_a_malformed_delta_is_refused_naming_the_tensor(suite, client, committed, tiny_model_dir):
    version = client.policy_version
    stub = collector_pb2_grpc.CollectorServiceStub(grpc.insecure_channel(suite["collector"].address))
    name = DELTA_TENSORS[0]
    shape = list(committed[version][name].shape)
    for tensors, code, words in [
        ([weights_pb2.WeightSpec(name=name, dtype=tensor_pb2.DTYPE_FLOAT32, shape=[shape[0] - 1, shape[1]])],
         grpc.StatusCode.INVALID_ARGUMENT, name),
        ([weights_pb2.WeightSpec(name="model.layers.9.mlp.up_proj.weight", dtype=tensor_pb2.DTYPE_FLOAT32,
                                 shape=[2, 2])], grpc.StatusCode.INVALID_ARGUMENT, "model.layers.9.mlp.up_proj"),
    ]:
        manifest = weights_pb2.WeightManifest(tensors=tensors, total_bytes=4 * math.prod(tensors[0].shape))
        manifest.delta.base_version = version
        with pytest.raises(grpc.RpcError) as error:
            stub.PushWeights(iter([collector_pb2.PushWeightsRequest(manifest=manifest)]), timeout=PUSH_TIMEOUT)
        assert error.value.code() == code and words in error.value.details()
    # Adapters: a factor of the wrong shape names the tensor (the replicas' check); with a delta, refused.
    adapter = weights_pb2.LoraAdapter(rank=8, alpha=16, target_modules=["v_proj"])
    a_name = "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"
    b_name = a_name.replace("lora_A", "lora_B")
    specs = [weights_pb2.WeightSpec(name=a_name, dtype=tensor_pb2.DTYPE_FLOAT32, shape=[shape[1], 8]),
             weights_pb2.WeightSpec(name=b_name, dtype=tensor_pb2.DTYPE_FLOAT32, shape=[shape[0], 8])]
    for delta, code, words in [(False, grpc.StatusCode.INVALID_ARGUMENT, "v_proj.lora_A"),
                               (True, grpc.StatusCode.INVALID_ARGUMENT, "manifest.lora")]:
        manifest = weights_pb2.WeightManifest(tensors=specs, lora=adapter,
                                              total_bytes=4 * 8 * (shape[0] + shape[1]))
        if delta:
            manifest.delta.base_version = version
        requests = [collector_pb2.PushWeightsRequest(manifest=manifest),
                    collector_pb2.PushWeightsRequest(chunk=weights_pb2.WeightChunk(data=bytes(manifest.total_bytes)))]
        with pytest.raises(grpc.RpcError) as error:
            stub.PushWeights(iter(requests), timeout=PUSH_TIMEOUT)
        assert error.value.code() == code and words in error.value.details(), error.value.details()
    manifest = weights_pb2.WeightManifest()
    manifest.delta.base_version = version - 1
    with pytest.raises(grpc.RpcError) as error:
        stub.PushWeights(iter([collector_pb2.PushWeightsRequest(manifest=manifest)]), timeout=PUSH_TIMEOUT)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"the committed version is {version}" in error.value.details()
    assert client.policy_version == version
    assert_serving(suite, client, committed, tiny_model_dir)


# ---------------------------------------------------------------- LoRA adapter pushes


def adapted(tiny_model_dir, base: dict[str, torch.Tensor], seed: int, rank: int = 8):
    """A peft LoRA on ``base`` whose lora_B is non-zero (it changes outputs), as a trainer holds it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_hf(tiny_model_dir, base), LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return model.eval()


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_an_adapter_push_serves_the_base_weights_with_the_adapter(suite, client, committed, tiny_model_dir,
                                                                 transport):
    base = committed[client.policy_version]
    assert not isinstance(base, torch.nn.Module), "the previous version must be weights"
    model = adapted(tiny_model_dir, base, seed=400 + len(committed))
    result = client.push_adapter(model, transport=transport, progress=False)
    committed[result.version] = model
    assert result.all_applied and result.transport == transport
    adapter_bytes = sum(t.numel() * 4 for n, t in model.named_parameters() if "lora_" in n)
    assert result.bytes == adapter_bytes < sum(t.numel() * 4 for t in base.values()) / 4
    assert_serving(suite, client, committed, tiny_model_dir)
    # A full push drops the adapter.
    weights = perturbed(committed[0], seed=410 + len(committed))
    full = client.push_weights(weights, transport=transport, progress=False)
    committed[full.version] = weights
    assert full.all_applied
    assert_serving(suite, client, committed, tiny_model_dir)


# ---------------------------------------------------------------- cuts


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_trainer_cut_at_any_phase_keeps_engines_and_collector_in_step(suite, client, committed, tiny_model_dir,
                                                                      transport):
    """Deadlines from "before the first byte" to "during the commit": whatever the outcome, engine
    version = collector version, log-probs = the committed weights, and the next push succeeds."""
    import asyncio

    from rlfleet.client import connect_async

    before = set(shm.list_segments())
    for i, timeout in enumerate([0.02, 0.1, 0.3, 0.6, 1.0]):
        weights = perturbed(committed[0], seed=1000 + 10 * i + len(transport))
        target = client.policy_version + 1
        with connect(suite["collector"].address, timeout=PUSH_TIMEOUT) as cut_client:
            try:
                cut_client.push_weights(weights, version=target, transport=transport, timeout=timeout,
                                        progress=False)
            except RlfleetClientError:
                pass
        barrier(client)  # a decided push completes on its own: wait for it
        if client.policy_version == target:
            committed[target] = weights
        # And by cancelling the caller's task mid-push (an asyncio cancel).
        async def cancel_mid_push(seed=2000 + i):
            async with connect_async(suite["collector"].address, timeout=PUSH_TIMEOUT) as aclient:
                task = asyncio.ensure_future(aclient.push_weights(
                    perturbed(committed[0], seed=seed), transport=transport, progress=False))
                await asyncio.sleep(timeout)  # the cut itself (at 5 points of the push), not a wait
                task.cancel()
                try:
                    await task
                    return seed, True
                except (asyncio.CancelledError, RlfleetClientError):
                    return seed, False
        version_before = client.policy_version
        seed, _ = asyncio.run(cancel_mid_push())
        barrier(client)
        if client.policy_version == version_before + 1:
            committed[version_before + 1] = perturbed(committed[0], seed=seed)
        assert_serving(suite, client, committed, tiny_model_dir)
    weights = perturbed(committed[0], seed=3000 + len(transport))
    result = client.push_weights(weights, transport=transport, progress=False)  # the next push succeeds
    committed[result.version] = weights
    assert_serving(suite, client, committed, tiny_model_dir)
    wait_for(lambda: our_segments(suite, before) == set(), RELEASE_TIMEOUT, "segments to be released", interval=0.1)


TRAINER = textwrap.dedent("""
    import sys, threading, grpc, torch
    from rlfleet.v1 import collector_pb2, collector_pb2_grpc
    from rlfleet.wire import shm
    from rlfleet.wire.push_messages import iter_push_messages
    from tests.hf_reference import load_hf
    address, model_dir, phase = sys.argv[1:4]
    state = {k: v + 1.0 for k, v in load_hf(model_dir).state_dict().items()}
    pairs = list(state.items())
    if phase == "shm-written":  # dies after writing its segment, before telling anyone
        _, manifest = next(iter_push_messages(pairs, version=0, checksum_algo=None))
        segment = shm.create_segment(manifest.total_bytes)
        shm.write_tensors(segment, [t for _, t in pairs])
        print("ready", segment.path, flush=True)
        threading.Event().wait()
    def requests():  # grpc: half the chunks, then hang until killed
        messages = list(iter_push_messages(pairs, version=0, chunk_bytes=16 << 10))
        for i, (kind, msg) in enumerate(messages):
            if i == len(messages) // 2:
                print("ready", flush=True)
                threading.Event().wait()
            yield collector_pb2.PushWeightsRequest(**{kind: msg})
    stub = collector_pb2_grpc.CollectorServiceStub(grpc.insecure_channel(address))
    stub.PushWeights(requests(), timeout=600)
""")


@pytest.mark.parametrize("phase", ["grpc-half-streamed", "shm-written"])
def test_trainer_sigkill_mid_push_leaves_old_version_and_no_segment(suite, client, committed, tiny_model_dir,
                                                                    phase):
    version = client.policy_version
    before = set(shm.list_segments())
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, suite["collector"].address, str(tiny_model_dir),
                                phase], stdout=subprocess.PIPE, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        line = trainer.stdout.readline()
        assert line.startswith("ready"), line
        if phase == "shm-written":
            assert our_segments(suite, before) == {line.split()[1]}
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    # Staged bytes are discarded; the orphaned trainer segment is swept (lock gone with its holder).
    wait_for(lambda: our_segments(suite, before) == set(), RELEASE_TIMEOUT, "no segment left behind", interval=0.1)
    assert client.policy_version == version
    assert_serving(suite, client, committed, tiny_model_dir)


# ---------------------------------------------------------------- replicas


def test_a_rolling_update_switches_one_replica_at_a_time_while_the_other_serves(suite, client, committed,
                                                                                tiny_model_dir):
    """Under load, a rolling push drains and switches one replica at a time: at every moment a replica takes
    new work, both versions serve for a while and groups are generated meanwhile, every group that started
    then is pinned and ran on its pin alone, and the version commits once both replicas applied it."""
    weights = perturbed(committed[0], seed=4100)
    with Load(suite, client, "rolling") as load:
        wait_for(lambda: load.status().trajectories > load.before.trajectories, GENERATE_TIMEOUT,
                 "the load to reach the trainer")
        result = client.push_weights(weights, progress=False, strategy="rolling")
    committed[result.version] = weights
    assert result.all_applied
    after = load.wait_all_ended()
    rolling = after.rolling_update
    assert (rolling.from_version, rolling.to_version) == (load.before.policy_version, result.version)
    assert not rolling.in_progress and rolling.committed
    assert (rolling.replicas_switched, rolling.replicas_total) == (2, 2)
    assert ROLLING_SETTLE_SECONDS <= rolling.window_seconds <= rolling.max_window_seconds
    assert rolling.pinned_groups > 0 and rolling.pin_violations == 0
    # Each replica's requests (8 tokens) ended within the drain bound: none was aborted by the switch.
    assert "not drained in time" not in open(suite["collector"].log_path).read()
    during = [s for s in load.polls if s.rolling_update.in_progress and s.rolling_update.to_version == result.version]
    assert during, "no status poll saw the update in progress"
    for status in during:
        open_ = [r for r in status.replicas if r.healthy and not r.draining]
        assert open_, "every replica was out of new work at once"
        assert sum(r.draining for r in status.replicas) <= 1
    both = [s for s in during if {r.policy_version for r in s.replicas} == {rolling.from_version, result.version}]
    assert both, "no poll saw both versions serving"
    assert both[-1].trajectories > both[0].trajectories, "nothing reached the trainer while both versions served"
    assert_serving(suite, client, committed, tiny_model_dir)


def test_replica_killed_mid_rolling_update_then_restarted_is_resynced_over_shm(suite, client, committed,
                                                                               tiny_model_dir):
    """A rolling update under load: once one replica switched, the other (the victim, waiting its turn) is
    SIGKILLed. The update completes on the survivor with nothing lost (every prompt submitted ends as a
    group, none as a dead letter) and no sample off its pin. The victim then misses two deltas and an
    adapter; it rejoins at the committed version (the collector's spool holds the deltas patched into a
    full copy, and the adapter beside it), then takes deltas again."""
    weights = perturbed(committed[0], seed=4242)
    target = client.policy_version + 1
    with Load(suite, client, "kill") as load, concurrent.futures.ThreadPoolExecutor(1) as pool:
        pushing = pool.submit(client.push_weights, weights, progress=False, delta=True, strategy="rolling")

        def one_switched():
            status = load.status()
            update = status.rolling_update
            return update.in_progress and update.to_version == target and update.replicas_switched == 1 and status
        status = wait_for(one_switched, PUSH_TIMEOUT, "the first replica to switch", interval=0.02)
        victim_key = next(key for key, proc in suite.items() if key.startswith("generation") and
                          {r.address: r.policy_version for r in status.replicas}[proc.address] != target)
        victim = suite[victim_key]
        victim.kill()  # SIGKILL the service and its engine core, while it waits for its turn
        result = pushing.result(timeout=PUSH_TIMEOUT)
    survivor = next(proc for key, proc in suite.items() if key.startswith("generation") and key != victim_key)
    assert result.version == target and result.base_version is None
    assert {r.address: r.applied for r in result.replicas} == {survivor.address: True, victim.address: False}
    committed[result.version] = weights
    after = load.wait_all_ended()
    assert after.rolling_update.committed and after.rolling_update.pin_violations == 0
    assert after.rolling_update.replicas_switched == 1
    for step in range(1, 3):
        weights = changed_few(weights, DELTA_TENSORS[step % 2:step % 2 + 1], seed=4243 + step)
        result = client.push_weights(weights, progress=False, delta=True)
        committed[result.version] = weights
        assert result.base_version is not None
        applied = {r.address: r.applied for r in result.replicas}
        # Out of rotation, the victim is only probed (and left out) by the next pushes.
        assert applied[survivor.address] and not applied.get(victim.address, False)
    model = adapted(tiny_model_dir, weights, seed=4250, rank=4)
    result = client.push_adapter(model, progress=False)
    committed[result.version] = model
    assert result.replicas[0].applied and not any(r.applied for r in result.replicas[1:])
    assert_serving(suite, client, committed, tiny_model_dir, procs=[survivor])

    restarted = ServiceProcess("generation", [*victim.args, "--port", str(victim.port)])
    restarted.start(victim.log_path.parent / "restarted").wait_ready(ENGINE_START_TIMEOUT)
    suite[victim_key] = restarted  # stopped by the suite fixture
    # A fresh engine serves its checkpoint (version 0) until the monitor re-syncs it, which may
    # already have happened by now: only the outcome is asserted.

    stub = collector_pb2_grpc.CollectorServiceStub(grpc.insecure_channel(suite["collector"].address))

    def back_in_rotation():
        status = stub.GetStatus(collector_pb2.GetStatusRequest(), timeout=QUERY_TIMEOUT)
        return {r.address: (r.healthy, r.policy_version) for r in status.replicas}[victim.address] == \
            (True, result.version)
    wait_for(back_in_rotation, RESYNC_TIMEOUT, "the restarted replica to be re-synced", interval=0.1)
    assert f"replica {victim.address} re-synced to version {result.version} over shm" in \
        open(suite["collector"].log_path).read()
    assert_serving(suite, client, committed, tiny_model_dir)
    for step in range(2):  # the adapter push forgot the client's base: full, then a delta
        weights = changed_few(weights, DELTA_TENSORS[:1], seed=4260 + step)
        result = client.push_weights(weights, progress=False, delta=True)
        committed[result.version] = weights
        assert (result.base_version is not None) == (step == 1) and result.all_applied
    assert_serving(suite, client, committed, tiny_model_dir)


@pytest.fixture(scope="module")
def elsewhere():
    """Shared-memory directories of replicas "on other hosts" (one each: they cannot open our segments),
    removed with the module (the replicas restarted there serve until the suite stops)."""
    directories: list[str] = []

    def make() -> str:
        directories.append(tempfile.mkdtemp(prefix="rlfleet-test-otherhost-", dir=shm.SHM_DIR))
        return directories[-1]
    yield make
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def test_replica_on_another_host_joins_from_its_peer_then_gets_grpc_within_the_same_push(suite, client, committed,
                                                                                        tiny_model_dir, elsewhere):
    """A replica that cannot open our segments (here: its own shm directory, as on another host or
    in another IPC namespace), restarted mid-run, joins from its peer: the peer sends it the weights it
    keeps (relayed over grpc) while it serves on, and the spool sends nothing. Both then serve the committed
    weights; the next pushes reach it over grpc (relayed) while its peer maps them."""
    victim_key = "generation-1"
    victim = suite[victim_key]
    victim.kill()  # and restarted at once, before any push: the collector must notice (its monitor or a call)
    directory = elsewhere()
    restarted = ServiceProcess("generation", [*victim.args, "--port", str(victim.port)],
                               env={"RLFLEET_SHM_DIR": directory})
    restarted.start(victim.log_path.parent / "otherhost").wait_ready(ENGINE_START_TIMEOUT)
    suite[victim_key] = restarted
    stub = collector_pb2_grpc.CollectorServiceStub(grpc.insecure_channel(suite["collector"].address))

    def back_in_rotation():
        status = stub.GetStatus(collector_pb2.GetStatusRequest(), timeout=QUERY_TIMEOUT)
        return {r.address: (r.healthy, r.policy_version) for r in status.replicas}[victim.address] == \
            (True, client.policy_version)
    peer = suite["generation-0"]
    wait_for(lambda: replica_version(restarted) == client.policy_version, RESYNC_TIMEOUT,
             "the restarted replica to be noticed and re-synced from its peer", interval=0.1)
    wait_for(back_in_rotation, RESYNC_TIMEOUT, "the replica back in rotation", interval=0.1)
    said = open(suite["collector"].log_path).read()
    assert f"replica {victim.address} joined at version {client.policy_version} from peer {peer.address}" in said
    assert f"replica {victim.address} re-synced to version {client.policy_version} over relay" in said
    assert f"shared version {client.policy_version} with {victim.address}" in peer.log_tail(400)
    status = stub.GetStatus(collector_pb2.GetStatusRequest(), timeout=QUERY_TIMEOUT)
    assert {r.address: r.healthy for r in status.replicas}[peer.address]  # the peer served on
    assert_serving(suite, client, committed, tiny_model_dir)
    # Joined from a peer, it was never offered a segment: the first push offers one, which it refuses, and
    # it gets the bytes over grpc within the same push. Known to be elsewhere from then on, the bytes are
    # relayed to it (a relay of one), as they arrive.
    for i, (transport, its) in enumerate([("grpc", "grpc"), ("grpc", "relay"), ("shm", "relay")]):
        weights = perturbed(committed[0], seed=5000 + i)
        result = client.push_weights(weights, transport=transport, progress=False)
        committed[result.version] = weights
        assert result.all_applied and result.transport == transport
        assert {r.address: r.transport for r in result.replicas} == {suite["generation-0"].address: "shm",
                                                                      victim.address: its}
        assert {r.address: r.sent_bytes for r in result.replicas} == {suite["generation-0"].address: 0,
                                                                      victim.address: model_bytes(weights)}
        assert_serving(suite, client, committed, tiny_model_dir)
    # Its grpc staging segments are gone too, but for the last one: the weights it keeps for deltas.
    (kept,) = os.listdir(directory)
    fds = f"/proc/{restarted.process.pid}/fd"
    assert os.path.join(directory, kept) in {os.readlink(os.path.join(fds, fd)) for fd in os.listdir(fds)}


def model_bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def test_replicas_on_other_hosts_get_one_relayed_copy_and_a_dead_relay_is_routed_around(suite, client, committed,
                                                                                       tiny_model_dir, elsewhere):
    """Both replicas elsewhere (each its own shm directory: the first restarted there now, the second by
    the test above; both joined from their peer): a push reaches them relayed, the first
    forwarding the bytes to the second as they arrive, so the collector sends one copy in all. The first
    one then stops answering in the middle of the next push's relay (SIGSTOP: the collector holds its
    relay call open, the second replica waits on it for every byte) and is SIGKILLed: the relay goes
    around it, the second replica stages and commits. The killed one, restarted, joins from its peer,
    which is SIGKILLed in the middle of that share: the join falls back to the spool."""
    old, second = suite["generation-0"], suite["generation-1"]  # the second is elsewhere already (the test above)
    old.kill()
    directory = elsewhere()
    first = suite["generation-0"] = ServiceProcess("generation", [*old.args, "--port", str(old.port)],
                                                   env={"RLFLEET_SHM_DIR": directory})
    first.start(old.log_path.parent / "relay-first").wait_ready(ENGINE_START_TIMEOUT)
    wait_for(lambda: all(replica_version(p) == client.policy_version for p in (first, second)), RESYNC_TIMEOUT,
             "the restarted replica re-synced (from its peer, elsewhere too)", interval=0.1)
    stub = collector_pb2_grpc.CollectorServiceStub(grpc.insecure_channel(suite["collector"].address))
    wait_for(lambda: all(r.healthy for r in stub.GetStatus(collector_pb2.GetStatusRequest(),
                                                            timeout=QUERY_TIMEOUT).replicas),
             RESYNC_TIMEOUT, "both back in rotation", interval=0.1)

    # Joined from its peer, the restarted one was never offered a segment: the next push offers one, which it
    # refuses (grpc within that push); from then on both are relayed.
    weights = perturbed(committed[0], seed=5099)
    result = client.push_weights(weights, transport="grpc", progress=False)
    committed[result.version] = weights
    assert result.all_applied
    assert {r.address: r.transport for r in result.replicas} == {first.address: "grpc", second.address: "relay"}

    weights = perturbed(committed[0], seed=5100)
    result = client.push_weights(weights, transport="grpc", progress=False)
    committed[result.version] = weights
    assert result.all_applied
    assert {r.address: r.transport for r in result.replicas} == {first.address: "relay", second.address: "relay"}
    assert result.sent_bytes == model_bytes(weights)  # one copy from the collector, for both
    assert {r.address: r.sent_bytes for r in result.replicas} == {first.address: model_bytes(weights),
                                                                  second.address: 0}
    assert_serving(suite, client, committed, tiny_model_dir)

    # The next push: the first relay stops answering, the push begins and its relay with it, then the
    # first relay dies.
    os.kill(first.process.pid, signal.SIGSTOP)
    weights = perturbed(committed[0], seed=5101)
    relaying = f"relaying version {client.policy_version + 1} through 2 replicas: {first.address} -> " \
               f"{second.address}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pushing = pool.submit(client.push_weights, weights, transport="grpc", progress=False)
        wait_for(lambda: relaying in open(suite["collector"].log_path).read(), PUSH_TIMEOUT,
                 "the push's relay through the stopped replica", interval=0.05)
        first.kill()
        result = pushing.result(timeout=PUSH_TIMEOUT)
    committed[result.version] = weights
    outcomes = {r.address: r for r in result.replicas}
    assert outcomes[second.address].applied and outcomes[second.address].transport == "relay"
    assert not outcomes[first.address].applied
    assert result.sent_bytes == model_bytes(weights)  # around the dead one: still one copy
    assert outcomes[second.address].sent_bytes == model_bytes(weights)
    assert f"replica {first.address} cut out" in open(suite["collector"].log_path).read()
    assert_serving(suite, client, committed, tiny_model_dir, procs=[second])

    # Restarted on a port of its own, behind a link on its address that holds the first connection to carry
    # more than SHARE_HELD_AFTER bytes to it (its peer's share of the weights: nothing else sends it that
    # many) right there; the peer dies with the share held in the middle of its bytes.
    own_port = free_port()
    again = ServiceProcess("generation", [*first.args, "--port", str(own_port)], env={"RLFLEET_SHM_DIR": directory})
    with StallingLink(first.port, f"127.0.0.1:{own_port}", stall_after=SHARE_HELD_AFTER) as link:
        suite["generation-0"] = again.start(first.log_path.parent / "relay-again").wait_ready(ENGINE_START_TIMEOUT)
        assert link.stalled.wait(RESYNC_TIMEOUT), "no share of the weights reached the restarted replica"
        second.kill()
        link.release()
        wait_for(lambda: replica_version(again) == client.policy_version, RESYNC_TIMEOUT,
                 "the killed relay re-synced from the spool once its peer died mid-share", interval=0.1)
        said = open(suite["collector"].log_path).read()
        version = client.policy_version
        assert f"replica {first.address} could not take version {version} from peer {second.address}" in said
        assert f"replica {first.address} joined at version {version} from" not in said
        assert f"replica {first.address} re-synced to version {version} over grpc" in said
        assert_serving(suite, client, committed, tiny_model_dir, procs=[again])
