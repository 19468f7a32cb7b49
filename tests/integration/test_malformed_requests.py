"""Bytes that are not a valid request, on every RPC of a real service process: INVALID_ARGUMENT
naming the RPC (unary and streaming alike), and only after authentication."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from rlfleet.v1 import diagnostics_pb2, trajectory_pb2

TIMEOUT = 60
TOKEN = "s3cret"
# A field 1 of wire type 2 whose declared length runs past the end: no message parses it.
GARBAGE = b"\x0a\xff\xff\xff\x0f\x01"
SERVICES = [
    trajectory_pb2.DESCRIPTOR.services_by_name["TrajectoryService"],
    diagnostics_pb2.DESCRIPTOR.services_by_name["DiagnosticsService"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
]
METHODS = [(service, method) for service in SERVICES for method in service.methods]
VALID_FIRST = {  # a well-formed first message of each client stream
    "StreamBatches": trajectory_pb2.StreamBatchesRequest(open=trajectory_pb2.OpenBatchStream(batch_size=1))
    .SerializeToString(),
    "ServerReflectionInfo": reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString(),
}
OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/")


def call_raw(channel: grpc.Channel, service, method, messages: list[bytes], metadata=()):
    """Send raw bytes to ``method``; returns the responses read (raw) or raises the RpcError."""
    path = f"/{service.full_name}/{method.name}"
    kind = (("stream" if method.client_streaming else "unary") + "_"
            + ("stream" if method.server_streaming else "unary"))
    stub = getattr(channel, kind)(path, request_serializer=None, response_deserializer=None)
    request = iter(messages) if method.client_streaming else messages[0]
    result = stub(request, timeout=TIMEOUT, metadata=metadata)
    return list(result) if method.server_streaming else [result]


@pytest.fixture(scope="module")
def trajectory(tmp_path_factory):
    from rlfleet.services.launch import ServiceProcess

    proc = ServiceProcess("trajectory", ["--db-path", str(tmp_path_factory.mktemp("t") / "t.sqlite3"),
                                         "--log-format", "text"], env={"RLFLEET_TRAJECTORY_AUTH_TOKEN": TOKEN})
    proc.start(tmp_path_factory.mktemp("trajectory-proc")).wait_ready(180)
    channel = grpc.insecure_channel(proc.address)
    yield channel
    channel.close()
    proc.stop()


@pytest.mark.parametrize("service,method", METHODS, ids=[f"{s.name}.{m.name}" for s, m in METHODS])
def test_garbage_is_invalid_argument_naming_the_rpc_after_auth(trajectory, service, method):
    path = f"/{service.full_name}/{method.name}"
    auth = (("authorization", f"Bearer {TOKEN}"),)
    # A stream's first message may be fine and a later one broken: both are refused.
    sequences = [[GARBAGE]] + ([[VALID_FIRST[method.name], GARBAGE]] if method.client_streaming else [])
    for messages in sequences:
        with pytest.raises(grpc.RpcError) as err:
            call_raw(trajectory, service, method, messages, metadata=auth)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, err.value)
        assert err.value.details().startswith(f"{path}: the request is not a valid protobuf message"), err.value
    if not path.startswith(OPEN):
        with pytest.raises(grpc.RpcError) as err:  # no token: refused before its bytes are looked at
            call_raw(trajectory, service, method, [GARBAGE])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (path, err.value)


def test_health_list_names_every_registered_service_and_the_server_still_serves(trajectory):
    response = call_raw(trajectory, SERVICES[2], SERVICES[2].methods_by_name["List"],
                        [health_pb2.HealthListRequest().SerializeToString()])[0]
    statuses = health_pb2.HealthListResponse.FromString(response).statuses
    assert {name: s.status for name, s in statuses.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING, "rlfleet.v1.TrajectoryService": health_pb2.HealthCheckResponse.SERVING}
    stats = call_raw(trajectory, SERVICES[0], SERVICES[0].methods_by_name["GetStats"],
                     [trajectory_pb2.GetStatsRequest().SerializeToString()],
                     metadata=(("authorization", f"Bearer {TOKEN}"),))[0]
    assert trajectory_pb2.GetStatsResponse.FromString(stats).capacity > 0
