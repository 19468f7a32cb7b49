"""The weights a replica serves, kept as a push's bytes so that delta pushes can patch them.

After a full push applies, its segment is kept (``delta_pushes``): the one this service created
(grpc and nccl pushes) as it is, a sender's (shm) as a copy made off the swap's path. A delta push
(``rlfleet.wire.weight_delta``) is checked against it when staged, and at its commit patches it in
place and is loaded from it: only the layers holding a changed tensor are reloaded
(``transfer.loaded_with``), reading their unchanged siblings (q beside k and v) from here. A swap
that fails drops what is kept (its bytes may be ahead of the version served); the next push must then
be full, and the collector re-syncs the replica with one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from rlfleet.services.common.errors import FailedPrecondition
from rlfleet.v1 import weights_pb2
from rlfleet.wire import shm, weight_delta
from rlfleet.wire.dtypes import BY_WIRE
from rlfleet.wire.fingerprint import of_manifest

log = logging.getLogger("rlfleet.generation.kept_weights")


@dataclass
class KeptWeights:
    """Every tensor of ``manifest.version`` (its names, dtypes, shapes) in ``segment``, which we own."""

    manifest: weights_pb2.WeightManifest
    segment: shm.Segment | None
    shares: int = 0
    """Peers being sent these bytes (``WeightKeeper.shared``): the segment is closed once they are done."""
    dropped: bool = False

    @property
    def version(self) -> int:
        return self.manifest.version

    def update_info(self, changed: list[str] | None = None, verify: bool = False) -> dict[str, Any]:
        """What the worker engine (``transfer.RlfleetUpdateInfo``) needs to load these weights: every tensor,
        or the layers of ``changed`` (a delta patched in); ``verify``: and to check what it loaded."""
        tensors = self.manifest.tensors
        return dict(names=[spec.name for spec in tensors], dtype_names=[BY_WIRE[spec.dtype].name for spec in tensors],
                    shapes=[list(spec.shape) for spec in tensors], total_bytes=self.manifest.total_bytes,
                    shm_path=self.segment.fd_path, changed=changed, verify=verify,
                    fingerprints=of_manifest(self.manifest))

    def close(self) -> None:
        self.dropped = True
        self.release()

    def release(self) -> None:
        """Close the segment once dropped and no share holds it (idempotent)."""
        if self.dropped and not self.shares and self.segment is not None:
            self.segment.close()
            self.segment = None


class WeightKeeper:
    """What a replica keeps (``KeptWeights``), or None; the copy of a sender's segment in flight."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.kept: KeptWeights | None = None
        self.manifest: weights_pb2.WeightManifest | None = None
        """The full manifest of what is kept, or of the copy in flight (delta pushes stage against it)."""
        self._copying: asyncio.Future | None = None

    async def current(self) -> KeptWeights | None:
        """What is kept, once a copy in flight is done."""
        copying = self._copying
        if copying is not None:
            await asyncio.wait({copying})
        return self.kept

    def keep(self, version: int, manifest: weights_pb2.WeightManifest, segment: shm.Segment) -> None:
        """Keep a full push just applied; takes ``segment`` over (closes it when done with it). Ours is
        kept as it is; a sender's is copied on a thread, then closed (the sender may reuse its pages)."""
        self.drop()
        if not self.enabled:
            segment.close()
            return
        full = weights_pb2.WeightManifest(version=version, total_bytes=manifest.total_bytes)
        full.tensors.extend(manifest.tensors)
        self.manifest = full
        if segment.owner:
            self.kept = KeptWeights(full, segment)
            return
        copying = asyncio.ensure_future(asyncio.to_thread(_copy, full, segment))
        self._copying = copying
        copying.add_done_callback(self._copied)

    def _copied(self, copying: asyncio.Future) -> None:
        current = self._copying is copying
        if current:
            self._copying = None
        if copying.cancelled():
            return
        if copying.exception() is not None:
            log.warning("keeping the weights for delta pushes failed: %s", copying.exception())
            if current:
                self.manifest = None
            return
        if current:
            self.kept = copying.result()
        else:
            copying.result().close()  # dropped meanwhile

    @contextlib.asynccontextmanager
    async def shared(self, version: int):
        """The kept weights of ``version``, held while a peer is sent them (``ShareWeights``): dropped meanwhile,
        their segment closes once the share ends. FAILED_PRECONDITION if none of that version are kept."""
        kept = await self.current()
        if kept is None or kept.version != version or kept.dropped:
            held = f"keeps the weights of version {kept.version}" if kept is not None else "keeps no weights"
            raise FailedPrecondition(f"cannot share version {version}: this replica {held}"
                                     + ("" if self.enabled else " (delta_pushes is off)"))
        kept.shares += 1
        try:
            yield kept
        finally:
            kept.shares -= 1
            kept.release()

    def patch(self, kept: KeptWeights, manifest: weights_pb2.WeightManifest, spans: list[weight_delta.Span],
              delta: memoryview) -> None:
        """Apply a delta's bytes (its ``manifest``) to what is kept, fingerprints included (in place: a swap
        that then fails must ``drop``)."""
        weight_delta.patch(kept.segment.buffer, delta, spans)
        weight_delta.patch_fingerprints(kept.manifest, manifest)
        kept.manifest.version = manifest.version

    def drop(self) -> None:
        """Forget what is kept (a failed swap, or a full push replacing it); a copy in flight is closed
        when it ends."""
        self._copying = None
        self.manifest = None
        if self.kept is not None:
            self.kept.close()
            self.kept = None


def _copy(manifest: weights_pb2.WeightManifest, source: shm.Segment) -> KeptWeights:
    try:
        copy = shm.create_segment(source.size)
        try:
            copy.buffer[:] = source.buffer
        except BaseException:
            copy.close()
            raise
        return KeptWeights(manifest, copy)
    finally:
        source.close()
