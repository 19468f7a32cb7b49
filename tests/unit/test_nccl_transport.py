"""The nccl transport without a GPU: rank offsets, the manifest checks, and the trainer's sender
with a replica's receiver over a stand-in group (the broadcast itself is NCCL's, unverified here),
staging into a segment laid out exactly as an shm push's (the apply is the same)."""

from __future__ import annotations

import pytest
import torch

from rlfleet.client.nccl import send_broadcast, world_size
from rlfleet.services.collector.fanout import nccl_rank_offsets
from rlfleet.services.collector.replicas import Replica
from rlfleet.services.common.errors import FailedPrecondition
from rlfleet.services.generation.staging import StagedPush
from rlfleet.services.generation.transfer import RlfleetUpdateInfo, SegmentSink, receive_broadcast
from rlfleet.services.generation.push_validation import TensorSpec
from rlfleet.v1 import collector_pb2
from rlfleet.wire import WireError, shm
from rlfleet.wire.push_rules import check_manifest
from rlfleet.wire.push_messages import iter_push_messages

PAIRS = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)), ("c", torch.randn(4).to(torch.bfloat16))]


class Wire:
    """One broadcast seen from both ends, in process: what rank 0 sent, in order."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []


class SenderGroup:
    def __init__(self, wire: Wire):
        self.wire = wire

    def broadcast(self, tensor, src, stream=None):
        assert src == 0 and stream is None  # CPU tensors: no CUDA stream
        self.wire.sent.append(tensor.clone())


class ReceiverGroup:
    def __init__(self, wire: Wire):
        self.wire, self.next = wire, 0

    def broadcast(self, tensor, src, stream=None):
        assert src == 0
        sent = self.wire.sent[self.next]
        self.next += 1
        assert (sent.dtype, sent.shape) == (tensor.dtype, tensor.shape), "sender and receiver disagree"
        tensor.copy_(sent)


class NcclEngine:
    """What ``receive_broadcast`` reads of vLLM's NCCLWeightTransferEngine (tensor-by-tensor mode)."""

    packed = False

    def __init__(self, group):
        self.model_update_group = group


def update_info(pairs, total_bytes: int) -> RlfleetUpdateInfo:
    return RlfleetUpdateInfo(names=[n for n, _ in pairs],
                             dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in pairs],
                             shapes=[list(t.shape) for _, t in pairs], total_bytes=total_bytes)


def test_rank_offsets_follow_the_trainer_and_each_replicas_workers():
    replicas = [Replica(f"r{i}:1", None, None, healthy=True, transfer_world_size=n) for i, n in enumerate([1, 4, 2])]
    assert nccl_rank_offsets(replicas) == ([1, 2, 6], 8)
    statuses = [collector_pb2.ReplicaStatus(healthy=True, weight_transfer_world_size=r.transfer_world_size)
                for r in replicas]
    statuses.append(collector_pb2.ReplicaStatus(healthy=False, weight_transfer_world_size=8))
    assert world_size(statuses) == 8  # the SDK counts as the collector does; replicas out of rotation take no rank
    with pytest.raises(FailedPrecondition, match="has not reported its worker count"):
        nccl_rank_offsets([Replica("r9:1", None, None)])


def test_a_broadcast_lands_in_the_segment_exactly_as_an_shm_push_lays_it_out(tmp_path):
    _, manifest = next(iter_push_messages(PAIRS, version=3, checksum_algo=None))
    update = update_info(PAIRS, manifest.total_bytes)
    wire = Wire()
    send_broadcast(SenderGroup(wire), PAIRS, packed=False)
    assert len(wire.sent) == len(PAIRS)
    with shm.create_segment(manifest.total_bytes, directory=str(tmp_path)) as staged, \
            shm.create_segment(manifest.total_bytes, directory=str(tmp_path)) as reference:
        sink = SegmentSink(staged.as_uint8(), update)
        receive_broadcast(NcclEngine(ReceiverGroup(wire)), update, sink, torch.device("cpu"))
        assert sink.written == manifest.total_bytes
        shm.write_tensors(reference, [t for _, t in PAIRS])  # what an shm push of the same state holds
        assert bytes(staged.buffer) == bytes(reference.buffer)
    receiver = ReceiverGroup(wire)  # a worker that only takes part (not its group's first) keeps nothing
    receive_broadcast(NcclEngine(receiver), update, None, torch.device("cpu"))
    assert receiver.next == len(PAIRS)


def test_a_received_tensor_of_the_wrong_size_is_refused(tmp_path):
    update = update_info(PAIRS, 3 * 5 * 4 + 7 * 8 + 4 * 2)
    with shm.create_segment(update.total_bytes, directory=str(tmp_path)) as staged:
        with pytest.raises(ValueError, match="a: received 4 bytes"):
            SegmentSink(staged.as_uint8(), update)([("a", torch.zeros(1))])


def test_a_replica_checks_the_rendezvous_and_stages_into_a_segment_of_its_own():
    checkpoint = {name: TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in PAIRS}
    _, manifest = next(iter_push_messages(PAIRS, version=3, checksum_algo=None))
    manifest.nccl.master_address, manifest.nccl.master_port = "10.0.0.1", 29500
    manifest.nccl.world_size, manifest.nccl.rank_offset = 3, 0  # rank 0 is the trainer's
    with pytest.raises(WireError, match="rank_offset < world_size"):
        check_manifest(manifest, "collector")  # WeightSwaps.stage's first check
    manifest.nccl.rank_offset = 1
    check_manifest(manifest, "collector")
    staged = StagedPush.begin(manifest, checkpoint, 1 << 20)
    try:
        assert staged.transport == "nccl" and staged.nccl["rank_offset"] == 1
        assert staged.segment.size == manifest.total_bytes and staged.push.received == 0  # the broadcast fills it
        assert staged.update_info()["shm_path"] == staged.segment.fd_path  # applied like any staged push
    finally:
        staged.close()


def test_the_sdk_refuses_an_nccl_push_of_host_tensors():
    import asyncio

    from rlfleet.client.channel import ChannelSettings
    from rlfleet.client.nccl import push_nccl

    _, manifest = next(iter_push_messages(PAIRS, version=1, checksum_algo=None))
    with pytest.raises(ValueError, match="CUDA device"):
        asyncio.run(push_nccl(None, None, PAIRS, manifest, timeout=1.0, settings=ChannelSettings(), address=None))
