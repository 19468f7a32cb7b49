"""Weight push framing: sender chunks and receiver assembly/validation."""

import pytest
import torch

from rlfleet.services.collector.admission import VersionGate
from rlfleet.rpc.channel import ChannelSettings
from rlfleet.services.collector.fanout import WeightFanout
from rlfleet.services.collector.replicas import ReplicaPool, ReplicaRun
from rlfleet.services.common.errors import Aborted, InvalidArgument, OutOfRange, ResourceExhausted, Unavailable
from rlfleet.services.common.weight_stream import MAX_POLICY_VERSION, WeightPush
from rlfleet.v1 import weights_pb2
from rlfleet.wire import WireError, shm
from rlfleet.wire.push_messages import iter_push_messages

STATE = [
    ("a", torch.randn(3, 5)),
    ("b", torch.arange(7, dtype=torch.int64)),
    ("c", torch.randn(4, 4).to(torch.bfloat16).t()),  # non-contiguous
    ("d", torch.zeros(0)),
]


def assemble(messages, max_bytes=1 << 30):
    push = None
    for kind, msg in messages:
        if kind == "manifest":
            push = WeightPush.from_manifest(msg, max_bytes)
            push.attach_sink(memoryview(bytearray(push.total_bytes)))
        else:
            push.add_chunk(msg)
    push.finish()
    return push


@pytest.mark.parametrize("chunk_bytes", [1, 7, 16, 64, 1 << 20])
@pytest.mark.parametrize("algo", ["crc32", "sha256", None])
def test_round_trip_any_chunking(chunk_bytes, algo):
    push = assemble(iter_push_messages(STATE, version=3, chunk_bytes=chunk_bytes, checksum_algo=algo))
    assert push.version == 3 and push.mode == "keep"
    flat = torch.frombuffer(push.sink, dtype=torch.uint8)
    offsets = shm.tensor_offsets(push.sizes)
    for (name, tensor), got_name, dtype, shape, offset in zip(STATE, push.names, push.dtypes, push.shapes, offsets):
        assert got_name == name and tuple(shape) == tuple(tensor.shape) and dtype == tensor.dtype
        assert torch.equal(shm.view_tensor(flat, offset, dtype, shape), tensor.contiguous())


def messages():
    return list(iter_push_messages(STATE, version=1, chunk_bytes=16))


def test_short_stream_is_aborted_and_corruption_is_caught():
    msgs = messages()
    with pytest.raises(Aborted, match="ended after"):
        assemble(msgs[:-1])
    corrupt = list(msgs)
    kind, chunk = corrupt[2]
    corrupt[2] = (kind, weights_pb2.WeightChunk(offset=chunk.offset, data=bytes([chunk.data[0] ^ 1]) + chunk.data[1:]))
    with pytest.raises(InvalidArgument, match="checksum mismatch"):
        assemble(corrupt)
    reordered = [msgs[0], msgs[2], msgs[1], *msgs[3:]]
    with pytest.raises(InvalidArgument, match="chunk.offset"):
        assemble(reordered)
    extra = [*msgs, ("chunk", weights_pb2.WeightChunk(offset=msgs[-1][1].offset + len(msgs[-1][1].data), data=b"x"))]
    with pytest.raises(InvalidArgument, match="exceed"):
        assemble(extra)


def test_bad_manifests():
    manifest = messages()[0][1]
    bad = weights_pb2.WeightManifest()
    bad.CopyFrom(manifest)
    bad.total_bytes += 1
    with pytest.raises(InvalidArgument, match="total_bytes"):
        WeightPush.from_manifest(bad, 1 << 30)
    bad.CopyFrom(manifest)
    bad.tensors[1].name = "a"
    with pytest.raises(InvalidArgument, match="appears twice"):
        WeightPush.from_manifest(bad, 1 << 30)
    bad.CopyFrom(manifest)
    bad.tensors[0].dtype = 77
    with pytest.raises(WireError, match=r"tensors\[0\].dtype \(tensor '.+'\)"):  # INVALID_ARGUMENT, by the interceptor
        WeightPush.from_manifest(bad, 1 << 30)
    with pytest.raises(ResourceExhausted):
        WeightPush.from_manifest(manifest, 8)
    bad.CopyFrom(manifest)
    bad.checksum = "md5:abc"
    with pytest.raises(InvalidArgument, match="checksum"):
        WeightPush.from_manifest(bad, 1 << 30)


def test_versions_stop_at_int64():
    manifest = messages()[0][1]
    manifest.version = MAX_POLICY_VERSION
    assert WeightPush.from_manifest(manifest, 1 << 30).version == MAX_POLICY_VERSION
    manifest.version = MAX_POLICY_VERSION + 1
    with pytest.raises(OutOfRange, match="manifest.version: 9223372036854775808 is beyond"):
        WeightPush.from_manifest(manifest, 1 << 30)


async def test_the_collector_assigns_no_version_past_int64(tmp_path):
    fanout = WeightFanout(pool=ReplicaPool(ChannelSettings()), gate=VersionGate(version=MAX_POLICY_VERSION),
                          spool_dir=tmp_path,
                          max_push_bytes=1 << 30)

    async def push():
        for kind, msg in iter_push_messages(STATE, version=0, chunk_bytes=16):  # 0: "the next version"
            yield kind, msg

    with pytest.raises(OutOfRange, match="no version is left after 9223372036854775807"):
        await fanout.push(push())
    assert fanout.gate.version == MAX_POLICY_VERSION


async def test_the_collector_takes_no_push_larger_than_its_smallest_replica_takes(tmp_path):
    class Pool:
        replicas = [type("R", (), {"max_push_bytes": b})() for b in (0, 10_000, 60)]  # 0: not reported yet
        run = ReplicaRun()

    async def push():
        for kind, msg in iter_push_messages(STATE, version=0, chunk_bytes=16):
            yield kind, msg

    fanout = WeightFanout(pool=Pool(), gate=VersionGate(), spool_dir=tmp_path, max_push_bytes=None)
    assert fanout.push_limit() == 60
    with pytest.raises(ResourceExhausted):  # the state is bigger than 60 bytes: refused before any allocation
        await fanout.push(push())
    Pool.replicas = [type("R", (), {"max_push_bytes": 0})()]
    with pytest.raises(Unavailable, match="no generation replica has reported"):
        fanout.push_limit()
    assert WeightFanout(pool=Pool(), gate=VersionGate(), spool_dir=tmp_path, max_push_bytes=123).push_limit() == 123
