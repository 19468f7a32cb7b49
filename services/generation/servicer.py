"""GenerationService gRPC adapter: unpack protos, call GenerationEngine, pack replies."""

from __future__ import annotations

import logging
import time
import uuid

import torch

from rlfleet.choices import WEIGHT_TRANSPORTS
from rlfleet.rpc.channel import ChannelSettings
from rlfleet.services.common.errors import Aborted, InvalidArgument
from rlfleet.services.common.sampling_spec import sampling_from_proto, sampling_to_proto
from rlfleet.services.common.server import Service
from rlfleet.services.common.relay import Relay, tls_names_of
from rlfleet.services.common.weight_stream import PushReceiver, WeightPush, payloads
from rlfleet.services.generation.relayed import RelayedPushes
from rlfleet.services.generation.vllm_engine import GenerationEngine
from rlfleet.services.generation.sampling import SampleResult
from rlfleet.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2, weights_pb2
from rlfleet.wire import decode_tensor
from rlfleet.wire.dtypes import TOKEN_ID_DTYPES
from rlfleet.wire.push_rules import check_manifest
from rlfleet.wire.tensor import encode_values

log = logging.getLogger("rlfleet.generation")

_FINISH = {
    "stop": sampling_pb2.FINISH_REASON_STOP,
    "length": sampling_pb2.FINISH_REASON_LENGTH,
    "abort": sampling_pb2.FINISH_REASON_ABORT,
}


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, engine: GenerationEngine, service: Service, relayed: RelayedPushes | None = None):
        self.engine = engine
        self.service = service
        """Only its supervision is used: once it failed, every call is refused with the reason."""
        self.relayed = relayed or RelayedPushes(ChannelSettings())
        """Relayed pushes staged here (forwarded to peers with the service's ``upstream_*`` settings)."""

    async def _prompt_token_ids(self, prompt: sampling_pb2.Prompt) -> list[int]:
        """The prompt's token ids; one longer than the engine accepts is refused before it is listed."""
        limit = self.engine.max_prompt_tokens
        kind = prompt.WhichOneof("kind")
        if kind == "token_ids":
            ids = decode_tensor(prompt.token_ids, "prompt.token_ids", max_elements=limit)
            if ids.dim() != 1 or ids.dtype not in TOKEN_ID_DTYPES:
                raise InvalidArgument(
                    f"prompt.token_ids must be a 1-D int64/int32 tensor, got {ids.dtype} {list(ids.shape)}")
            return ids.tolist()
        if kind == "chat":
            messages = prompt.chat.messages
            if not messages:
                raise InvalidArgument("prompt.chat.messages is empty")
            if len(messages) > limit:
                raise InvalidArgument(f"prompt.chat.messages has {len(messages)} messages, "
                                      f"more than max_prompt_tokens={limit}")
            return await self.engine.encode_chat([{"role": m.role, "content": m.content} for m in messages])
        if kind == "text":
            return await self.engine.encode_text(prompt.text)
        raise InvalidArgument("prompt is empty: set token_ids, chat or text")

    async def Generate(self, request, context):
        self.service.check_working()
        # Sampling first: n, max_tokens and the rest are refused before the prompt is even read.
        spec = sampling_from_proto(request.sampling)
        self.engine.check_sampling(spec)
        prompt_ids = await self._prompt_token_ids(request.prompt)
        request_id = request.request_id or uuid.uuid4().hex
        # What every sample of this request repeats, built once.
        template = generation_pb2.GenerateResponse(request_id=request_id, sampling=sampling_to_proto(spec))
        encode_values(prompt_ids, torch.int64, template.prompt_token_ids)
        required = request.policy_version if request.HasField("policy_version") else None
        async for sample in self.engine.generate(prompt_ids, spec, request_id, required, run_id=request.run_id,
                                                 share_weight=request.share_weight, run_name=request.run_name,
                                                 policy_run=request.policy_run):
            yield _sample_to_proto(sample, template)

    async def UpdateWeights(self, request_iterator, context):
        """Stage (receive and verify), then apply on commit; see generation.proto."""
        self.service.check_working()
        started = time.monotonic()
        receiver = PushReceiver(payloads(request_iterator))
        manifest = await receiver.manifest()
        try:
            check_manifest(manifest, "collector")  # before the version: a manifest without one is malformed
            staged = self.engine.weights.stage(manifest)
        except Exception as err:
            if manifest.WhichOneof("source") == "relay":  # its bytes are refused at once, not waited for
                self.relayed.refuse(manifest.relay.push_id, str(err))
            raise
        relayed = self.relayed.open(staged) if staged.transport == "relay" else None
        weights = self.engine.weights
        try:
            streamed = await weights.stream(staged)  # loaded into vLLM as the bytes arrive (streamed_apply)
            if staged.nccl is not None:
                await weights.receive_nccl(staged)  # the bytes come over NCCL, into the segment
            if relayed is not None:
                await relayed.received()  # in RelayWeights calls
            elif staged.arriving is not None:
                await staged.follow()  # a segment its sender still writes
            else:
                await receiver.chunks(staged.push)
            if streamed is not None:
                await weights.loaded(staged)  # in the engine, checked; paused until the commit
            received = time.monotonic()
            if staged.manifest.two_phase:
                yield generation_pb2.UpdateWeightsResponse(
                    version=staged.version, received_bytes=staged.push.received,
                    receive_seconds=received - started, phase=weights_pb2.WEIGHT_PHASE_STAGED)
                await receiver.commit(staged.version)
            committed = time.monotonic()
            run = self.engine.weights.runs.get(staged.manifest.run_id) if staged.manifest.run_id else None
            in_flight = self.engine.status().requests_in_flight if run is None else run.calls
            aborted = in_flight if staged.mode == "abort" else 0
            await self.engine.weights.apply(staged)
            yield generation_pb2.UpdateWeightsResponse(
                version=self.engine.policy_version if run is None else run.version, received_bytes=staged.push.received,
                receive_seconds=received - started, apply_seconds=time.monotonic() - committed,
                aborted_requests=aborted, phase=weights_pb2.WEIGHT_PHASE_APPLIED,
                engine_weight_version=await self.engine.weights.vllm_version())
        finally:
            if relayed is not None:
                self.relayed.close(relayed)
            weights.end(staged)
            staged.close()

    async def RelayWeights(self, request_iterator, context):
        """A relayed push's bytes into the push staged here, forwarded on; see generation.proto."""
        self.service.check_working()
        requests = request_iterator.__aiter__()
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            raise InvalidArgument("empty relay: the first message must be the header") from None
        if first.WhichOneof("payload") != "header":
            raise InvalidArgument("the first message of a relay must be the header")
        header = first.header
        tls_names = tls_names_of(header)
        entry = self.relayed.find(header.push_id)
        push = entry.staged.push
        if header.version != push.version:
            raise InvalidArgument(f"header.version is {header.version}, the push {header.push_id!r} staged here "
                                  f"is version {push.version}")
        entry.forward(list(header.downstream), tls_names)
        yield generation_pb2.RelayWeightsResponse(received_bytes=push.received)
        async for request in requests:
            if request.WhichOneof("payload") != "chunk":
                raise InvalidArgument(f"expected a chunk at byte {push.received}, got "
                                      f"{request.WhichOneof('payload') or 'an empty message'}")
            chunk = request.chunk
            if chunk.offset + len(chunk.data) <= push.received:
                continue  # held already (from a sender since cut out)
            if entry.closed:
                break
            if chunk.offset < push.received:  # partly held: the rest
                chunk.data, chunk.offset = chunk.data[push.received - chunk.offset:], push.received
            push.add_chunk(chunk)
            entry.moved()
        if entry.closed:
            raise Aborted(f"relayed push {header.push_id!r} (version {push.version}) was discarded here")
        if not push.complete:
            raise InvalidArgument(f"the relay ended after {push.received} of {push.total_bytes} bytes")
        await entry.forwarded()
        cut = entry.relay.all_cut if entry.relay is not None else []
        yield generation_pb2.RelayWeightsResponse(received_bytes=push.received, done=True, cut=cut)

    async def ShareWeights(self, request, context):
        """The weights this replica serves, relayed to ``downstream`` (a peer joining); see generation.proto."""
        self.service.check_working()
        if not request.push_id:
            raise InvalidArgument("push_id is empty: name the relayed push the replicas downstream stage")
        if not request.downstream:
            raise InvalidArgument("downstream is empty: name the replicas to send the weights to")
        tls_names = tls_names_of(request)
        async with self.engine.weights.shared(request.version) as kept:
            manifest = weights_pb2.WeightManifest(mode=weights_pb2.UPDATE_MODE_KEEP)
            manifest.MergeFrom(kept.manifest)
            push = WeightPush.from_manifest(manifest, manifest.total_bytes)
            push.received = push.total_bytes
            relay = Relay(request.push_id, push, kept.segment.buffer, list(request.downstream), self.relayed.settings,
                          tls_names=tls_names)
            await relay.run()
        log.info("shared version %d with %s (%d bytes sent%s)", request.version, ", ".join(request.downstream),
                 relay.sent_bytes, f"; cut out: {', '.join(relay.all_cut)}" if relay.all_cut else "")
        return generation_pb2.ShareWeightsResponse(sent_bytes=relay.sent_bytes, cut=relay.all_cut)

    async def GetEngineStatus(self, request, context):
        self.service.check_working()
        status = self.engine.status()
        return generation_pb2.GetEngineStatusResponse(
            model=status.model, policy_version=status.policy_version,
            running_requests=status.requests_running, waiting_requests=status.requests_waiting,
            tokens_per_second=status.tokens_per_second, swapping=self.engine.swapping,
            max_queued_requests=status.max_queued_requests,
            weight_transports=[*WEIGHT_TRANSPORTS, "relay", "shm-watermark"],
            weight_transfer_world_size=self.engine.weights.transfer_world_size,
            max_push_bytes=self.engine.weights.max_push_bytes,
            resumed_samples=status.resumed_samples, resumed_tokens=status.resumed_tokens,
            runs=[generation_pb2.ServedRun(run_id=run.run_id, policy_version=run.policy_version,
                                           requests_in_flight=run.requests_in_flight,
                                           requests_waiting=run.requests_waiting,
                                           generated_tokens=run.generated_tokens, name=run.name)
                  for run in status.runs],
            max_runs=status.max_runs,
        )

    async def EndRun(self, request, context):
        self.service.check_working()
        if not request.run_id:
            raise InvalidArgument("run_id is empty: the replica's own run does not end here")
        return generation_pb2.EndRunResponse(requests_in_flight=self.engine.end_run(request.run_id))


def _sample_to_proto(sample: SampleResult, template: generation_pb2.GenerateResponse) -> generation_pb2.GenerateResponse:
    """The reply for one finished sample: ``template`` (request id, prompt, echoed sampling) plus the sample."""
    response = generation_pb2.GenerateResponse()
    response.CopyFrom(template)
    response.sample_index = sample.index
    response.finish_reason = _FINISH[sample.finish_reason]
    if sample.stop_reason is not None:
        response.stop_reason = str(sample.stop_reason)
    response.policy_version_start = sample.policy_version_start
    response.policy_version_end = sample.policy_version_end
    for version, start, end in sample.policy_version_spans:
        response.policy_version_spans.add(version=version, start=start, end=end)
    response.cached_prompt_tokens = sample.cached_prompt_tokens
    timing = response.timing
    timing.queued_seconds = sample.timing.queue_seconds
    timing.first_token_seconds = sample.timing.first_token_seconds or 0.0
    timing.total_seconds = sample.timing.total_seconds
    encode_values(sample.response_token_ids, torch.int64, response.response_token_ids)
    encode_values(sample.behavior_log_probs, torch.float32, response.behavior_log_probs)
    return response

