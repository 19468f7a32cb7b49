"""A trainer's batch stream through a collector's address, read one whole-group batch at a time."""

from __future__ import annotations

import queue

from rlfleet.v1 import trajectory_pb2, trajectory_pb2_grpc
from rlfleet.wire import decode_tensordict


class Reader:
    """A trainer's batch stream through the collector's address."""

    def __init__(self, channel, batch_size: int, ack_late: bool = False, **open_args):
        """``ack_late``: ack a batch when the next is asked for (as the SDK does), not on receipt; with
        prefetch 1 the server then leases nothing new until the trainer is done with its batch."""
        self.ack_late = ack_late
        self._held: str | None = None
        self._stub = trajectory_pb2_grpc.TrajectoryServiceStub(channel)
        self._queue = queue.Queue()
        self._queue.put(trajectory_pb2.StreamBatchesRequest(open=trajectory_pb2.OpenBatchStream(
            batch_size=batch_size, whole_groups=True, **open_args)))
        self._responses = self._stub.StreamBatches(iter(self._queue.get, None), timeout=600)
        self._acked: str | None = None  # the last ack sent, not yet answered

    def next(self):
        """The next batch (decoded), acking the one before as the reader was told to."""
        if self._held is not None:
            self._queue.put(trajectory_pb2.StreamBatchesRequest(ack=trajectory_pb2.AckBatch(lease_id=self._held)))
            self._acked, self._held = self._held, None
        response = next(self._responses)
        if self._acked is not None:  # the answer to the last ack precedes the batch its slot let through
            assert (response.settled.lease_id, response.settled.applied) == (self._acked, True), response
            response = next(self._responses)
        assert response.lease_id and not response.HasField("settled")
        if self.ack_late:
            self._held = response.lease_id
        else:
            self._acked = response.lease_id
            self._queue.put(trajectory_pb2.StreamBatchesRequest(ack=trajectory_pb2.AckBatch(lease_id=self._acked)))
        return decode_tensordict(response.batch)

    def close(self):
        self._queue.put(None)
        self._responses.cancel()


def runs(mask) -> list[tuple[int, int]]:
    """(start, end) of each run of True in ``mask`` (a 1-D bool tensor): an episode's sampled turns."""
    out, start = [], None
    for i, value in enumerate(mask.tolist() + [False]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            out.append((start, i))
            start = None
    return out
