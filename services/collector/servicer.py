"""Collector gRPC adapters: CollectorService, and TrajectoryService forwarded to the trajectory service."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import grpc

from rlfleet.rpc.channel import is_core_write_failure
from rlfleet.rpc.errors import from_rpc_error
from rlfleet.rpc.records import to_message
from rlfleet.services.collector import metrics
from rlfleet.services.collector.batch_stream import BatchRelay
from rlfleet.services.collector.mismatch import LagMismatch
from rlfleet.services.collector.run import check_call, check_join
from rlfleet.services.common.errors import Aborted, InvalidArgument, RlfleetError, UpstreamError
from rlfleet.services.common.weight_stream import payloads
from rlfleet.v1 import collector_pb2, collector_pb2_grpc, trajectory_pb2_grpc

if TYPE_CHECKING:
    from rlfleet.services.collector.service import CollectorService

log = logging.getLogger("rlfleet.collector")
MAX_PASS_RATE_KEYS = 1000


class CollectorServicer(collector_pb2_grpc.CollectorServiceServicer):
    """Unpacks requests, calls the collector's parts, packs replies."""

    def __init__(self, collector: CollectorService):
        self.collector = collector

    async def PushWeights(self, request_iterator, context):
        self.collector.check_serving()
        self.collector.check_trainer_call(context.invocation_metadata())

        outcome = await self.collector.fanout.push(payloads(request_iterator))
        return collector_pb2.PushWeightsResponse(
            version=outcome.version, received_bytes=outcome.received_bytes, seconds=outcome.seconds,
            replicas=[collector_pb2.ReplicaPushResult(address=r.address, applied=r.applied, error=r.error,
                                                      transport=r.transport, stage_seconds=r.stage_seconds,
                                                      apply_seconds=r.apply_seconds, sent_bytes=r.sent_bytes)
                      for r in outcome.replicas],
            sent_bytes=sum(r.sent_bytes for r in outcome.replicas))

    async def JoinRun(self, request, context):
        collector = self.collector
        collector.check_serving()  # the committed version is agreed
        check_join(collector.run, collector.gate.version, request.run_id, request.policy_version)
        return collector_pb2.JoinRunResponse(run=collector.status_view.run_info())

    async def GetPolicyVersion(self, request, context):
        self.collector.check_serving()
        return collector_pb2.GetPolicyVersionResponse(version=self.collector.gate.version)

    async def SubmitPrompts(self, request, context):
        collector = self.collector
        collector.check_submitting(context.invocation_metadata())
        items = collector.submissions.parse(request.prompts)
        return collector_pb2.SubmitPromptsResponse(prompt_ids=await collector.submissions.submit(items))

    async def GetStatus(self, request, context):
        return self.collector.status()

    async def ReportMismatch(self, request, context):
        self.collector.check_working()
        check_call(self.collector.run, context.invocation_metadata())
        lags = [LagMismatch(lag=m.lag, kl_k3=m.kl_k3, kl_k1=m.kl_k1, ess_token=m.ess_token, tokens=m.tokens)
                for m in request.lags]
        await self.collector.breaker.report(request.policy_version, lags, request.report_id)
        return collector_pb2.ReportMismatchResponse(status=self.collector.breaker.status())

    async def CloseMismatchBreaker(self, request, context):
        return collector_pb2.CloseMismatchBreakerResponse(was_open=await self.collector.breaker.close())

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
            to_message(failure, collector_pb2.PromptFailure) for failure in failures])


class TrajectoryProxyServicer(trajectory_pb2_grpc.TrajectoryServiceServicer):
    """Forwards a trainer's batch stream (``batch_stream.BatchRelay``) so it needs only the collector's address."""

    def __init__(self, collector: CollectorService):
        self.collector = collector

    async def StreamBatches(self, request_iterator, context):
        collector = self.collector
        collector.check_trainer_call(context.invocation_metadata())
        upstream = _UpstreamBatches(collector.trajectory.StreamBatches(metadata=collector.settings.metadata()))
        waiting = TrainerWait()
        try:
            # aclosing: the relay's cleanup (cancelling the upstream call) runs when this stream ends, not at GC.
            async with contextlib.aclosing(BatchRelay(upstream, collector.gate, collector.commits, collector).responses(
                    _counting_settles(request_iterator, waiting))) as responses:
                async for response in responses:
                    if response.HasField("batch"):
                        waiting.deliver()
                    yield response
        finally:
            waiting.end()

    async def GetStats(self, request, context):
        try:
            return await self.collector.trajectory.GetStats(request, metadata=self.collector.settings.metadata(),
                                                            timeout=30)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, "GetStats")
            raise UpstreamError(error.code, error.details) from None

    async def Append(self, request, context):
        raise InvalidArgument("Append is not forwarded by the collector; collectors append to the trajectory service")


async def _counting_settles(requests, waiting: TrainerWait):
    """The trainer's messages, its acks and nacks counted: a trainer that settled all it got is waiting."""
    async for message in requests:
        if message.WhichOneof("kind") in ("ack", "nack"):
            waiting.settle()
        yield message


class _UpstreamBatches:
    """The trajectory service's StreamBatches call as ``batch_stream.UpstreamStream``: its gRPC errors
    turned into the collector's."""

    def __init__(self, call):
        self._call = call
        self._writing = asyncio.Lock()  # grpc.aio takes one write at a time: the trainer's and the relay's acks
        self._unsent: int | None = None  # the trainer's message the upstream ended the stream before

    async def write(self, message, index: int | None = None) -> bool:
        async with self._writing:
            try:
                await self._call.write(message)
                return True
            except asyncio.InvalidStateError:  # it ended before: its status is kept, read below
                return False
            except grpc.RpcError:
                # A write racing the upstream's end (it refused an earlier message) fails, and grpc.aio
                # then reports the call as INTERNAL (is_core_write_failure): the upstream's status is lost.
                if index is not None and self._unsent is None:
                    self._unsent = index
                return False

    async def done_writing(self) -> None:
        async with self._writing:
            try:
                await self._call.done_writing()
            except grpc.RpcError:  # it ended meanwhile: read() raises its status
                pass

    async def read(self):
        try:
            response = await self._call.read()
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        return None if response is grpc.aio.EOF else response

    def _error(self, exc: grpc.RpcError) -> RlfleetError:
        # Only grpc.aio's write-race INTERNAL is a lost status. Any other code is the upstream's own:
        # UNAVAILABLE (the trajectory service is down or restarting) must reach the trainer as such, for
        # the SDK to reopen the stream; a write to an unreachable upstream fails, too.
        if self._unsent is not None and is_core_write_failure(exc.code(), exc.details()):
            return Aborted(f"the trajectory service ended the batch stream before message {self._unsent} was "
                           f"forwarded: it refused an earlier message, for a reason lost in that race (send one "
                           f"message at a time to see it)")
        error = from_rpc_error(exc, "StreamBatches")
        return UpstreamError(error.code, error.details)

    def cancel(self) -> None:
        self._call.cancel()


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
