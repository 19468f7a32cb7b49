"""Collector gRPC adapters: CollectorService, and TrajectoryService forwarded to the trajectory service."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from rlfleet.client.errors import from_rpc_error
from rlfleet.services.collector import prompt_item
from rlfleet.services.collector.mismatch import LagMismatch
from rlfleet.services.common import metrics
from rlfleet.services.common.errors import Aborted, InvalidArgument, UpstreamError
from rlfleet.v1 import collector_pb2, collector_pb2_grpc, trajectory_pb2, trajectory_pb2_grpc
from rlfleet.wire import decode_tensor


log = logging.getLogger("rlfleet.collector")
MAX_PASS_RATE_KEYS = 1000
_CORE_WRITE_FAILURE = "Internal error from Core"
"""What grpc.aio reports for a call whose write raced its end, instead of the status it ended with."""


class CollectorServicer(collector_pb2_grpc.CollectorServiceServicer):
    """Unpacks requests, calls the collector's domain objects, packs replies."""

    def __init__(self, collector):
        self.collector = collector

    async def PushWeights(self, request_iterator, context):
        self.collector.check_serving()
        self.collector.mismatch.check()

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
        collector = self.collector
        collector.check_submitting()
        config = collector.config
        items = [prompt_item.from_spec(spec, f"prompts[{i}]", max_prompt_bytes=config.max_prompt_bytes,
                                       sampling_defaults=config.sampling, group_size=config.group_size)
                 for i, spec in enumerate(request.prompts)]
        return collector_pb2.SubmitPromptsResponse(prompt_ids=await collector.submit(items))

    async def GetStatus(self, request, context):
        return self.collector.status()

    async def ReportMismatch(self, request, context):
        self.collector.check_working()
        lags = [LagMismatch(lag=m.lag, kl_k3=m.kl_k3, kl_k1=m.kl_k1, ess_token=m.ess_token, tokens=m.tokens)
                for m in request.lags]
        await self.collector.report_mismatch(request.policy_version, lags)
        return collector_pb2.ReportMismatchResponse(status=self.collector.mismatch_status())

    async def CloseMismatchBreaker(self, request, context):
        return collector_pb2.CloseMismatchBreakerResponse(was_open=await self.collector.close_mismatch_breaker())

    async def GetPassRates(self, request, context):
        if len(request.prompt_keys) > MAX_PASS_RATE_KEYS or request.limit < 0:
            raise InvalidArgument(f"prompt_keys and limit: at most {MAX_PASS_RATE_KEYS} keys and a limit >= 0, got "
                                  f"{len(request.prompt_keys)} keys and limit {request.limit}")
        rates, total = await self.collector.ledger.pass_rates(list(request.prompt_keys), request.after_key,
                                                              min(request.limit or 100, MAX_PASS_RATE_KEYS))
        return collector_pb2.GetPassRatesResponse(
            total=total, pass_rates=[collector_pb2.PassRate(**dataclasses.asdict(rate)) for rate in rates])

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
        collector.check_trainer_call()
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
                if message.WhichOneof("kind") in ("ack", "nack"):
                    waiting.settle()
                if message.WhichOneof("kind") == "open" and collector.gate.sync:
                    message.open.min_policy_version = max(message.open.min_policy_version, collector.gate.version)
                    # On-policy: a batch is leased (and checked below) only after the trainer is done
                    # with the last, i.e. after its push; one read ahead could go stale at that push.
                    message.open.prefetch = 1
                if not await write(message, index):
                    return
                index += 1
            async with write_lock:
                await upstream.done_writing()

        waiting = TrainerWait()
        pumping = asyncio.create_task(pump())
        failing = asyncio.ensure_future(collector.failed.wait())
        own_acks: set[str] = set()  # lease ids this proxy acked (stale batches)
        try:
            while True:
                reading = asyncio.ensure_future(upstream.read())
                if not pumping.done():
                    await asyncio.wait({reading, pumping, failing}, return_when=asyncio.FIRST_COMPLETED)
                # Checked whether or not it was awaited just now: the trainer's bad message may have come
                # while a batch was being yielded, and the upstream would then keep the stream open.
                refused = pumping.done() and not pumping.cancelled() and pumping.exception()
                if refused and not isinstance(refused, grpc.RpcError):  # (the upstream's own end: read below)
                    reading.cancel()
                    raise refused  # the trainer's message was bad (RlfleetError), or a bug of ours
                if not reading.done():
                    await asyncio.wait({reading, failing}, return_when=asyncio.FIRST_COMPLETED)
                if failing.done():  # the collector failed: the trainer must hear why, not wait forever
                    reading.cancel()
                    collector.check_working()
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
                elif self._stale(response):
                    # Stale (a push landed after it was appended): delete it, generate its prompts again.
                    # (Regenerated first: a crash in between leaves the batch buffered, not the prompts lost.)
                    entry = response.batch.entries.get("prompt_id")
                    prompt_ids = list(dict.fromkeys(entry.strings.values)) if entry is not None else []
                    await collector.regenerate(prompt_ids, response.batch.batch_size[0], "stale batch at the proxy")
                    own_acks.add(response.lease_id)
                    await write(trajectory_pb2.StreamBatchesRequest(ack=trajectory_pb2.AckBatch(
                        lease_id=response.lease_id)))
                    continue
                if response.HasField("batch"):
                    waiting.deliver()
                yield response
        finally:
            waiting.end()
            pumping.cancel()
            failing.cancel()
            upstream.cancel()

    def _stale(self, response) -> bool:
        if not self.collector.gate.sync:
            return False
        entry = response.batch.entries.get("policy_version_start")
        if entry is None or not entry.HasField("tensor"):
            return False
        versions = decode_tensor(entry.tensor)
        return versions.numel() > 0 and self.collector.gate.stale_at_read(int(versions.min()))

    async def GetStats(self, request, context):
        try:
            return await self.collector.trajectory.GetStats(request, metadata=self.collector.settings.metadata(),
                                                            timeout=30)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, "GetStats")
            raise UpstreamError(error.code, error.details) from None

    async def Append(self, request, context):
        raise InvalidArgument("Append is not forwarded by the collector; collectors append to the trajectory service")


class TrainerWait:
    """Counts the seconds a trainer's batch stream holds no unsettled batch (everything it was given is
    acked or nacked: it is not training) until the next batch comes: time the trainer idles for want of
    rollouts (``rlfleet_trainer_wait_seconds_total``; an autoscaler adds replicas while it grows)."""

    def __init__(self) -> None:
        self.delivered = self.settled = 0
        self.since: float | None = time.monotonic()  # the first batch is awaited from the open

    def settle(self) -> None:
        self.settled += 1
        if self.settled >= self.delivered and self.since is None:
            self.since = time.monotonic()

    def deliver(self) -> None:
        self.end()
        self.delivered += 1

    def end(self) -> None:
        if self.since is not None:
            metrics.TRAINER_WAIT_SECONDS.inc(time.monotonic() - self.since)
            self.since = None
