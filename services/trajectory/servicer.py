"""gRPC adapter of the trajectory buffer: unpack the request, call the buffer, pack the reply.

Domain errors propagate to the shared interceptor, which maps them to status codes.
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator

from rlfleet.rpc.records import to_message
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.common.server import Service
from rlfleet.services.trajectory.buffer import Command, ReaderOptions, Settlement, TrajectoryBuffer
from rlfleet.services.trajectory.samples import Summary
from rlfleet.v1 import trajectory_pb2, trajectory_pb2_grpc


class TrajectoryServicer(trajectory_pb2_grpc.TrajectoryServiceServicer):
    def __init__(self, buffer: TrajectoryBuffer, service: Service):
        self._buffer = buffer
        self._service = service
        """Only its supervision is used: once it failed, every call is refused with the reason, and an
        open batch stream ends with it."""

    async def Append(self, request: trajectory_pb2.AppendRequest, context) -> trajectory_pb2.AppendResponse:
        self._service.check_working()
        if not request.HasField("trajectories"):
            raise InvalidArgument("trajectories: missing")
        result = await self._buffer.append(request.trajectories, request.idempotency_key, list(request.group_keys),
                                           list(request.filtered_groups),
                                           request.committed_version if request.HasField("committed_version") else None,
                                           list(request.trace_contexts))
        return trajectory_pb2.AppendResponse(appended=result.appended, buffered=result.buffered,
                                             duplicate_groups=result.duplicate_groups,
                                             filtered_groups=result.filtered_groups)

    async def StreamBatches(self, request_iterator, context) -> AsyncIterator[trajectory_pb2.StreamBatchesResponse]:
        self._service.check_working()
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
        async for message in self._service.while_working(self._buffer.stream(options, _commands(requests))):
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
        self._service.check_working()
        stats = await self._buffer.stats()
        return to_message(stats, trajectory_pb2.GetStatsResponse)

    async def DropStale(self, request: trajectory_pb2.DropStaleRequest,
                        context) -> trajectory_pb2.DropStaleResponse:
        self._service.check_working()
        dropped = await self._buffer.drop_stale(request.below_policy_version)
        return to_message(dropped, trajectory_pb2.DropStaleResponse)


    async def GetVersionStats(self, request: trajectory_pb2.GetVersionStatsRequest,
                              context) -> trajectory_pb2.GetVersionStatsResponse:
        self._service.check_working()
        found = await self._buffer.read_samples(lambda log: log.version_stats(request.min_version, request.limit))
        return trajectory_pb2.GetVersionStatsResponse(
            versions=[trajectory_pb2.VersionStats(**dataclasses.asdict(stats)) for stats in found])

    async def ListSamples(self, request: trajectory_pb2.ListSamplesRequest,
                          context) -> trajectory_pb2.ListSamplesResponse:
        self._service.check_working()
        if request.filter not in _FILTERS:
            raise InvalidArgument(f"filter: {request.filter} is not a SampleFilter value")
        filtered = _FILTERS[request.filter]
        page = await self._buffer.read_samples(lambda log: log.list(
            min_version=request.min_version,
            max_version=request.max_version if request.HasField("max_version") else None,
            min_score=request.min_score if request.HasField("min_score") else None,
            max_score=request.max_score if request.HasField("max_score") else None,
            filtered=filtered, limit=request.limit, before_cursor=request.before_cursor))
        return trajectory_pb2.ListSamplesResponse(samples=[_summary(s) for s in page.samples],
                                                  next_cursor=page.next_cursor, logged=page.logged,
                                                  matching=page.matching)

    async def GetSample(self, request: trajectory_pb2.GetSampleRequest, context) -> trajectory_pb2.GetSampleResponse:
        self._service.check_working()
        summary, trajectory = await self._buffer.read_samples(lambda log: log.get(request.cursor))
        return trajectory_pb2.GetSampleResponse(summary=_summary(summary), trajectory=trajectory)


_FILTERS = {trajectory_pb2.SAMPLE_FILTER_UNSPECIFIED: None, trajectory_pb2.SAMPLE_FILTER_DELIVERED: False,
            trajectory_pb2.SAMPLE_FILTER_FILTERED: True}
"""SampleFilter -> the log's ``filtered`` argument (None: both)."""


def _summary(summary: Summary) -> trajectory_pb2.SampleSummary:
    return trajectory_pb2.SampleSummary(**dataclasses.asdict(summary))


async def _commands(requests: AsyncIterator[trajectory_pb2.StreamBatchesRequest]) -> AsyncIterator[Command]:
    async for request in requests:
        kind = request.WhichOneof("kind")
        if kind == "ack":
            yield "ack", request.ack.lease_id
        elif kind == "nack":
            yield "nack", request.nack.lease_id
        else:
            raise InvalidArgument(f"{kind or 'kind'}: after `open` a stream only carries `ack` and `nack`")
