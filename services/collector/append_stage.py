"""The pipeline's last stage: a scored group into the trajectory service, once.

In: the group, its reference log-probs and rewards, and whether dynamic sampling filtered it. Out: the
version the group started at and whether it is stored as filtered. The group is appended whole under its
prompt's ledger key, so an append made again after a restart finds the earlier one (the earlier group
stands). A group more than ``max_staleness`` versions old is ``Discard``ed (its prompt generated again on
the current weights); a full buffer is waited out (backpressure). The groups that queue meanwhile go out in
one Append (``coalescer.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from rlfleet.rpc.channel import ChannelSettings, call_with_retry
from rlfleet.rpc.errors import ResourceExhaustedError
from rlfleet.services.collector import batched_calls
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.coalescer import Coalescer
from rlfleet.services.collector.failures import Discard
from rlfleet.services.collector.prompt_item import PromptItem
from rlfleet.services.collector.score_stage import one_group_may_be_why
from rlfleet.services.collector.stage_stats import Discards, StageStats
from rlfleet.services.collector.trajectories import GroupSamples, group_message
from rlfleet.services.common import tracing
from rlfleet.v1 import reward_pb2, tensor_pb2, trajectory_pb2_grpc
from rlfleet.wire import WireError

log = logging.getLogger("rlfleet.collector.rollout")


class AppendStage:
    def __init__(self, gate: VersionGate, trajectory: trajectory_pb2_grpc.TrajectoryServiceStub,
                 settings: ChannelSettings, discards: Discards, *, max_groups_per_call: int,
                 max_groups_in_flight: int):
        self.gate = gate
        self.trajectory = trajectory
        self.settings = settings
        self.discards = discards
        self.stats = StageStats("trajectory")
        self.staleness = Counter()
        """Samples appended by their staleness when they became visible."""
        self.appended = 0
        self.episodes_appended = 0
        """Multi-turn episodes appended (each also counted in ``appended``), and their turns."""
        self.episode_turns = 0
        self._appends = Coalescer(self._append_call, split_on=one_group_may_be_why, max_items=max_groups_per_call,
                                  concurrency=2 if max_groups_per_call > 1 else max_groups_in_flight,
                                  name="Append call")

    async def append(self, item: PromptItem, task: reward_pb2.Task, group: GroupSamples,
                     ref_log_probs: tensor_pb2.RaggedTensor,
                     rewards: reward_pb2.ComputeRewardsResponse, group_id: int, filtered: bool) -> tuple[int, bool]:
        """Append the group, or store it as ``filtered`` (or find it stored before a restart); returns its
        start version and whether it is stored as filtered (as it was then, for one stored before)."""
        start_version = group.start_version
        now = max(self.gate.version, group.end_version)
        if not filtered and self.gate.too_stale_to_append(start_version, now):
            # Its prompt is generated again on the current weights; counted.
            self.discards.add(len(group), int(group.responses.lengths.sum()))
            raise Discard(f"too stale: started at v{start_version}, now v{now}, "
                          f"max_staleness {self.gate.max_staleness}")
        rows = group_message(group=group, ref_log_probs=ref_log_probs, rewards=rewards, group_id=group_id,
                             prompt_id=item.prompt_id, query=item.query, task=task)
        trace = tracing.traceparent()  # the group's: the trajectory service puts lease and ack spans in it
        async with self.stats.track():
            attempt = 0
            while True:
                try:
                    with tracing.span("append", {"rlfleet.filtered": filtered}):
                        appended, filtered = await self._appends.submit((item.append_key, rows, filtered, trace),
                                                                        rows.ByteSize())
                    break
                except ResourceExhaustedError:
                    # Backpressure: the buffer is full until the trainer catches up.
                    await asyncio.sleep(min(2.0, 0.05 * 2 ** min(attempt, 6)))
                    attempt += 1
        if not appended:  # appended before a restart: the earlier group stands
            log.info("group already appended", extra={"prompt_id": item.prompt_id, "key": item.append_key})
            return start_version, filtered
        if filtered:
            return start_version, True
        self.appended += len(group)
        if group.environment_rewards is not None:
            self.episodes_appended += len(group)
            self.episode_turns += int(group.turn_versions.lengths.sum())
        self.staleness[now - start_version] += len(group)  # staleness when it became visible
        return start_version, False

    async def _append_call(self, groups: list[tuple[str, tensor_pb2.TensorDict, bool, str]]
                           ) -> list[tuple[bool, bool]]:
        """One Append for the groups that queued (``_appends``: key, rows, filtered, traceparent); for each,
        whether it was stored (False: it was appended before, under its key) and whether it is stored as
        filtered."""
        request = batched_calls.append_request([group[:3] for group in groups], self.gate.version,
                                               [group[3] for group in groups])
        reply = await call_with_retry(self.trajectory.Append, request, method="Append", settings=self.settings)
        for field in ("duplicate_groups", "filtered_groups"):
            if len(getattr(reply, field)) != len(groups):
                raise WireError(field, f"the trajectory service answered {len(getattr(reply, field))} "
                                       f"for {len(groups)} groups")
        return [(not duplicate, filtered) for duplicate, filtered in zip(reply.duplicate_groups, reply.filtered_groups)]

    def staleness_histogram(self) -> list[int]:
        if not self.staleness:
            return []
        return [self.staleness.get(i, 0) for i in range(max(self.staleness) + 1)]
