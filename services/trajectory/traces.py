"""Each buffered group's trace: where its ``lease`` and ``ack`` spans go (``docs/guides/tracing.md``).

The collector appends every group with the traceparent of the trace it was made in
(``AppendRequest.trace_contexts``); this keeps them, in memory only (a restarted service adds no
spans for the groups it held before), and emits a span into each group's trace when a batch holding
it is leased, acked or nacked. Bounded: the oldest groups' contexts are forgotten first.
"""

from __future__ import annotations

import collections
from typing import Sequence

from rlfleet.services.common import tracing
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.trajectory.appends import REQUIRED_KEYS, int64_column
from rlfleet.v1 import tensor_pb2

MAX_GROUPS = 1 << 16
"""Groups whose context is kept (a few hundred bytes each)."""


def group_order(msg: tensor_pb2.TensorDict) -> list[int]:
    """The group ids of ``msg``, in the order of each group's first row (the order of ``group_keys``)."""
    count = msg.batch_size[0] if len(msg.batch_size) == 1 else 0
    return list(dict.fromkeys(int64_column(msg, REQUIRED_KEYS[0], count)))


class GroupTraces:
    def __init__(self, max_groups: int = MAX_GROUPS):
        self._max_groups = max_groups
        self._contexts: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._leases: dict[str, list[int]] = {}
        """Lease id -> the traced group ids of its batch."""

    def appended(self, msg: tensor_pb2.TensorDict, trace_contexts: Sequence[str]) -> None:
        """Remember the contexts of ``msg``'s groups (checked: one per group, even untraced)."""
        if not trace_contexts:
            return
        group_ids = group_order(msg)
        if len(trace_contexts) != len(group_ids):
            raise InvalidArgument(f"trace_contexts: {len(trace_contexts)} for the {len(group_ids)} groups in "
                                  "trajectories; give one per group, in the order of group_keys")
        if not tracing.enabled():
            return
        for group_id, context in zip(group_ids, trace_contexts):
            if context:
                self._contexts[group_id] = context
        while len(self._contexts) > self._max_groups:
            self._contexts.popitem(last=False)

    def leased(self, lease_id: str, batch: tensor_pb2.TensorDict, started_ns: int, reader: str) -> None:
        """A ``lease`` span in the trace of each traced group of ``batch`` (it took since ``started_ns``)."""
        if not self._contexts:
            return
        group_ids = [g for g in group_order(batch) if g in self._contexts]
        if not group_ids:
            return
        self._leases[lease_id] = group_ids
        for group_id in group_ids:
            tracing.record("lease", self._contexts[group_id], started_ns,
                           {"rlfleet.lease_id": lease_id, "rlfleet.reader": reader,
                            "rlfleet.batch_size": int(batch.batch_size[0]), "rlfleet.groups": len(group_ids)})

    def settled(self, lease_id: str, kind: str, started_ns: int, applied: bool) -> None:
        """An ``ack`` (or ``nack``) span in the trace of each traced group of the lease."""
        group_ids = self._leases.pop(lease_id, ())
        for group_id in group_ids:
            if (context := self._contexts.get(group_id)) is not None:
                tracing.record(kind, context, started_ns, {"rlfleet.lease_id": lease_id, "rlfleet.applied": applied})

    def forget_leases(self, lease_ids: Sequence[str]) -> None:
        """Leases released without an ack (their reader left, or they expired): no span, no memory."""
        for lease_id in lease_ids:
            self._leases.pop(lease_id, None)
