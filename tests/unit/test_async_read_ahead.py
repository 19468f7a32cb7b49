"""A trainer's batches are read ahead (prefetch) in async mode, never in sync mode: the collector's batch
proxy serves a sync trainer one batch at a time, so none can go stale at its push after being sent."""

import asyncio
from types import SimpleNamespace

import pytest

from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.servicer import TrajectoryProxyServicer
from rlfleet.v1 import trajectory_pb2


class _Upstream:
    """A StreamBatches call to the trajectory service that records what it is sent and delivers nothing."""

    def __init__(self):
        self.written = []
        self.opened = asyncio.Event()

    async def write(self, message):
        self.written.append(message)
        self.opened.set()

    async def read(self):
        await asyncio.Event().wait()  # nothing to deliver: open until cancelled

    async def done_writing(self):
        pass

    def cancel(self):
        pass


def _forwarded_open(gate: VersionGate, prefetch: int) -> trajectory_pb2.OpenBatchStream:
    upstream = _Upstream()
    collector = SimpleNamespace(trajectory=SimpleNamespace(StreamBatches=lambda metadata: upstream),
                                settings=SimpleNamespace(metadata=lambda: ()), gate=gate,
                                check_trainer_call=lambda metadata: None, failed=asyncio.Event(), commits=None)

    async def trainer():
        yield trajectory_pb2.StreamBatchesRequest(open=trajectory_pb2.OpenBatchStream(batch_size=4, prefetch=prefetch))
        await asyncio.Event().wait()  # the trainer keeps its stream open

    async def run():
        responses = TrajectoryProxyServicer(collector).StreamBatches(trainer(), SimpleNamespace(invocation_metadata=tuple))
        reading = asyncio.ensure_future(anext(responses))
        await asyncio.wait_for(upstream.opened.wait(), 10)
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await responses.aclose()
        return upstream.written[0].open

    return asyncio.run(run())


@pytest.mark.parametrize("prefetch", [1, 2, 5])
def test_an_async_trainers_read_ahead_is_forwarded_as_asked(prefetch):
    assert _forwarded_open(VersionGate(max_staleness=1), prefetch).prefetch == prefetch


@pytest.mark.parametrize("prefetch", [1, 2, 5])
def test_a_sync_trainer_is_served_one_batch_at_a_time(prefetch):
    gate = VersionGate(sync=True, version=3)
    opened = _forwarded_open(gate, prefetch)
    assert (opened.prefetch, opened.min_policy_version) == (1, 3)
