"""What the pipeline's stages count, for GetStatus: each stage's groups waiting, in flight and done
(``StageStats``), and the sampled work thrown away on the way (``Discards``)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import dataclass, field


@dataclass
class StageStats:
    """Counters of one stage, for GetStatus: groups waiting for the stage's limit (``queued``), in
    it (``in_flight``), done, and the completions of the last ``HORIZON_SECONDS`` (for the rate)."""

    HORIZON_SECONDS = 30.0

    name: str
    queued: int = 0
    in_flight: int = 0
    done: int = 0
    window: collections.deque = field(default_factory=collections.deque)

    def rate(self) -> float:
        self._forget(time.monotonic())
        return len(self.window) / self.HORIZON_SECONDS

    def _forget(self, now: float) -> None:
        while self.window and self.window[0] <= now - self.HORIZON_SECONDS:
            self.window.popleft()

    @contextlib.asynccontextmanager
    async def track(self, limit: asyncio.Semaphore | None = None):
        """Queued until ``limit`` lets the group in, then in flight until the block ends."""
        self.queued += 1
        try:
            if limit is not None:
                await limit.acquire()
        finally:
            self.queued -= 1
        self.in_flight += 1
        try:
            yield
            self.done += 1
            now = time.monotonic()
            self.window.append(now)
            self._forget(now)
        finally:
            self.in_flight -= 1
            if limit is not None:
                limit.release()


@dataclass
class Discards:
    """Samples thrown away (a group aborted by a weight update, too stale, on a version that did not commit,
    deleted unread), and their sampled tokens (with the turns aborted by a weight update)."""

    samples: int = 0
    tokens: int = 0

    def add(self, samples: int, tokens: int = 0) -> None:
        self.samples += samples
        self.tokens += tokens
