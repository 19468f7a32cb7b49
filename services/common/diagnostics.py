"""DiagnosticsService: served by every rlfleet server (codec checks and benchmarks)."""

from __future__ import annotations

import asyncio

from rlfleet.v1 import diagnostics_pb2, diagnostics_pb2_grpc

ECHO_CONCURRENCY = 2
"""Echo calls validated at once; more wait their turn (each holds one copy of its payload meanwhile)."""


class DiagnosticsServicer(diagnostics_pb2_grpc.DiagnosticsServiceServicer):
    def __init__(self, concurrency: int = ECHO_CONCURRENCY):
        self._slots = asyncio.Semaphore(concurrency)

    async def Echo(self, request, context):
        # Validated as a real request would be, but nothing is built (decoding a string list
        # builds an object per string: ~220 bytes of memory per request byte) and the payload
        # goes back as received rather than re-encoded. Off the event loop: a payload of
        # millions of tiny entries takes seconds to walk.
        from rlfleet.wire.tensordict import check_tensordict  # tensordict: loaded by the first Echo, not at start

        async with self._slots:
            decoded = await asyncio.to_thread(check_tensordict, request.payload, "payload")
            return diagnostics_pb2.EchoResponse(payload=request.payload, decoded_bytes=decoded)
