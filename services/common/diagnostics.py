"""DiagnosticsService: served by every rlfleet server (codec checks and benchmarks)."""

from __future__ import annotations

from rlfleet.v1 import diagnostics_pb2, diagnostics_pb2_grpc
from rlfleet.wire import decode_tensordict, encode_tensordict


class DiagnosticsServicer(diagnostics_pb2_grpc.DiagnosticsServiceServicer):
    async def Echo(self, request, context):
        payload = decode_tensordict(request.payload, "payload")
        decoded = sum(v.numel() * v.element_size() for v in payload.values(True, True)
                      if hasattr(v, "element_size") and not v.is_nested)
        return diagnostics_pb2.EchoResponse(payload=encode_tensordict(payload), decoded_bytes=decoded)
