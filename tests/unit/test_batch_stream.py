"""The collector's batch relay (``batch_stream.py``) above gRPC: sync mode's read rules and the relay's own acks."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.batch_stream import BatchRelay
from rlfleet.services.common.errors import Unavailable
from rlfleet.v1 import tensor_pb2, trajectory_pb2
from rlfleet.wire import encode_tensor


def batch(lease_id: str, start_versions: list[int], prompt_ids: list[str]) -> trajectory_pb2.StreamBatchesResponse:
    response = trajectory_pb2.StreamBatchesResponse(lease_id=lease_id)
    response.batch.batch_size.append(len(start_versions))
    response.batch.entries["policy_version_start"].tensor.CopyFrom(encode_tensor(torch.tensor(start_versions)))
    group_ids = [int(prompt_id.lstrip("p")) * 10 for prompt_id in prompt_ids]  # one group per prompt
    response.batch.entries["group_id"].tensor.CopyFrom(encode_tensor(torch.tensor(group_ids)))
    response.batch.entries["prompt_id"].CopyFrom(tensor_pb2.TensorDictValue(
        strings=tensor_pb2.StringList(values=prompt_ids)))
    return response


def settled(lease_id: str) -> trajectory_pb2.StreamBatchesResponse:
    return trajectory_pb2.StreamBatchesResponse(settled=trajectory_pb2.Settled(lease_id=lease_id, applied=True))


class Upstream:
    """The trajectory service's end: delivers what it is given, answers every ack."""

    def __init__(self, *responses):
        self.written: list[trajectory_pb2.StreamBatchesRequest] = []
        self.responses: asyncio.Queue = asyncio.Queue()
        for response in responses:
            self.responses.put_nowait(response)

    async def write(self, message, index=None):
        self.written.append(message)
        if message.WhichOneof("kind") == "ack":
            self.responses.put_nowait(settled(message.ack.lease_id))
        return True

    async def done_writing(self):
        pass

    async def read(self):
        return await self.responses.get()

    def cancel(self):
        pass


class Collector(SimpleNamespace):
    def __init__(self, gate: VersionGate):
        super().__init__(gate=gate, failed=asyncio.Event(), regenerated=[])

    async def regenerate(self, prompt_ids, samples, why, group_ids):
        self.regenerated.append((prompt_ids, samples, group_ids))

    def check_working(self):
        if self.failed.is_set():
            raise Unavailable("the collector failed")


async def trainer(acks: asyncio.Queue):
    yield trajectory_pb2.StreamBatchesRequest(open=trajectory_pb2.OpenBatchStream(batch_size=3, prefetch=4))
    while True:
        yield trajectory_pb2.StreamBatchesRequest(ack=trajectory_pb2.AckBatch(lease_id=await acks.get()))


def test_a_sync_trainer_never_gets_a_batch_older_than_the_latest_push():
    async def scenario():
        collector = Collector(VersionGate(sync=True, version=2))
        upstream = Upstream(batch("stale", [1, 2, 2], ["p1", "p1", "p2"]), batch("fresh", [2, 2, 2], ["p3"] * 3))
        acks = asyncio.Queue()
        responses = BatchRelay(upstream, collector.gate, collector, collector).responses(trainer(acks))
        assert (await anext(responses)).lease_id == "fresh"
        acks.put_nowait("fresh")
        assert (await anext(responses)).settled.lease_id == "fresh"  # the trainer's ack is answered
        await responses.aclose()
        return collector, upstream

    collector, upstream = asyncio.run(scenario())
    # The stale batch's prompts, once each, and its rows' group ids (to find groups not yet confirmed).
    assert collector.regenerated == [(["p1", "p2"], 3, [10, 10, 20])]
    opened = upstream.written[0].open
    assert (opened.min_policy_version, opened.prefetch) == (2, 1)
    # The relay acked the stale batch itself; the answer to that ack was not forwarded.
    assert [m.ack.lease_id for m in upstream.written[1:]] == ["stale", "fresh"]


def test_an_async_trainer_gets_old_batches_its_min_policy_version_allows():
    async def scenario():
        collector = Collector(VersionGate(max_staleness=1, version=5))
        upstream = Upstream(batch("old", [0, 0, 0], ["p1"] * 3))
        responses = BatchRelay(upstream, collector.gate, collector, collector).responses(trainer(asyncio.Queue()))
        delivered = await anext(responses)
        await responses.aclose()
        return collector, upstream, delivered

    collector, upstream, delivered = asyncio.run(scenario())
    assert delivered.lease_id == "old" and not collector.regenerated
    assert upstream.written[0].open.prefetch == 4  # read ahead as asked


def test_the_collectors_failure_ends_the_stream_with_its_reason():
    async def scenario():
        collector = Collector(VersionGate())
        responses = BatchRelay(Upstream(), collector.gate, collector, collector).responses(trainer(asyncio.Queue()))
        collector.failed.set()
        await asyncio.wait_for(anext(responses), 10)

    with pytest.raises(Unavailable, match="the collector failed"):
        asyncio.run(scenario())


@pytest.mark.parametrize("sync, asked, opened", [
    (True, (0, 4), (3, 1)), (True, (7, 1), (7, 1)), (False, (0, 4), (0, 4)), (False, (1, 2), (1, 2)),
])
def test_a_sync_stream_opens_at_the_committed_version_one_batch_at_a_time(sync, asked, opened):
    assert VersionGate(sync=sync, version=3).open_for_read(*asked) == opened
