"""A replica's side of relayed pushes (``rlfleet.services.common.relay``).

The collector's UpdateWeights call stages a relayed push (``manifest.relay``) and registers it here by
its push id; its bytes come in RelayWeights calls (from the collector or the replica before this one),
land in the staged segment, and are forwarded from there to the next replica as they arrive (a
``Relay`` of this replica's, started by the first call's header). The UpdateWeights call answers
STAGED once every byte is here and verified, as for chunks on its own stream; when it ends (applied,
discarded, cut), the push is unregistered and its forwarding stops.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from rlfleet.rpc.channel import ChannelSettings
from rlfleet.services.common.errors import Aborted, FailedPrecondition, NotFound
from rlfleet.services.common.relay import Arrivals, Relay
from rlfleet.services.generation.staging import StagedPush

REFUSALS_KEPT = 64


class RelayedPush:
    """One relayed push staged here: where its bytes land, who waits for them, where they go next."""

    def __init__(self, push_id: str, staged: StagedPush, settings: ChannelSettings):
        self.push_id, self.staged, self.settings = push_id, staged, settings
        self.closed = False
        self.relay: Relay | None = None
        self._forwarding: asyncio.Task | None = None
        self._arrivals = Arrivals()

    def moved(self) -> None:
        """Bytes arrived (or the push ended here): wake whoever waits for them."""
        self._arrivals.moved()
        if self.relay is not None:
            self.relay.moved()

    async def received(self) -> None:
        """Until every byte is here (then verified: ``WeightPush.finish``); ABORTED once discarded."""
        push = self.staged.push
        while not push.complete:
            if self.closed:
                raise Aborted(f"relayed push of version {push.version} discarded after {push.received} of "
                              f"{push.total_bytes} bytes")
            await self._arrivals.wait()
        push.finish()

    def forward(self, downstream: list[str], tls_names: dict[str, str]) -> None:
        """Forward the bytes to ``downstream`` (the first call's header: a later one, after its sender was
        cut out, names the same replicas after this one), checking the TLS names ``tls_names`` gives."""
        if self._forwarding is None and downstream and not self.closed:
            self.relay = Relay(self.push_id, self.staged.push, self.staged.segment.buffer, downstream, self.settings,
                               tls_names=tls_names)
            self._forwarding = asyncio.ensure_future(self.relay.run())

    async def forwarded(self) -> None:
        """Until every replica after this one holds every byte, or was cut out."""
        if self._forwarding is not None:
            await asyncio.shield(self._forwarding)
        if self.closed:
            raise Aborted(f"relayed push of version {self.staged.version} discarded here")

    def close(self) -> None:
        self.closed = True
        if self._forwarding is not None:
            self._forwarding.cancel()
        self.moved()


class RelayedPushes:
    """The relayed pushes staged on this replica, by push id."""

    def __init__(self, settings: ChannelSettings):
        self.settings = settings
        """What this replica presents to the peers it relays to (its ``upstream_*`` settings)."""
        self._pushes: dict[str, RelayedPush] = {}
        self._refused: OrderedDict[str, str] = OrderedDict()
        """The last ``REFUSALS_KEPT`` relayed pushes this replica refused to stage, and why: their bytes are
        refused for good (the relay goes on to the next replica at once, where it retries a NOT_FOUND)."""

    def open(self, staged: StagedPush) -> RelayedPush:
        push_id = staged.manifest.relay.push_id
        entry = self._pushes[push_id] = RelayedPush(push_id, staged, self.settings)
        return entry

    def refuse(self, push_id: str, why: str) -> None:
        """The collector's call for ``push_id`` was refused here (its manifest, the version): so are its bytes."""
        self._refused[push_id] = why
        while len(self._refused) > REFUSALS_KEPT:
            self._refused.popitem(last=False)

    def close(self, entry: RelayedPush) -> None:
        if self._pushes.get(entry.push_id) is entry:
            del self._pushes[entry.push_id]
        entry.close()

    def find(self, push_id: str) -> RelayedPush:
        """The push staged under ``push_id``: NOT_FOUND if none is (yet: the sender retries for a while, as
        the collector's call that stages it may come second), FAILED_PRECONDITION if its staging was refused."""
        entry = self._pushes.get(push_id)
        if entry is not None:
            return entry
        if push_id in self._refused:
            raise FailedPrecondition(f"relayed push {push_id!r} was refused here: {self._refused[push_id]}")
        raise NotFound(f"no relayed push {push_id!r} is staged here")


__all__ = ["RelayedPush", "RelayedPushes"]
