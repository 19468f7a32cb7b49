"""Collector gRPC adapters: CollectorService, and TrajectoryService forwarded to the trajectory service."""

from __future__ import annotations

import asyncio

import grpc
import torch

from rlfleet.client.errors import from_rpc_error
from rlfleet.services.collector.prompts import PromptItem
from rlfleet.services.common.errors import InvalidArgument, RlfleetError, UpstreamError
from rlfleet.v1 import collector_pb2, collector_pb2_grpc, trajectory_pb2, trajectory_pb2_grpc
from rlfleet.wire import decode_tensor


def prompt_item(spec: collector_pb2.PromptSpec, index: int) -> PromptItem:
    item = PromptItem(prompt_id=spec.prompt_id, ground_truth=spec.ground_truth, reward_fn=spec.reward_fn,
                      reward_args=dict(spec.reward_args))
    kind = spec.prompt.WhichOneof("kind")
    if kind == "text":
        item.text = spec.prompt.text
    elif kind == "chat":
        item.chat = [{"role": m.role, "content": m.content} for m in spec.prompt.chat.messages]
    elif kind == "token_ids":
        ids = decode_tensor(spec.prompt.token_ids, f"prompts[{index}].prompt.token_ids")
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32) or ids.numel() == 0:
            raise InvalidArgument(f"prompts[{index}].prompt.token_ids must be a non-empty 1-D integer tensor")
        item.token_ids = ids.tolist()
    else:
        raise InvalidArgument(f"prompts[{index}].prompt is empty: set text, chat or token_ids")
    if spec.HasField("sampling"):
        item.sampling = {f.name: v for f, v in spec.sampling.ListFields()}
    return item


class CollectorServicer(collector_pb2_grpc.CollectorServiceServicer):
    def __init__(self, collector):
        self.collector = collector

    async def PushWeights(self, request_iterator, context):
        async def messages():
            async for request in request_iterator:
                kind = request.WhichOneof("payload")
                if kind is None:
                    raise InvalidArgument("empty PushWeightsRequest: set manifest or chunk")
                yield kind, getattr(request, kind)

        outcome = await self.collector.fanout.push(messages())
        return collector_pb2.PushWeightsResponse(
            version=outcome.version, received_bytes=outcome.received_bytes, seconds=outcome.seconds,
            replicas=[collector_pb2.ReplicaPushResult(address=r.address, applied=r.applied, error=r.error,
                                                      transport=r.transport, stage_seconds=r.stage_seconds,
                                                      apply_seconds=r.apply_seconds)
                      for r in outcome.replicas])

    async def GetPolicyVersion(self, request, context):
        return collector_pb2.GetPolicyVersionResponse(version=self.collector.gate.version)

    async def SubmitPrompts(self, request, context):
        items = [prompt_item(spec, i) for i, spec in enumerate(request.prompts)]
        return collector_pb2.SubmitPromptsResponse(prompt_ids=self.collector.source.submit(items))

    async def GetStatus(self, request, context):
        return self.collector.status()


class TrajectoryProxyServicer(trajectory_pb2_grpc.TrajectoryServiceServicer):
    """Forwards a trainer's batch stream so it needs only the collector's address.

    In sync mode the stream opens at the current version, and a batch holding a
    trajectory older than the latest push is acked upstream and dropped (counted);
    the answer to that ack is the proxy's own and is not forwarded."""

    def __init__(self, collector):
        self.collector = collector

    async def StreamBatches(self, request_iterator, context):
        collector = self.collector
        upstream = collector.trajectory.StreamBatches(metadata=collector.settings.metadata())
        write_lock = asyncio.Lock()

        async def write(message):
            async with write_lock:
                await upstream.write(message)

        async def pump():
            async for message in request_iterator:
                if message.WhichOneof("kind") == "open" and collector.config.mode == "sync":
                    message.open.min_policy_version = max(message.open.min_policy_version, collector.gate.version)
                await write(message)
            async with write_lock:
                await upstream.done_writing()

        pumping = asyncio.create_task(pump())
        own_acks: set[str] = set()  # lease ids this proxy acked (stale batches)
        try:
            while True:
                reading = asyncio.ensure_future(upstream.read())
                if not pumping.done():
                    await asyncio.wait({reading, pumping}, return_when=asyncio.FIRST_COMPLETED)
                    refused = pumping.done() and not pumping.cancelled() and pumping.exception()
                    if isinstance(refused, RlfleetError):  # the trainer's message was bad: say so now
                        reading.cancel()
                        raise refused
                try:
                    response = await reading
                except grpc.RpcError as exc:
                    error = from_rpc_error(exc, "StreamBatches")
                    raise UpstreamError(error.code, error.details) from None
                if response is grpc.aio.EOF:
                    break
                if response.HasField("settled"):
                    if response.settled.lease_id in own_acks:
                        own_acks.discard(response.settled.lease_id)
                        continue
                elif collector.config.mode == "sync" and self._stale(response):
                    own_acks.add(response.lease_id)
                    await write(trajectory_pb2.StreamBatchesRequest(ack=trajectory_pb2.AckBatch(
                        lease_id=response.lease_id)))
                    collector.pipeline.discarded_samples += response.batch.batch_size[0]
                    continue
                yield response
        finally:
            pumping.cancel()
            upstream.cancel()

    def _stale(self, response) -> bool:
        entry = response.batch.entries.get("policy_version_start")
        if entry is None or not entry.HasField("tensor"):
            return False
        versions = decode_tensor(entry.tensor)
        return versions.numel() > 0 and int(versions.min()) < self.collector.gate.version

    async def GetStats(self, request, context):
        try:
            return await self.collector.trajectory.GetStats(request, metadata=self.collector.settings.metadata(),
                                                            timeout=30)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, "GetStats")
            raise UpstreamError(error.code, error.details) from None

    async def Append(self, request, context):
        raise InvalidArgument("Append is not forwarded by the collector; collectors append to the trajectory service")
