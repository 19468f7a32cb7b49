"""What follows a weight push's commit (``Commits.committed``, the fan-out's ``on_commit``): the version made
durable in the collector's database, then, in sync mode, the groups it made stale dropped from the
trajectory service and their prompts generated again (``regenerate``; the batch relay does the same for a
stale batch it holds back)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Coroutine

from rlfleet.rpc.channel import ChannelSettings, call_with_retry
from rlfleet.rpc.errors import RlfleetClientError
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.ledger import PromptLedger
from rlfleet.services.collector.rollout import Pipeline
from rlfleet.services.collector.source import PromptSource
from rlfleet.v1 import trajectory_pb2, trajectory_pb2_grpc, weights_pb2

log = logging.getLogger("rlfleet.collector")


class Commits:
    def __init__(self, ledger: PromptLedger, gate: VersionGate, source: PromptSource, pipeline: Pipeline,
                 trajectory: trajectory_pb2_grpc.TrajectoryServiceStub, settings: ChannelSettings,
                 supervise: Callable[[Coroutine, str], asyncio.Task]):
        self._ledger, self._gate, self._source, self._pipeline = ledger, gate, source, pipeline
        self._trajectory, self._settings, self._supervise = trajectory, settings, supervise

    async def committed(self, version: int, spool_manifest: weights_pb2.WeightManifest | None = None) -> None:
        """Every replica that applied serves ``version``: it is durable before the trainer hears of it (in
        the collector's database: with the spool's manifest when the spool is there too). The dataset
        position lives there as well (moved with each prompt drawn)."""
        await self._ledger.commit_version(version, spool_manifest.SerializeToString()
                                          if spool_manifest is not None else None)
        if self._gate.sync:
            self._supervise(self.drop_stale(version), f"drop-stale-{version}")

    async def drop_stale(self, version: int) -> None:
        """Sync mode, after a commit: groups older than ``version`` still buffered (unread) can never
        reach the trainer; drop them from the trajectory service and generate their prompts again.
        Failures are retried at the next commit (which drops everything older, too)."""
        try:
            dropped = await call_with_retry(
                self._trajectory.DropStale, trajectory_pb2.DropStaleRequest(below_policy_version=version),
                method="DropStale", settings=self._settings)
        except RlfleetClientError as exc:
            log.warning("could not drop stale groups after the commit of v%d (retried at the next): %s", version, exc)
            return
        await self.regenerate(list(dropped.prompt_ids), int(dropped.dropped), f"dropped below v{version}",
                              list(dropped.group_ids))
        await self._ledger.forget_appended(version - 1)  # kept one commit longer: a leased batch may come back

    async def regenerate(self, prompt_ids: list[str], samples: int, why: str, group_ids: list[int]) -> None:
        """Generate again the prompts of stale groups that were deleted unread (counted as discarded);
        ``group_ids``: theirs, to find the groups whose prompts' rows are not yet ended."""
        if not samples:
            return
        self._pipeline.discard(samples)
        missing = await self._source.regenerate(prompt_ids, self._pipeline.unconfirmed(group_ids))
        await self._gate.reopen(len(prompt_ids))  # one group per prompt: its slot goes to a regenerated one
        log.info("stale groups deleted unread, prompts generated again",
                 extra={"why": why, "samples": samples, "prompts": len(prompt_ids) - len(missing)})
        if missing:
            log.warning("stale groups deleted whose prompts had left the ledger (not generated again)",
                        extra={"prompt_ids": missing[:20], "count": len(missing)})
