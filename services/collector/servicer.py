"""Collector gRPC adapters: CollectorService, and TrajectoryService forwarded to the trajectory service."""

from __future__ import annotations

import asyncio
import logging
import math
import re

import grpc
import torch

from rlfleet.client.channel import call_with_retry
from rlfleet.client.errors import RlfleetClientError, from_rpc_error
from rlfleet.services.collector.prompts import PromptItem
from rlfleet.services.generation import sampling as generation_sampling
from rlfleet.services.common.errors import Aborted, InvalidArgument, Unavailable, UpstreamError
from rlfleet.v1 import (collector_pb2, collector_pb2_grpc, reward_pb2, sampling_pb2, trajectory_pb2,
                        trajectory_pb2_grpc)
from rlfleet.wire import decode_tensor


MAX_PROMPT_ID_BYTES = 256
log = logging.getLogger("rlfleet.collector")
_SAMPLE = re.compile(r"sample (\d+): ")
_ROLES = ("system", "user", "assistant", "tool")
_CORE_WRITE_FAILURE = "Internal error from Core"
"""What grpc.aio reports for a call whose write raced its end, instead of the status it ended with."""


def prompt_item(spec: collector_pb2.PromptSpec, index: int, max_prompt_bytes: int = 1 << 20) -> PromptItem:
    """A submitted prompt, validated (INVALID_ARGUMENT naming ``prompts[index]`` and the field)."""
    where = f"prompts[{index}]"
    if len(spec.prompt_id.encode()) > MAX_PROMPT_ID_BYTES:
        raise InvalidArgument(f"{where}.prompt_id: longer than {MAX_PROMPT_ID_BYTES} bytes")
    size = spec.ByteSize() - (spec.sampling.ByteSize() if spec.HasField("sampling") else 0)
    if size > max_prompt_bytes:
        raise InvalidArgument(f"{where}: {size} bytes of prompt, ground truth and reward args exceed the "
                              f"collector's max_prompt_bytes ({max_prompt_bytes})")
    item = PromptItem(prompt_id=spec.prompt_id, ground_truth=spec.ground_truth, reward_fn=spec.reward_fn,
                      reward_args=dict(spec.reward_args))
    kind = spec.prompt.WhichOneof("kind")
    if kind == "text":
        item.text = spec.prompt.text
    elif kind == "chat":
        if not spec.prompt.chat.messages:
            raise InvalidArgument(f"{where}.prompt.chat.messages: empty")
        for i, message in enumerate(spec.prompt.chat.messages):
            if message.role not in _ROLES:
                raise InvalidArgument(f"{where}.prompt.chat.messages[{i}].role: {message.role!r} is not one of "
                                      f"{', '.join(_ROLES)}")
        item.chat = [{"role": m.role, "content": m.content} for m in spec.prompt.chat.messages]
    elif kind == "token_ids":
        ids = decode_tensor(spec.prompt.token_ids, f"prompts[{index}].prompt.token_ids")
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32) or ids.numel() == 0:
            raise InvalidArgument(f"prompts[{index}].prompt.token_ids must be a non-empty 1-D integer tensor")
        item.token_ids = ids.tolist()
    else:
        raise InvalidArgument(f"prompts[{index}].prompt is empty: set text, chat or token_ids")
    if spec.HasField("sampling"):
        check_sampling(spec.sampling, f"{where}.sampling")
        item.sampling = {f.name: v for f, v in spec.sampling.ListFields() if f.name != "n"}
    return item


def check_sampling(sampling: sampling_pb2.SamplingParams, where: str) -> None:
    """Bounds a replica would refuse later, refused at submission instead (0 / empty = not overridden)."""
    # (Compared with float32's rounding: 0.01 arrives as 0.0099999998. NaN fails both bounds.)
    if sampling.temperature and not generation_sampling.MIN_TEMPERATURE - 1e-6 <= sampling.temperature <= \
            generation_sampling.MAX_TEMPERATURE:
        raise InvalidArgument(f"{where}.temperature: must be in [{generation_sampling.MIN_TEMPERATURE}, "
                              f"{generation_sampling.MAX_TEMPERATURE}] (0: not overridden), got {sampling.temperature}")
    try:
        generation_sampling.check_stop_counts(len(sampling.stop), len(sampling.stop_token_ids))
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    if not math.isfinite(sampling.top_p) or not 0 <= sampling.top_p <= 1:
        raise InvalidArgument(f"{where}.top_p: must be in (0, 1] (0: not overridden), got {sampling.top_p}")
    for name in ("top_k", "max_tokens", "min_tokens"):
        if getattr(sampling, name) < 0:
            raise InvalidArgument(f"{where}.{name}: must be >= 0, got {getattr(sampling, name)}")
    if sampling.max_tokens and sampling.min_tokens > sampling.max_tokens:
        raise InvalidArgument(f"{where}.min_tokens: {sampling.min_tokens} exceeds max_tokens {sampling.max_tokens}")
    if any(token < 0 for token in sampling.stop_token_ids):
        raise InvalidArgument(f"{where}.stop_token_ids: token ids must be >= 0")
    if any(not stop for stop in sampling.stop):
        raise InvalidArgument(f"{where}.stop: empty stop string")


class CollectorServicer(collector_pb2_grpc.CollectorServiceServicer):
    def __init__(self, collector):
        self.collector = collector

    async def PushWeights(self, request_iterator, context):
        self.collector.check_serving()

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
        self.collector.check_serving()
        return collector_pb2.GetPolicyVersionResponse(version=self.collector.gate.version)

    async def SubmitPrompts(self, request, context):
        if not self.collector.source.restored:
            raise Unavailable("the collector is starting: its prompt ledger is not read yet")
        max_bytes = self.collector.config.max_prompt_bytes
        items = [prompt_item(spec, i, max_bytes) for i, spec in enumerate(request.prompts)]
        await self._check_tasks(items)
        return collector_pb2.SubmitPromptsResponse(prompt_ids=await self.collector.source.submit(items))

    async def _check_tasks(self, items: list[PromptItem]) -> None:
        """Ask the reward service whether it has each prompt's reward function and takes its arguments:
        a prompt it would refuse is refused now (NOT_FOUND / INVALID_ARGUMENT naming the prompt).
        While the reward service is down the prompts are taken unchecked (a WARNING): taking them
        durably matters more, and the reward stage still dead-letters what it refuses."""
        collector = self.collector
        if "reward" in collector.outages:
            log.warning("reward service down: %d prompts taken without checking their reward functions",
                        len(items))
            return
        first: dict[tuple, int] = {}  # distinct task -> the first prompt carrying it
        for index, item in enumerate(items):
            key = (item.reward_fn or collector.config.reward_fn, item.ground_truth, tuple(sorted(item.reward_args.items())))
            first.setdefault(key, index)
        tasks = [reward_pb2.Task(reward_fn=fn, ground_truth=truth, args=dict(args)) for fn, truth, args in first]
        try:
            await call_with_retry(collector.pipeline.reward.CheckTasks, reward_pb2.CheckTasksRequest(tasks=tasks),
                                  method="CheckTasks", settings=collector.settings, timeout=30)
        except RlfleetClientError as error:
            if error.code not in ("INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED"):
                log.warning("reward service unreachable (%s): %d prompts taken without checking their reward "
                            "functions", error.code, len(items))
                return
            match = _SAMPLE.match(error.details)
            where = f"prompts[{list(first.values())[int(match.group(1))]}]" if match else "prompts"
            details = error.details[match.end():] if match else error.details
            raise UpstreamError(error.code, f"{where}: {details}") from None

    async def GetStatus(self, request, context):
        return self.collector.status()

    async def ListFailures(self, request, context):
        if request.after_seq < 0 or request.limit < 0:
            raise InvalidArgument(f"after_seq and limit: must be >= 0, got {request.after_seq} and {request.limit}")
        limit = min(request.limit or 100, 1000)
        failures, total = await self.collector.ledger.failures(request.after_seq, limit)
        return collector_pb2.ListFailuresResponse(total=total, failures=[
            collector_pb2.PromptFailure(seq=f.seq, prompt_id=f.prompt_id, stage=f.stage, code=f.code, error=f.error,
                                        attempts=f.attempts, failed_at=f.failed_at) for f in failures])


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
        # A write racing the upstream's end (it refused an earlier message) fails, and grpc's aio client
        # then reports the call as INTERNAL "Internal error from Core": the upstream's status is lost.
        lost_status: list[int] = []  # the trainer's message the upstream ended the stream before

        async def write(message, index: int | None = None) -> bool:
            async with write_lock:
                try:
                    await upstream.write(message)
                    return True
                except asyncio.InvalidStateError:  # it ended before: its status is kept, read below
                    return False
                except grpc.aio.AioRpcError:
                    if index is not None:
                        lost_status.append(index)
                    return False

        async def pump():
            index = 0
            async for message in request_iterator:
                if message.WhichOneof("kind") == "open" and collector.config.mode == "sync":
                    message.open.min_policy_version = max(message.open.min_policy_version, collector.gate.version)
                if not await write(message, index):
                    return
                index += 1
            async with write_lock:
                await upstream.done_writing()

        pumping = asyncio.create_task(pump())
        own_acks: set[str] = set()  # lease ids this proxy acked (stale batches)
        try:
            while True:
                reading = asyncio.ensure_future(upstream.read())
                if not pumping.done():
                    await asyncio.wait({reading, pumping}, return_when=asyncio.FIRST_COMPLETED)
                # Checked whether or not it was awaited just now: the trainer's bad message may have come
                # while a batch was being yielded, and the upstream would then keep the stream open.
                refused = pumping.done() and not pumping.cancelled() and pumping.exception()
                if refused and not isinstance(refused, grpc.RpcError):  # (the upstream's own end: read below)
                    reading.cancel()
                    raise refused  # the trainer's message was bad (RlfleetError), or a bug of ours
                try:
                    response = await reading
                except grpc.RpcError as exc:
                    # Only INTERNAL "Internal error from Core" is a lost status. Any other code is the upstream's
                    # own: UNAVAILABLE (the trajectory service is down or restarting) must reach the trainer as
                    # such, for the SDK to reopen the stream; a write to an unreachable upstream fails, too.
                    if lost_status and (exc.code(), exc.details()) == (grpc.StatusCode.INTERNAL, _CORE_WRITE_FAILURE):
                        raise Aborted(f"the trajectory service ended the batch stream before message "
                                      f"{lost_status[0]} was forwarded: it refused an earlier message, for a "
                                      f"reason lost in that race (send one message at a time to see it)") from None
                    error = from_rpc_error(exc, "StreamBatches")
                    raise UpstreamError(error.code, error.details) from None
                if response is grpc.aio.EOF:
                    break
                if response.HasField("settled"):
                    if response.settled.lease_id in own_acks:
                        own_acks.discard(response.settled.lease_id)
                        continue
                elif collector.config.mode == "sync" and self._stale(response):
                    # Stale (a push landed after it was appended): delete it, generate its prompts again.
                    # (Regenerated first: a crash in between leaves the batch buffered, not the prompts lost.)
                    entry = response.batch.entries.get("prompt_id")
                    prompt_ids = list(dict.fromkeys(entry.strings.values)) if entry is not None else []
                    await collector.regenerate(prompt_ids, response.batch.batch_size[0], "stale batch at the proxy")
                    own_acks.add(response.lease_id)
                    await write(trajectory_pb2.StreamBatchesRequest(ack=trajectory_pb2.AckBatch(
                        lease_id=response.lease_id)))
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
