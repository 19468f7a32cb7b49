"""gRPC adapter of the trajectory buffer: unpack the request, call the buffer, pack the reply.

Domain errors propagate to the shared interceptor, which maps them to status codes.
"""

from __future__ import annotations

from typing import AsyncIterator

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.trajectory.buffer import Command, ReaderOptions, Settlement, TrajectoryBuffer
from rlfleet.v1 import trajectory_pb2, trajectory_pb2_grpc


class TrajectoryServicer(trajectory_pb2_grpc.TrajectoryServiceServicer):
    def __init__(self, buffer: TrajectoryBuffer):
        self._buffer = buffer

    async def Append(self, request: trajectory_pb2.AppendRequest, context) -> trajectory_pb2.AppendResponse:
        if not request.HasField("trajectories"):
            raise InvalidArgument("trajectories: missing")
        result = await self._buffer.append(request.trajectories, request.idempotency_key, list(request.group_keys),
                                           list(request.filtered_groups))
        return trajectory_pb2.AppendResponse(appended=result.appended, buffered=result.buffered,
                                             duplicate_groups=result.duplicate_groups,
                                             filtered_groups=result.filtered_groups)

    async def StreamBatches(self, request_iterator, context) -> AsyncIterator[trajectory_pb2.StreamBatchesResponse]:
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidArgument("open: the first StreamBatches message must be `open`")
        opened = first.open
        options = ReaderOptions(
            batch_size=opened.batch_size, whole_groups=opened.whole_groups,
            min_policy_version=opened.min_policy_version, lease_seconds=opened.lease_seconds,
            prefetch=opened.prefetch, consumer=opened.consumer or context.peer(),
        )
        async for message in self._buffer.stream(options, _commands(requests)):
            if isinstance(message, Settlement):
                yield trajectory_pb2.StreamBatchesResponse(settled=trajectory_pb2.Settled(
                    lease_id=message.lease_id, nack=message.nack, applied=message.applied,
                    trajectories=message.trajectories, reason=message.reason))
            else:
                yield trajectory_pb2.StreamBatchesResponse(
                    lease_id=message.lease_id, batch=message.batch,
                    lease_expires_at=message.expires_at, redelivered=message.redelivered,
                )

    async def GetStats(self, request: trajectory_pb2.GetStatsRequest, context) -> trajectory_pb2.GetStatsResponse:
        stats = await self._buffer.stats()
        return trajectory_pb2.GetStatsResponse(
            ready=stats.ready, leased=stats.leased, acked=stats.acked, capacity=stats.capacity,
            appended=stats.appended, redelivered_batches=stats.redelivered_batches,
            dropped_stale=stats.dropped_stale, buffered_bytes=stats.buffered_bytes,
            capacity_bytes=stats.capacity_bytes, filtered_groups=stats.filtered_groups,
            filtered_trajectories=stats.filtered_trajectories,
        )

    async def DropStale(self, request: trajectory_pb2.DropStaleRequest,
                        context) -> trajectory_pb2.DropStaleResponse:
        dropped = await self._buffer.drop_stale(request.below_policy_version)
        return trajectory_pb2.DropStaleResponse(dropped=dropped.trajectories, group_ids=dropped.group_ids,
                                                prompt_ids=dropped.prompt_ids)


async def _commands(requests: AsyncIterator[trajectory_pb2.StreamBatchesRequest]) -> AsyncIterator[Command]:
    async for request in requests:
        kind = request.WhichOneof("kind")
        if kind == "ack":
            yield "ack", request.ack.lease_id
        elif kind == "nack":
            yield "nack", request.nack.lease_id
        else:
            raise InvalidArgument(f"{kind or 'kind'}: after `open` a stream only carries `ack` and `nack`")
