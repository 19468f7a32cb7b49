"""The shared scaffolding as a real process: health, errors, auth, clean SIGTERM."""

import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from rlfleet.v1 import diagnostics_pb2, diagnostics_pb2_grpc
from rlfleet.wire import Ragged, decode_tensordict, encode_tensordict, get_ragged


def echo_stub(address: str, metadata=None):
    channel = grpc.insecure_channel(address)
    return diagnostics_pb2_grpc.DiagnosticsServiceStub(channel), channel


def test_health_echo_invalid_argument_and_clean_sigterm(start_service):
    proc = start_service("echo", "--startup-delay-seconds", "2", "--log-format", "text")
    proc.wait_listening(60)
    # Listening but still "loading": NOT_SERVING.
    assert proc.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    proc.wait_ready(60)
    assert proc.health() == health_pb2.HealthCheckResponse.SERVING

    stub, channel = echo_stub(proc.address)
    payload = encode_tensordict(
        {"tokens": Ragged.from_list([torch.arange(3), torch.arange(5)]), "score": torch.tensor([0.5, -1.0])},
        batch_size=[2],
    )
    reply = stub.Echo(diagnostics_pb2.EchoRequest(payload=payload), timeout=10)
    td = decode_tensordict(reply.payload)
    assert get_ragged(td, "tokens").lengths.tolist() == [3, 5]
    assert td["score"].tolist() == [0.5, -1.0]

    bad = diagnostics_pb2.EchoRequest(payload=payload)
    bad.payload.entries["score"].tensor.data = b"\x00" * 7
    with pytest.raises(grpc.RpcError) as err:
        stub.Echo(bad, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "payload.entries[score].tensor.data" in err.value.details()

    # Still serving after the bad request.
    assert stub.Echo(diagnostics_pb2.EchoRequest(payload=payload), timeout=10).decoded_bytes > 0
    channel.close()

    started = time.monotonic()
    assert proc.stop(timeout=20) == 0
    assert time.monotonic() - started < 15
    assert "stopped" in proc.log_tail()


def test_auth_token_is_enforced_but_health_stays_open(start_service):
    proc = start_service("echo", env={"RLFLEET_ECHO_AUTH_TOKEN": "s3cret"}).wait_ready(60)
    assert proc.health() == health_pb2.HealthCheckResponse.SERVING
    stub, channel = echo_stub(proc.address)
    request = diagnostics_pb2.EchoRequest(payload=encode_tensordict({"x": torch.ones(1)}, batch_size=[1]))
    with pytest.raises(grpc.RpcError) as err:
        stub.Echo(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        stub.Echo(request, timeout=10, metadata=[("authorization", "Bearer wrong")])
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reply = stub.Echo(request, timeout=10, metadata=[("authorization", "Bearer s3cret")])
    assert decode_tensordict(reply.payload)["x"].tolist() == [1.0]
    channel.close()


def test_oversized_message_is_resource_exhausted(start_service):
    proc = start_service("echo", "--max-message-bytes", str(1 << 20)).wait_ready(60)
    stub, channel = echo_stub(proc.address)
    big = encode_tensordict({"x": torch.zeros(1, 2 << 20, dtype=torch.uint8)}, batch_size=[1])
    with pytest.raises(grpc.RpcError) as err:
        stub.Echo(diagnostics_pb2.EchoRequest(payload=big), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    channel.close()
