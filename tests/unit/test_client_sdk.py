"""The client SDK against a real in-process grpc.aio server with fake servicers.

The fakes (here only) stand in for the collector and the trajectory buffer so
the SDK's own logic is tested: streaming pushes, version assignment, batch
streams with auto-ack / ack / nack, the sync and async twins, auth metadata,
and that every status code arrives as its typed exception, never a raw
``grpc.RpcError``. The server runs on its own thread and event loop so both
the blocking client and the async client (on pytest's loop) can reach it.
"""

from __future__ import annotations

import asyncio
import re
import collections
import socket
import threading
import time
import zlib

import grpc
import pytest
import torch

from rlfleet.client import (
    AbortedError, AsyncClient, Batch, Client, DeadlineExceededError, FailedPreconditionError, InternalError,
    InvalidArgumentError, NotFoundError, ResourceExhaustedError, RlfleetClientError, UnauthenticatedError,
    UnavailableError, connect, connect_async,
)
from rlfleet.wire import shm
from rlfleet.v1 import (
    collector_pb2, collector_pb2_grpc, tensor_pb2, trajectory_pb2, trajectory_pb2_grpc, weights_pb2,
)
from rlfleet.wire import Ragged, encode_tensordict
from rlfleet.wire.tensor import dtype_from_wire
from tests.waiting import wait_for

TOKEN = "s3cret"
CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.INTERNAL: InternalError,
}
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
REOPENED = (*RETRYABLE, grpc.StatusCode.CANCELLED)
"""What a batch stream is reopened after: the retryable codes, and CANCELLED (a stopping server's open streams)."""
RETRIES = 2
SERVER_TIMEOUT = 10.0
"""Until the fake server (its own thread and loop) has handled what the client sent or ended: milliseconds;
10 s for a loaded machine."""


# --- the fake services --------------------------------------------------------------------------
class State:
    """What the fakes saw and what they are told to do; a fresh one per test."""

    def __init__(self):
        self.version = 0
        self.calls = collections.Counter()
        self.metadata: list[tuple[str, dict]] = []
        self.failures: dict[str, list] = {}  # method -> [(code, count or None = always)]
        self.accept_shm = False
        self.shm_offers = 0
        self.push_fail_when = "start"  # "start", "after_manifest" (stalls first) or "commit"
        self.hang_seconds = 0.0
        self.pushes: list[dict] = []
        self.prompts: list[collector_pb2.PromptSpec] = []
        self.ready: collections.deque = collections.deque()  # (lease_id, TensorDict msg, redelivered)
        self.settled: list[tuple[str, str]] = []
        self.opens: list[trajectory_pb2.OpenBatchStream] = []
        self.streams_ended = 0
        self.stream_error: tuple[int, grpc.StatusCode] | None = None  # abort after n deliveries
        self.failure_requests: list[tuple[int, int]] = []
        self.waiting_for = ""  # the collector's not_serving_reason
        self.expired: set[str] = set()  # leases whose ack comes too late (released for redelivery)
        self.ack_delay = 0.0  # seconds the stream takes over each ack or nack before applying it (a loaded server)

    def add_batches(self, count: int, size: int = 4) -> None:
        for i in range(count):
            self.ready.append((f"lease-{len(self.ready)}-{i}", make_batch(i, size), False))

    def fail(self, method: str, code: grpc.StatusCode, times: int | None = None) -> None:
        self.failures[method] = [code, times]

    def failure(self, method: str):
        plan = self.failures.get(method)
        if not plan:
            return None
        code, times = plan
        if times is not None:
            if times == 0:
                return None
            plan[1] = times - 1
        return code


def make_batch(i: int, size: int) -> tensor_pb2.TensorDict:
    lengths = torch.tensor([1 + (i + j) % 3 for j in range(size)])
    values = torch.arange(int(lengths.sum()), dtype=torch.int64) + 100 * i
    return encode_tensordict({
        "tokens": {"response": Ragged(values, lengths)},
        "score": torch.full((size,), float(i)),
        "trajectory_id": [f"t{i}-{j}" for j in range(size)],
    }, batch_size=[size])


async def enter(server, context, method: str) -> State:
    """Record the call; fail it if the test said so (auth first, like the real interceptor)."""
    state = server.state
    state.calls[method] += 1
    metadata = dict(context.invocation_metadata())
    state.metadata.append((method, metadata))
    if server.required_token and metadata.get("authorization") != f"Bearer {server.required_token}":
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")
    if state.hang_seconds:
        await asyncio.sleep(state.hang_seconds)  # a slow server: the client's deadline ends the call long before
    return state


class FakeCollector(collector_pb2_grpc.CollectorServiceServicer):
    def __init__(self, server):
        self.server = server

    async def _unary(self, method, context):
        state = await enter(self.server, context, method)
        code = state.failure(method)
        if code is not None:
            await context.abort(code, f"{method} failed on purpose")
        return state

    async def GetPolicyVersion(self, request, context):
        state = await self._unary("GetPolicyVersion", context)
        return collector_pb2.GetPolicyVersionResponse(version=state.version)

    async def SubmitPrompts(self, request, context):
        state = await self._unary("SubmitPrompts", context)
        state.prompts.extend(request.prompts)
        return collector_pb2.SubmitPromptsResponse(
            prompt_ids=[p.prompt_id or f"auto-{i}" for i, p in enumerate(request.prompts)])

    async def GetStatus(self, request, context):
        state = await self._unary("GetStatus", context)
        return collector_pb2.GetStatusResponse(
            policy_version=state.version, mode="async", max_staleness=2,
            stages=[collector_pb2.StageStatus(name="generation", queued=3, in_flight=2, items_per_second=1.5)],
            replicas=[collector_pb2.ReplicaStatus(address="gen-0:1", healthy=True, policy_version=state.version)],
            staleness_histogram=[5, 1], trajectories=6, discarded_samples=1, group_size=4, groups_per_step=8,
            pending_prompts=3, failed_prompts=1, serving=not state.waiting_for,
            not_serving_reason=state.waiting_for)

    async def ListFailures(self, request, context):
        state = await self._unary("ListFailures", context)
        state.failure_requests.append((request.after_seq, request.limit))
        return collector_pb2.ListFailuresResponse(total=1, failures=[collector_pb2.PromptFailure(
            seq=1, prompt_id="p1", stage="reward", code="NOT_FOUND", error="no such reward function")])

    async def PushWeights(self, request_iterator, context):
        state = await enter(self.server, context, "PushWeights")
        code = state.failure("PushWeights")
        if code is not None and state.push_fail_when == "start":
            await context.abort(code, "push refused on purpose")
        requests = aiter(request_iterator)
        manifest = (await anext(requests)).manifest
        if manifest.HasField("shm"):
            state.shm_offers += 1
            if not state.accept_shm:  # a collector on another host cannot open the trainer's segment
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"{shm.SHM_UNAVAILABLE} at the collector: no such file")
            with shm.open_segment(manifest.shm.path, manifest.total_bytes) as segment:
                data = bytearray(segment.buffer)
            return self._commit(state, manifest, data, crc_checked=False)
        if code is not None and state.push_fail_when == "after_manifest":
            await asyncio.sleep(0.3)  # stop reading: the client is stuck mid-push under flow control
            await context.abort(code, "replica went away mid-push")
        data = bytearray()
        async for request in requests:
            chunk = request.chunk
            if chunk.offset != len(data):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"chunk.offset {chunk.offset} != {len(data)}")
            data += chunk.data
        if len(data) != manifest.total_bytes or manifest.checksum != f"crc32:{zlib.crc32(data):08x}":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "size or checksum mismatch")
        if code is not None:  # "commit": everything arrived, then it failed
            await context.abort(code, "commit failed on purpose")
        version = manifest.version or state.version + 1
        if version <= state.version:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"version {version} is not greater than {state.version}")
        return self._commit(state, manifest, data)

    @staticmethod
    def _commit(state, manifest, data, crc_checked=True):
        version = manifest.version or state.version + 1
        tensors, offset = {}, 0
        for spec in manifest.tensors:
            dtype = dtype_from_wire(spec.dtype)
            size = torch.Size(spec.shape).numel() * torch.empty((), dtype=dtype).element_size()
            raw = torch.frombuffer(bytearray(data[offset:offset + size]) or bytearray(1), dtype=torch.uint8)[:size]
            tensors[spec.name] = raw.view(dtype).reshape(list(spec.shape)) if size else torch.empty(
                list(spec.shape), dtype=dtype)
            offset += size
        state.version = version
        state.pushes.append({"manifest": manifest, "tensors": tensors, "crc32": zlib.crc32(data)})
        return collector_pb2.PushWeightsResponse(
            version=version, received_bytes=len(data), seconds=0.01,
            replicas=[collector_pb2.ReplicaPushResult(address="gen-0:1", applied=True),
                      collector_pb2.ReplicaPushResult(address="gen-1:1", applied=False, error="down")])


class FakeTrajectory(trajectory_pb2_grpc.TrajectoryServiceServicer):
    def __init__(self, server):
        self.server = server

    async def GetStats(self, request, context):
        state = await enter(self.server, context, "GetStats")
        code = state.failure("GetStats")
        if code is not None:
            await context.abort(code, "GetStats failed on purpose")
        return trajectory_pb2.GetStatsResponse(ready=len(state.ready), capacity=100, acked=len(state.settled))

    async def DropStale(self, request, context):
        state = await enter(self.server, context, "DropStale")
        code = state.failure("DropStale")
        if code is not None:
            await context.abort(code, "Method not implemented!" if code == grpc.StatusCode.UNIMPLEMENTED
                                else "DropStale failed on purpose")
        # The answer echoes the request, so a test sees what was sent.
        return trajectory_pb2.DropStaleResponse(dropped=request.below_policy_version, group_ids=[7, 9],
                                                prompt_ids=["p7", "p9"])

    async def StreamBatches(self, request_iterator, context):
        state = await enter(self.server, context, "StreamBatches")
        code = state.failure("StreamBatches")
        if code is not None:
            await context.abort(code, "cannot open a stream now")
        requests = aiter(request_iterator)
        opened = (await anext(requests)).open
        state.opens.append(opened)
        leases: dict[str, tensor_pb2.TensorDict] = {}
        answers: collections.deque = collections.deque()  # Settled, answered before the next batch
        changed, half_closed = asyncio.Event(), asyncio.Event()

        async def pump():
            async for request in requests:
                await asyncio.sleep(state.ack_delay)
                kind = request.WhichOneof("kind")
                lease_id = getattr(request, kind).lease_id
                state.settled.append((kind, lease_id))
                batch = leases.pop(lease_id, None)
                applied = batch is not None and lease_id not in state.expired
                if batch is not None and (kind == "nack" or not applied):
                    state.ready.appendleft((lease_id, batch, True))
                answers.append(trajectory_pb2.Settled(
                    lease_id=lease_id, nack=kind == "nack", applied=applied,
                    trajectories=batch.batch_size[0] if applied else 0,
                    reason="" if applied else "expired and released for redelivery"))
                changed.set()
            half_closed.set()
            changed.set()

        task = asyncio.create_task(pump())
        delivered = 0
        try:
            while True:
                if state.stream_error is not None and delivered == state.stream_error[0]:
                    await context.abort(state.stream_error[1], "stream broke on purpose")
                while not half_closed.is_set() and not answers and (
                        len(leases) >= max(opened.prefetch, 1) or not state.ready):
                    changed.clear()
                    await changed.wait()
                if answers:
                    yield trajectory_pb2.StreamBatchesResponse(settled=answers.popleft())
                    continue
                if half_closed.is_set():
                    return
                lease_id, batch, redelivered = state.ready.popleft()
                leases[lease_id] = batch
                delivered += 1
                yield trajectory_pb2.StreamBatchesResponse(
                    lease_id=lease_id, batch=batch, redelivered=redelivered, lease_expires_at=time.time() + 30)
        finally:
            task.cancel()
            for lease_id, batch in leases.items():  # the reader left: its batches go back
                state.ready.appendleft((lease_id, batch, True))
            state.streams_ended += 1


class ServerThread:
    def __init__(self):
        self.state = State()
        self.required_token: str | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self.run(self._start())
        self.address = f"127.0.0.1:{self.port}"

    async def _start(self) -> int:
        # No BDP probing: the receive window stays at its default size, so a handler that stops reading
        # really does hold a push mid-stream (with probing the window can grow past a whole test push,
        # letting the client hand over its last chunk before the handler fails: seen as a flake in CI).
        options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.http2.bdp_probe", 0)]
        self.server = grpc.aio.server(options=options)
        collector_pb2_grpc.add_CollectorServiceServicer_to_server(FakeCollector(self), self.server)
        trajectory_pb2_grpc.add_TrajectoryServiceServicer_to_server(FakeTrajectory(self), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture(scope="module")
def server():
    srv = ServerThread()
    yield srv
    srv.stop()


@pytest.fixture
def state(server) -> State:
    server.state = State()
    server.required_token = None
    return server.state


@pytest.fixture
def client(server, state):
    with connect(server.address, timeout=5, retries=RETRIES, backoff_seconds=0.001) as c:
        yield c


def aclient(server, **kwargs) -> AsyncClient:
    return connect_async(server.address, **{"timeout": 5, "retries": RETRIES, "backoff_seconds": 0.001, **kwargs})


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(300, 64, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(64, 96, generator=g).to(torch.bfloat16).t(),  # strided
        "model.layers.0.norm.weight": torch.randn(64, generator=g).half(),
        "model.position_ids": torch.arange(17),
        "model.mask": torch.rand(5, 3, generator=g) > 0.5,
        "model.scale": torch.tensor(3.25, dtype=torch.float64),
        "model.empty": torch.empty(0, 4),
    }


def assert_bit_exact(sent: dict[str, torch.Tensor], received: dict[str, torch.Tensor]) -> None:
    assert list(received) == list(sent)
    for name, tensor in sent.items():
        got = received[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8), flat), name


def expected_crc32(tensors: dict[str, torch.Tensor]) -> int:
    crc = 0
    for tensor in tensors.values():
        crc = zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


# --- unary calls ---------------------------------------------------------------------------------
def test_policy_version_status_and_buffer_stats(client, state):
    state.version = 7
    assert client.policy_version == 7
    status = client.status()
    assert status.policy_version == 7 and status.mode == "async" and status.max_staleness == 2
    assert status.stages[0].name == "generation" and status.stages[0].queued == 3
    assert status.replicas[0].healthy and status.staleness_histogram == (5, 1)
    assert status.group_size == 4 and status.groups_per_step == 8
    assert (status.pending_prompts, status.failed_prompts) == (3, 1)
    failures, total = client.failures(after_seq=0, limit=5)
    assert total == 1 and failures[0].prompt_id == "p1" and failures[0].code == "NOT_FOUND"
    assert state.failure_requests[-1] == (0, 5)
    state.add_batches(2)
    stats = client.buffer_stats()
    assert stats.ready == 2 and stats.capacity == 100


def test_submit_prompts_in_every_form(client, state):
    ids = client.submit_prompts([
        "plain text",
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
        [1, 2, 3],
        torch.tensor([4, 5], dtype=torch.int32),
        {"prompt": "What is 6*7?", "prompt_id": "q42", "ground_truth": "42", "reward_fn": "math",
         "reward_args": {"tolerance": 0.5}, "sampling": {"n": 4, "temperature": 0.7, "max_tokens": 32},
         "environment": "tool_calling"},
    ])
    # Ids are the SDK's (so a retried call is harmless), or the caller's.
    assert ids == [p.prompt_id for p in state.prompts] and ids[4] == "q42"
    assert all(re.fullmatch("[0-9a-f]{32}", i) for i in ids[:4]) and len(set(ids)) == 5
    text, chat, ids_list, ids_tensor, spec = state.prompts
    assert text.prompt.text == "plain text"
    assert [(m.role, m.content) for m in chat.prompt.chat.messages] == [("system", "be brief"), ("user", "2+2?")]
    assert ids_list.prompt.token_ids.dtype == tensor_pb2.DTYPE_INT64 and list(ids_list.prompt.token_ids.shape) == [3]
    assert ids_tensor.prompt.token_ids.dtype == tensor_pb2.DTYPE_INT32
    assert spec.ground_truth == "42" and spec.reward_fn == "math" and dict(spec.reward_args) == {"tolerance": "0.5"}
    assert spec.environment == "tool_calling" and text.environment == ""
    assert spec.sampling.n == 4 and spec.sampling.max_tokens == 32 and spec.sampling.temperature == pytest.approx(0.7)
    assert client.submit_prompts("one prompt") == [state.prompts[-1].prompt_id]


@pytest.mark.parametrize("bad, match", [
    ([{"role": "user", "content": "hi"}], "wrapped in a list"),
    ([5], "bare int"),
    ([{"prompt": "x", "answer": "y"}], "unknown keys"),
    ([{"prompt": "x", "sampling": {"temp": 1}}], "unknown sampling fields"),
    ([torch.zeros(2, 2, dtype=torch.int64)], "1-D"),
    ([], "empty"),
])
def test_bad_prompts_fail_before_sending(client, state, bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        client.submit_prompts(bad)
    assert state.calls["SubmitPrompts"] == 0


UNARY = {
    "GetPolicyVersion": lambda c: c.policy_version,
    "SubmitPrompts": lambda c: c.submit_prompts(["hi"]),
    "GetStatus": lambda c: c.status(),
    "GetStats": lambda c: c.buffer_stats(),
}


@pytest.mark.parametrize("code", list(CODES), ids=lambda c: c.name)
@pytest.mark.parametrize("method", list(UNARY))
def test_unary_errors_are_typed_and_only_transport_errors_retried(client, state, method, code):
    state.fail(method, code)
    with pytest.raises(CODES[code]) as info:
        UNARY[method](client)
    assert not isinstance(info.value, grpc.RpcError) and info.value.method == method
    # (SubmitPrompts too: the SDK names every prompt, and the collector does not queue an id twice.)
    retried = code in RETRYABLE
    assert state.calls[method] == (1 + RETRIES if retried else 1)


def test_unavailable_then_success_is_retried_transparently(client, state):
    state.version = 3
    state.fail("GetPolicyVersion", grpc.StatusCode.UNAVAILABLE, times=RETRIES)
    assert client.policy_version == 3
    assert state.calls["GetPolicyVersion"] == RETRIES + 1


def test_client_side_deadline_on_unary_calls(server, state):
    state.hang_seconds = 1.0
    with connect(server.address, timeout=0.1, retries=1, backoff_seconds=0.001) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            client.status()
        assert time.monotonic() - started < 1.5
    wait_for(lambda: state.calls["GetStatus"] == 2, SERVER_TIMEOUT, "the server to see both attempts")


def test_wait_ready_waits_until_the_collector_serves_and_says_what_it_waits_for(client, state):
    state.waiting_for = "waiting for reference at 10.0.0.9:50052: UNAVAILABLE"
    with pytest.raises(UnavailableError, match="not serving within 0.5 s: waiting for reference at 10.0.0.9"):
        client.wait_ready(timeout=0.5)
    assert client.status().serving is False
    state.waiting_for = ""
    client.wait_ready(timeout=5)
    assert client.status().serving


def test_server_down_is_unavailable_after_bounded_retries():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with connect(f"127.0.0.1:{port}", timeout=2, retries=2, backoff_seconds=0.001) as client:
        with pytest.raises(UnavailableError):
            client.policy_version
        with pytest.raises(UnavailableError):
            client.wait_ready(timeout=0.2)


def test_auth_token_rides_on_every_call_including_streams(server, state):
    server.required_token = TOKEN
    state.add_batches(1)
    with connect(server.address, auth_token=TOKEN, timeout=5, retries=0) as client:
        client.policy_version
        client.push_weights({"w": torch.ones(3)}, progress=False)
        with client.batches(4) as batches:
            next(batches)
    assert {m for m, _ in state.metadata} == {"GetPolicyVersion", "PushWeights", "StreamBatches"}
    assert all(md.get("authorization") == f"Bearer {TOKEN}" for _, md in state.metadata)
    with connect(server.address, auth_token="wrong", timeout=5, retries=0) as client:
        with pytest.raises(UnauthenticatedError):
            client.policy_version
        with pytest.raises(UnauthenticatedError):
            client.push_weights({"w": torch.ones(3)})
        with pytest.raises(UnauthenticatedError):
            next(client.batches(4))


# --- push_weights ----------------------------------------------------------------------------------
def test_push_streams_a_state_dict_bit_exactly_and_assigns_versions(client, state):
    weights = state_dict()
    result = client.push_weights(weights, chunk_bytes=4096, progress=False)
    assert result.version == 1 and state.version == 1
    push = state.pushes[-1]
    assert push["manifest"].version == 0  # None asks the collector for current + 1
    assert push["manifest"].mode == weights_pb2.UPDATE_MODE_KEEP
    assert push["crc32"] == expected_crc32(weights)
    assert_bit_exact(weights, push["tensors"])
    assert result.bytes == sum(t.numel() * t.element_size() for t in weights.values())
    assert [r.applied for r in result.replicas] == [True, False] and not result.all_applied
    assert result.seconds > 0 and result.megabytes_per_second > 0 and result.attempts == 1

    assert client.push_weights(weights, version=10, mode="wait", progress=False).version == 10
    assert state.pushes[-1]["manifest"].mode == weights_pb2.UPDATE_MODE_WAIT
    with pytest.raises(FailedPreconditionError, match="not greater"):
        client.push_weights(weights, version=5, progress=False)
    assert client.push_weights(weights, progress=False).version == 11


def test_push_accepts_a_module(client, state):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    client.push_weights(model, mode="abort", progress=False)
    assert_bit_exact(dict(model.state_dict()), state.pushes[-1]["tensors"])
    assert state.pushes[-1]["manifest"].mode == weights_pb2.UPDATE_MODE_ABORT


@pytest.mark.parametrize("bad, error", [
    ({}, ValueError), ({"w": [1.0]}, TypeError), ({"w": torch.ones(2, dtype=torch.complex64)}, TypeError),
    ("model", TypeError),
])
def test_push_rejects_bad_weights_locally(client, state, bad, error):
    with pytest.raises(error):
        client.push_weights(bad)
    with pytest.raises(ValueError, match="mode"):
        client.push_weights({"w": torch.ones(1)}, mode="later")
    assert state.calls["PushWeights"] == 0


def test_push_progress_bar_and_missing_tqdm(client, state, capfd, monkeypatch):
    big = {"w": torch.zeros(3 << 20)}  # 12 MiB: above the progress threshold
    client.push_weights(big)
    assert "push weights" in capfd.readouterr().err
    client.push_weights({"w": torch.zeros(3)})
    assert "push weights" not in capfd.readouterr().err  # small pushes stay quiet
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # tqdm not installed
    assert client.push_weights(big).version == 3
    assert "push weights" not in capfd.readouterr().err


@pytest.mark.parametrize("code", list(CODES), ids=lambda c: c.name)
def test_push_errors_after_the_whole_stream_are_typed_and_not_replayed(client, state, code):
    state.fail("PushWeights", code)
    state.push_fail_when = "commit"
    with pytest.raises(CODES[code]) as info:
        client.push_weights(state_dict(), progress=False, transport="grpc")
    assert not isinstance(info.value, grpc.RpcError) and info.value.method == "PushWeights"
    # The collector had every byte: it may have committed, so even UNAVAILABLE is not resent.
    assert state.calls["PushWeights"] == 1 and state.version == 0


@pytest.mark.parametrize("code", list(CODES), ids=lambda c: c.name)
def test_push_refused_at_start_is_typed(client, state, code):
    state.fail("PushWeights", code)
    with pytest.raises(CODES[code]):  # 16 MiB: flow control stops the client long before the end
        client.push_weights({"w": torch.zeros(4 << 20)}, progress=False, transport="grpc")
    assert state.calls["PushWeights"] == (1 + RETRIES if code == grpc.StatusCode.UNAVAILABLE else 1)


def test_push_resent_after_an_early_unavailable_then_succeeds(client, state):
    weights = {"w": torch.randn(4 << 20)}  # 16 MiB: cannot all fit in flow-control windows
    state.fail("PushWeights", grpc.StatusCode.UNAVAILABLE, times=1)
    state.push_fail_when = "after_manifest"
    result = client.push_weights(weights, progress=False, transport="grpc")
    assert result.attempts == 2 and state.calls["PushWeights"] == 2 and result.version == 1
    assert_bit_exact(weights, state.pushes[-1]["tensors"])


def test_auto_transport_tries_shm_once_then_stays_on_grpc_when_refused(client, state):
    weights = state_dict()
    assert client.push_weights(weights, progress=False).version == 1
    assert state.shm_offers == 1 and state.calls["PushWeights"] == 2  # refused, then grpc
    assert_bit_exact(weights, state.pushes[-1]["tensors"])
    assert client.push_weights(weights, progress=False).version == 2
    assert state.shm_offers == 1 and state.calls["PushWeights"] == 3  # remembered: grpc straight away
    with pytest.raises(FailedPreconditionError, match="shm transport unavailable"):
        client.push_weights(weights, progress=False, transport="shm")  # asked for explicitly: no fallback


def test_shm_push_hands_over_a_segment_kept_for_the_next_push(client, state):
    state.accept_shm = True
    weights = {"a": torch.randn(64, 3), "b": torch.arange(5), "c": torch.randn(8).to(torch.bfloat16)}
    before = set(shm.list_segments())
    result = client.push_weights(weights, progress=False, transport="shm")
    assert result.version == 1 and state.shm_offers == 1 and state.calls["PushWeights"] == 1
    first = state.pushes[-1]["manifest"]
    assert first.checksum == ""  # the bytes never crossed a network
    assert_bit_exact(weights, state.pushes[-1]["tensors"])
    assert set(shm.list_segments()) - before == {first.shm.path}  # kept for the next push
    weights = {k: v + 1 for k, v in weights.items()}
    assert client.push_weights(weights, progress=False, transport="shm").version == 2
    assert state.pushes[-1]["manifest"].shm.path == first.shm.path  # rewritten in place: nobody held it
    assert_bit_exact(weights, state.pushes[-1]["tensors"])
    client.close()
    assert set(shm.list_segments()) == before  # closing the client removes it


def test_a_plain_push_that_commits_is_the_base_of_the_next_delta(client, state):
    """Once a client pushed with delta=True, each full push that commits (a plain one too) is what the
    next delta patches; a failed push and an adapter push leave nothing to patch (the next delta is full)."""
    weights = state_dict()
    name, other = "model.embed.weight", "model.layers.0.norm.weight"

    def one_changed(key: str = name) -> dict[str, torch.Tensor]:
        weights[key] = weights[key] + 1
        return weights

    def sent() -> tuple[int | None, list[str]]:
        manifest = state.pushes[-1]["manifest"]
        return (manifest.delta.base_version if manifest.HasField("delta") else None,
                [spec.name for spec in manifest.tensors])

    assert client.push_weights(weights, progress=False).base_version is None
    first = client.push_weights(one_changed(), progress=False, delta=True)  # no delta asked before: none kept
    assert first.base_version is None and sent() == (None, list(weights))
    plain = client.push_weights(one_changed(other), progress=False)
    assert plain.base_version is None and sent() == (None, list(weights))
    # Compared with the plain push's bytes (with the first push's, `other` would go too).
    delta = client.push_weights(one_changed(), progress=False, delta=True)
    assert (delta.base_version, delta.tensors) == (plain.version, 1) and sent() == (plain.version, [name])

    state.fail("PushWeights", grpc.StatusCode.INTERNAL, times=1)
    with pytest.raises(InternalError):
        client.push_weights(one_changed(), progress=False)  # may have committed: nothing is known
    assert client.push_weights(one_changed(), progress=False, delta=True).base_version is None
    assert client.push_weights(one_changed(), progress=False, delta=True).base_version == state.version - 1

    adapter = {"base_model.model.q_proj.lora_A.weight": torch.zeros(2, 4),
               "base_model.model.q_proj.lora_B.weight": torch.zeros(4, 2)}
    client.push_adapter(adapter, rank=2, alpha=4, target_modules=["q_proj"], progress=False)
    # The collector takes no delta on an adapter's version: the next delta push is full, then deltas again.
    assert client.push_weights(one_changed(), progress=False, delta=True).base_version is None
    assert sent() == (None, list(weights))
    assert client.push_weights(one_changed(), progress=False, delta=True).base_version == state.version - 1


# --- batches -------------------------------------------------------------------------------------------
def test_batches_yield_tensordicts_and_auto_ack_the_previous_one(client, state):
    state.add_batches(3)
    batches = client.batches(4, whole_groups=False, min_policy_version=2, lease_seconds=9, prefetch=1,
                             consumer="rank-0")
    first = next(batches)
    assert isinstance(first, Batch) and len(first) == 4 and not first.redelivered
    opened = state.opens[-1]
    assert (opened.batch_size, opened.whole_groups, opened.min_policy_version, opened.lease_seconds,
            opened.prefetch, opened.consumer) == (4, False, 2, 9.0, 1, "rank-0")
    assert first.td["score"].tolist() == [0.0] * 4
    assert first.td["trajectory_id"] == ["t0-0", "t0-1", "t0-2", "t0-3"]
    assert first.td["tokens", "response"].is_nested
    padded, mask = first.padded("tokens/response", pad_value=-1)
    assert mask.sum(1).tolist() == [1, 2, 3, 1] and padded[0].tolist() == [0, -1, -1]
    assert first.ragged(("tokens", "response")).to_list()[1].tolist() == [1, 2]
    assert first.nested("tokens/response").is_nested
    left, _ = first.padded("tokens/response", side="left")
    assert left[0].tolist() == [0, 0, 0] and left[1].tolist() == [0, 1, 2]
    assert state.settled == []

    second = next(batches)  # prefetch=1: only possible because asking for it acked the first
    assert state.settled == [("ack", first.lease_id)]
    second.nack()
    third = next(batches)  # the nacked batch comes straight back
    assert third.lease_id == second.lease_id and third.redelivered
    wait_for(lambda: ("nack", second.lease_id) in state.settled, SERVER_TIMEOUT, "the server to see the nack")
    batches.close()  # a deliberate close acks the last batch
    assert state.settled[-1] == ("ack", third.lease_id)
    wait_for(lambda: state.streams_ended == 1, SERVER_TIMEOUT, "the server to see the stream end")


def test_a_batchs_string_entries_come_as_plain_lists_of_str(client, state):
    """``batch[key]`` of a string entry is a list of str (``batch.td`` keeps tensordict's NonTensorStack),
    whether the strings differ or, as one group's prompt_id, repeat."""
    state.ready.append(("lease-strings", encode_tensordict({
        "score": torch.zeros(4), "prompt_id": ["p-7"] * 4, "trajectory_id": [f"7-{j}" for j in range(4)],
        "query": ["say 7"] * 4}, batch_size=[4]), False))
    with client.batches(4) as batches:
        batch = next(batches)
    for key, strings in (("prompt_id", ["p-7"] * 4), ("trajectory_id", ["7-0", "7-1", "7-2", "7-3"]),
                         ("query", ["say 7"] * 4)):
        assert type(batch[key]) is list and batch[key] == strings and all(type(s) is str for s in batch[key])
        assert batch[(key,)] == strings
    assert isinstance(batch["score"], torch.Tensor)


def test_the_servers_answers_are_recorded_on_the_batches(client, state, caplog):
    state.add_batches(3)
    batches = client.batches(4, prefetch=1)  # the ack is answered before the next batch is leased
    first = next(batches)
    state.expired.add(first.lease_id)  # its lease runs out before the ack arrives
    second = next(batches)  # auto-acks the first: answered (not applied) before this batch arrives
    assert (first.settled, first.confirmed) == ("ack", False)
    assert "expired" in first.settle_error and "not applied" in caplog.text
    assert second.lease_id == first.lease_id and second.redelivered  # the stream goes on; the batch came back
    state.expired.clear()
    third = next(batches)
    assert second.confirmed is True and third.confirmed is None
    batches.close()
    assert (third.settled, third.confirmed, third.settle_error) == ("ack", True, "")


def test_explicit_ack_without_auto_ack(client, state):
    state.add_batches(2)
    with client.batches(4, auto_ack=False) as batches:
        first = next(batches)
        first.ack()
        first.ack()  # idempotent
        second = next(batches)
    assert state.settled == [("ack", first.lease_id)]  # closing without auto_ack does not ack
    wait_for(lambda: state.streams_ended == 1, SERVER_TIMEOUT, "the server to see the stream end")
    assert state.ready[0][0] == second.lease_id and state.ready[0][2]  # back for redelivery
    with pytest.raises(FailedPreconditionError, match="delivered again"):
        second.ack()  # too late: the lease went back with the stream


def test_max_batches_and_prefetch(client, state):
    state.add_batches(5)
    got = list(client.batches(4, prefetch=3, max_batches=3))
    assert [b.td["score"][0].item() for b in got] == [0.0, 1.0, 2.0]
    assert [s for s in state.settled if s[0] == "ack"] == [("ack", b.lease_id) for b in got]
    wait_for(lambda: state.streams_ended == 1, SERVER_TIMEOUT, "the server to see the stream end")
    assert len(state.ready) == 2  # the prefetched-but-unread batches went back


def test_break_ends_the_stream_and_the_batch_is_redelivered(client, state):
    state.add_batches(1)
    for batch in client.batches(4):
        lease = batch.lease_id
        break
    del batch
    wait_for(lambda: state.streams_ended == 1, SERVER_TIMEOUT, "the server to see the stream end")
    assert state.settled == []
    with client.batches(4) as batches:
        again = next(batches)
    assert again.lease_id == lease and again.redelivered


def test_leaving_with_by_exception_does_not_ack(client, state):
    state.add_batches(1)
    with pytest.raises(ZeroDivisionError):
        with client.batches(4) as batches:
            for _ in batches:
                1 / 0
    wait_for(lambda: state.streams_ended == 1, SERVER_TIMEOUT, "the server to see the stream end")
    assert state.settled == []


@pytest.mark.parametrize("code", [c for c in CODES if c not in REOPENED], ids=lambda c: c.name)
def test_errors_mid_stream_are_typed_and_end_the_stream(client, state, code):
    state.add_batches(3)
    state.stream_error = (1, code)
    batches = client.batches(4)
    next(batches)
    with pytest.raises(CODES[code]) as info:
        next(batches)  # not a transport error: the caller's to see
    assert not isinstance(info.value, grpc.RpcError) and info.value.method == "StreamBatches"
    assert batches.closed and state.calls["StreamBatches"] == 1
    with pytest.raises(StopIteration):
        next(batches)


@pytest.mark.parametrize("code", sorted(REOPENED, key=lambda c: c.name), ids=lambda c: c.name)
def test_a_stream_broken_mid_way_is_reopened_and_unacked_batches_come_again(client, state, code, caplog):
    state.add_batches(3)
    state.stream_error = (1, code)  # every stream breaks after its first delivery
    with client.batches(4) as batches:
        first = next(batches)
        second = next(batches)  # the first stream broke: a new one, with a WARNING
        assert state.calls["StreamBatches"] == 2 and "StreamBatches broke" in caplog.text
        # Its auto-ack went down with the old stream: unconfirmed, so it came back.
        assert (first.settled, first.confirmed) == ("ack", False) and "stream broke" in first.settle_error
        assert second.lease_id == first.lease_id and second.redelivered


def test_a_stream_with_nothing_to_deliver_ends_at_its_idle_bound(client, state):
    batches = client.batches(4, idle_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match=r"no batch within 0.3 s \(idle_timeout\)"):
        next(batches)
    assert time.monotonic() - started < 30 and batches.closed
    wait_for(lambda: state.streams_ended == 1, SERVER_TIMEOUT, "the server to see the stream end")


def test_a_stream_ending_at_its_idle_bound_has_the_ack_of_the_batch_moved_past_applied_first(client, state, caplog):
    """Asking for the next batch acks the last one; if none comes within idle_timeout, the stream ends the
    clean way (half-close, the server's answers read) rather than cancelled with that ack still on its way,
    and is not reopened as if it had broken: the batch moved past is not delivered again."""
    state.add_batches(1)
    state.ack_delay = 1.0  # the server applies the ack well after the idle bound (under CLOSE_TIMEOUT_SECONDS)
    batches = client.batches(4, idle_timeout=0.3)
    first = next(batches)
    with pytest.raises(DeadlineExceededError, match=r"no batch within 0.3 s \(idle_timeout\)"):
        next(batches)
    assert batches.closed and (first.settled, first.confirmed) == ("ack", True)
    assert state.settled == [("ack", first.lease_id)] and not state.ready  # done with, for good
    assert state.calls["StreamBatches"] == 1 and "StreamBatches broke" not in caplog.text
    wait_for(lambda: state.streams_ended == 1, SERVER_TIMEOUT, "the server to see the stream end")


@pytest.mark.parametrize("code", list(CODES), ids=lambda c: c.name)
def test_errors_opening_a_stream_are_typed_and_only_transport_errors_retried(client, state, code):
    state.add_batches(1)
    state.fail("StreamBatches", code)
    with pytest.raises(CODES[code]):
        next(client.batches(4))
    assert state.calls["StreamBatches"] == (1 + RETRIES if code in RETRYABLE else 1)


def test_opening_a_stream_survives_a_transient_unavailable(client, state):
    state.add_batches(1)
    state.fail("StreamBatches", grpc.StatusCode.UNAVAILABLE, times=RETRIES)
    with client.batches(4) as batches:
        assert next(batches).td["score"][0].item() == 0.0
    assert state.calls["StreamBatches"] == RETRIES + 1


def test_closing_the_client_ends_open_streams(server, state):
    state.add_batches(2)
    client = connect(server.address, timeout=5)
    batches = client.batches(4)
    next(batches)
    client.close()
    client.close()  # idempotent
    wait_for(lambda: state.streams_ended == 1, SERVER_TIMEOUT, "the server to see the stream end")
    with pytest.raises(StopIteration):
        next(batches)
    with pytest.raises(RuntimeError, match="closed"):
        client.policy_version


# --- the async twin ---------------------------------------------------------------------------------------
async def test_async_client_end_to_end(server, state):
    state.version = 4
    state.add_batches(3)
    weights = state_dict()
    async with aclient(server) as client:
        assert await client.policy_version() == 4
        result = await client.push_weights(weights, chunk_bytes=1000, progress=False)
        assert result.version == 5 and state.pushes[-1]["crc32"] == expected_crc32(weights)
        assert_bit_exact(weights, state.pushes[-1]["tensors"])
        assert await client.submit_prompts(["a", {"prompt": [1, 2]}]) == [p.prompt_id for p in state.prompts[-2:]]
        assert (await client.status()).policy_version == 5
        seen = []
        async with client.batches(4, prefetch=1) as stream:
            async for batch in stream:
                seen.append(batch)
                if len(seen) == 2:
                    seen[-1].nack()
                if len(seen) == 3:
                    break
        assert [b.redelivered for b in seen] == [False, False, True]
        assert state.settled == [("ack", seen[0].lease_id), ("nack", seen[1].lease_id), ("ack", seen[2].lease_id)]


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL],
                         ids=lambda c: c.name)
async def test_async_errors_are_typed(server, state, code):
    state.add_batches(2)
    state.stream_error = (1, code)
    async with aclient(server) as client:
        stream = client.batches(4)
        await stream.__anext__()
        if code in RETRYABLE:  # reopened
            assert (await stream.__anext__()).redelivered
            await stream.close()
        else:
            with pytest.raises(CODES[code]):
                await stream.__anext__()
        state.fail("GetStatus", code)
        with pytest.raises(CODES[code]):
            await client.status()
        state.fail("PushWeights", code)
        state.push_fail_when = "commit"
        with pytest.raises(CODES[code]):
            await client.push_weights({"w": torch.ones(2)}, progress=False)


def test_every_sdk_error_is_one_family():
    assert all(issubclass(cls, RlfleetClientError) for cls in CODES.values())
    assert isinstance(Client, type) and isinstance(AsyncClient, type)


# --- a push whose call ends between its writes ----------------------------------------------------
class _EndedCall:
    """A PushWeights call whose deadline passed after the first write: grpc.aio then raises its core's
    ExecuteBatchError from done_writing() (not an RpcError), and the call's status is DEADLINE_EXCEEDED."""

    class _Error(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

        def details(self):
            return "Deadline Exceeded"

    def __init__(self, **_):
        self.writes = 0

    def add_done_callback(self, callback):
        pass

    def done(self):
        return True

    def cancel(self):
        return False

    async def write(self, request):
        self.writes += 1

    async def done_writing(self):
        from grpc._cython import cygrpc

        raise cygrpc.ExecuteBatchError("Failed execute_batch")

    def __await__(self):
        raise self._Error()
        yield  # pragma: no cover - makes this a generator


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_call_ended_between_writes_raises_its_own_status(transport):
    from rlfleet.client import DeadlineExceededError
    from rlfleet.client.channel import ChannelSettings
    from rlfleet.client.push import push_weights

    calls = []

    def factory(**kwargs):
        calls.append(_EndedCall(**kwargs))
        return calls[-1]

    with pytest.raises(DeadlineExceededError):
        asyncio.run(push_weights(factory, [("w", torch.ones(4))], version=1, mode="keep", chunk_bytes=8,
                                 progress=False, timeout=1.0, settings=ChannelSettings(), transport=transport))
    assert len(calls) == 1 and calls[0].writes >= 1


# --- drop_stale: an operator call, at the trajectory service's own address --------------------------
def test_drop_stale_sends_the_version_and_returns_what_was_dropped(client, state):
    from rlfleet.client.aio import DroppedStale

    assert client.drop_stale(5) == DroppedStale(dropped=5, group_ids=(7, 9), prompt_ids=("p7", "p9"))
    with pytest.raises(ValueError, match="below_policy_version must be >= 0"):
        client.drop_stale(-1)
    assert state.calls["DropStale"] == 1  # the bad version never left the client


@pytest.mark.parametrize("code, calls", [(grpc.StatusCode.UNAVAILABLE, 1 + RETRIES),
                                         (grpc.StatusCode.DEADLINE_EXCEEDED, 1),  # the rows may be gone: once
                                         (grpc.StatusCode.INVALID_ARGUMENT, 1)], ids=lambda c: getattr(c, "name", c))
def test_drop_stale_errors_are_typed_and_retried_on_unavailable_only(client, state, code, calls):
    state.fail("DropStale", code)
    with pytest.raises(CODES[code]) as info:
        client.drop_stale(3)
    assert info.value.method == "DropStale" and state.calls["DropStale"] == calls


async def test_drop_stale_at_an_address_without_it_says_where_to_call(server, state):
    from rlfleet.client import UnimplementedError

    state.fail("DropStale", grpc.StatusCode.UNIMPLEMENTED)  # what the collector answers: it does not forward it
    async with aclient(server) as client:
        with pytest.raises(UnimplementedError, match="connect a client to the trajectory service's own address"):
            await client.drop_stale(3)
    assert state.calls["DropStale"] == 1
