"""A trainer's weight push through a collector's address, as the integration tests make it."""

from __future__ import annotations

from rlfleet.v1 import collector_pb2, collector_pb2_grpc, weights_pb2
from rlfleet.wire.push_messages import iter_push_messages


def push(channel, state, mode=weights_pb2.UPDATE_MODE_KEEP):
    """Push ``state`` (name -> tensor) whole; returns the PushWeights answer."""
    stub = collector_pb2_grpc.CollectorServiceStub(channel)
    requests = (collector_pb2.PushWeightsRequest(**{kind: msg})
                for kind, msg in iter_push_messages(list(state.items()), version=0, mode=mode))
    return stub.PushWeights(requests, timeout=600)
