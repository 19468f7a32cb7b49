"""Rolling updates: a decided push reaches the replicas a few at a time while the others serve.

``WeightFanout`` stages the push on every replica as for any push (staging pauses nothing); then,
instead of committing everywhere at once behind a closed admission gate, ``RollingUpdate.run``
switches ``max_unavailable`` replicas at a time:

1. **Drain** (``ReplicaPool.drain``): the replica takes no new work; what it runs finishes. The last
   replica serving the old version also waits for the groups pinned to it (multi-turn episodes
   between turns). Bounded by ``drain_seconds``.
2. **Commit**: the replica applies the staged version. It was staged in ``abort`` mode, so what a
   drain that ran out of time left running there is aborted, and its group generated again (never
   continued on the new weights).
3. Back in rotation, serving the new version; ``settle_seconds`` later the next batch begins.

Meanwhile the collector admits groups as usual, and each group is pinned to the version of the
replica its first request goes to (``GenerateRequest.policy_version``; ``rollout.py``). The version
commits once every replica applied it; a group that ran on it reaches the trainer only then
(``VersionGate.committed``). The window in which two versions serve is bounded by ``max_seconds``:
past it, the replicas left switch together without draining.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from rlfleet.services.collector.replicas import ReplicaPool
from rlfleet.services.collector.transports import ReplicaPush
from rlfleet.v1 import collector_pb2

log = logging.getLogger("rlfleet.collector.rolling")


@dataclass(frozen=True)
class RollingSettings:
    """The collector's ``rolling_*`` settings."""

    max_unavailable: int = 1
    drain_seconds: float = 30.0
    max_seconds: float = 300.0
    settle_seconds: float = 0.0


class RollingUpdate:
    """One rolling update of ``from_version`` to ``to_version``, and what status shows of it."""

    def __init__(self, pool: ReplicaPool, settings: RollingSettings, from_version: int, to_version: int,
                 replicas: int):
        self.pool = pool
        self.settings = settings
        self.from_version = from_version
        self.to_version = to_version
        self.total = replicas
        self.switched = 0
        self.started: float | None = None
        self.ended: float | None = None
        self.committed = False

    async def run(self, staged: list[ReplicaPush]) -> None:
        """Switch the replicas that staged the push, ``max_unavailable`` at a time (those out of rotation,
        which serve nothing, first); each stream's outcome says whether it applied."""
        self.started = time.monotonic()
        deadline = self.started + self.settings.max_seconds
        pending = sorted(staged, key=lambda stream: stream.replica.healthy)
        while pending:
            late = time.monotonic() >= deadline
            batch = pending if late else pending[:self.settings.max_unavailable]
            pending = pending[len(batch):]
            if late:
                log.warning("rolling update to version %d past its %.0f s bound: switching the %d replicas "
                            "left together", self.to_version, self.settings.max_seconds, len(batch))
            until = time.monotonic() if late else min(deadline, time.monotonic() + self.settings.drain_seconds)
            await asyncio.gather(*(self._switch(stream, until) for stream in batch))
            if pending and self.settings.settle_seconds:
                await asyncio.sleep(self.settings.settle_seconds)

    async def _switch(self, stream: ReplicaPush, drain_until: float) -> None:
        replica = stream.replica
        drained = await self.pool.drain(replica, drain_until) if replica.healthy else True
        if not drained:
            log.warning("replica %s not drained in time: aborting what it runs (generated again)",
                        replica.address)
        try:
            await stream.commit()
            outcome = stream.outcome()
            if not outcome.applied:
                await self.pool.mark_failed(replica, outcome.error)  # out of rotation now, not at the end
                return
        finally:
            await self.pool.undrain(replica)
        self.switched += 1
        log.info("replica %s switched to version %d (%d of %d)", replica.address, self.to_version,
                 self.switched, self.total)

    def finish(self, committed: bool) -> None:
        self.ended = time.monotonic()
        self.committed = committed

    def status(self) -> collector_pb2.RollingUpdateStatus:
        now = self.ended if self.ended is not None else time.monotonic()
        return collector_pb2.RollingUpdateStatus(
            in_progress=self.ended is None, from_version=self.from_version, to_version=self.to_version,
            replicas_switched=self.switched, replicas_total=self.total,
            window_seconds=now - self.started if self.started is not None else 0.0,
            max_window_seconds=self.settings.max_seconds, committed=self.committed)
