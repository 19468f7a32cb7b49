"""How much of a segment still being written holds: the writer moves the watermark, readers follow it.

A streamed apply (``generation.weight_swaps.WeightSwaps.stream``) loads a push into the engine while its
bytes still arrive: the generation service writes each chunk into the staged segment, then moves the
watermark past it; each vLLM worker, loading tensor by tensor from the same segment, waits until the
watermark passes the tensor it reads next (``wait_for``). A collector offers the replicas on its host
the segment a grpc push is being received into, with its watermark (``ShmSegment.watermark_path``),
before the last byte is in: each replica follows it into its own.

The watermark is three int64 words in a small segment of its own (``rlfleet.wire.shm``). The writer
sets two: the bytes arrived, and 1 once the push was cut (no more will come: the worker stops
loading). The worker sets the third: the bytes it loaded before the tensor it waits for (a rollback
says how far the load got). The writer creates it and passes its ``fd_path`` (or, to another
process that is not its child, its path).

The service stores a chunk's bytes before the watermark that covers them, and the worker reads the
watermark before the bytes: on x86 (total store order) that is all the ordering needed. Other CPUs
are unverified here.
"""

from __future__ import annotations

import asyncio
import time

import torch

from rlfleet.wire import shm

SIZE = 24
POLL_SECONDS = 0.002
"""How often a waiting worker looks again (a look costs a few microseconds)."""


class Watermark:
    """The three words, over a mapped segment (see the module docstring)."""

    def __init__(self, segment: shm.Segment):
        self.segment = segment
        self._words = segment.as_uint8().view(torch.int64)

    @classmethod
    def create(cls) -> "Watermark":
        return cls(shm.create_segment(SIZE))

    @classmethod
    def open(cls, path: str) -> "Watermark":
        """The service's watermark, from a worker (``path``: its ``fd_path``)."""
        return cls(shm.open_segment(path, SIZE, trusted=True, writable=True))

    @classmethod
    def offered(cls, path: str) -> "Watermark":
        """A sender's watermark named in a request (``ShmSegment.watermark_path``), read-only; ``path`` must
        name a segment in this host's shm directory (``shm.SegmentUnavailable`` if it cannot be opened)."""
        return cls(shm.open_segment(path, SIZE))

    @property
    def path(self) -> str:
        return self.segment.fd_path

    def _word(self, index: int) -> int:
        words = self._words  # read on the metrics thread too: 0 once closed
        return 0 if words is None else int(words[index])

    @property
    def arrived(self) -> int:
        return self._word(0)

    @property
    def cut(self) -> bool:
        return bool(self._word(1))

    @property
    def loaded(self) -> int:
        return self._word(2)

    def advance(self, received: int) -> None:
        """Bytes up to ``received`` are in the segment (written before this call); nothing once closed."""
        if self._words is not None:
            self._words[0] = received

    def cut_off(self) -> None:
        """No more bytes will come: a waiting worker stops loading (nothing once closed)."""
        if self._words is not None:
            self._words[1] = 1

    def wait_for(self, start: int, end: int) -> bool:
        """The worker, the bytes before ``start`` loaded: block until those up to ``end`` arrived (True) or
        the push was cut first (False)."""
        self._words[2] = start
        while self.arrived < end:
            if self.cut:
                return self.arrived >= end
            time.sleep(POLL_SECONDS)
        return True

    async def until(self, end: int) -> bool:
        """``wait_for``, for an event loop: True once the bytes up to ``end`` arrived, False if cut first."""
        while self.arrived < end:
            if self.cut:
                return self.arrived >= end
            await asyncio.sleep(POLL_SECONDS)
        return True

    def close(self) -> None:
        self._words = None
        self.segment.close()
