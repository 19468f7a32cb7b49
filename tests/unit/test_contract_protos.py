"""protos/ alone is the contract: the vendored standard health proto is the one the services serve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_vendored_health_proto_matches_the_served_health_service(tmp_path):
    out = tmp_path / "health.desc"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}",
                    f"--descriptor_set_out={out}", "grpc/health/v1/health.proto"], check=True)
    vendored = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    served = descriptor_pb2.FileDescriptorProto()
    health_pb2.DESCRIPTOR.CopyToProto(served)
    for message in vendored.message_type:
        _drop_json_names(message)  # protoc fills them in; the runtime's embedded descriptor does not
    assert vendored.package == served.package == "grpc.health.v1"
    # Same messages (fields, numbers, types), enums and methods: what a client's stub depends on.
    for name in ("message_type", "service"):
        assert list(getattr(vendored, name)) == list(getattr(served, name)), name


def _drop_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    for field in message.field:
        field.ClearField("json_name")
    for nested in message.nested_type:
        _drop_json_names(nested)
