"""A weight push staged on a generation replica: validated, its bytes where the worker can map them.

The first phase of a push. Whatever the transport, the bytes end up in one
shared-memory segment that the vLLM worker maps (``transfer.py``), and the
apply is the same for all:
- grpc: the service creates a segment and writes the chunks into it as they arrive;
- shm: the sender's segment is opened where it lies (same host);
- nccl: the service creates a segment and its vLLM workers receive the
  trainer's broadcast into it (``GenerationEngine.receive_nccl``).
The manifest is checked against the checkpoint (names, dtypes, shapes) and
its size against a multiple of the checkpoint's before the segment is
allocated, so the segment is bounded by the model's size. A delta push
(``rlfleet.wire.weight_delta``) is checked against the weights the replica
keeps instead (``kept_weights.py``): its tensors located there, its bytes
staged alone; the commit patches the kept weights and loads from them.
Nothing touches the engine until the commit; ``close()`` releases the segment
(and unlinks the one this service created) whether or not it was applied.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from rlfleet.services.common.errors import Aborted, FailedPrecondition, InvalidArgument, ResourceExhausted
from rlfleet.services.common.watermark import POLL_SECONDS, Watermark
from rlfleet.services.common.weight_stream import WeightPush, open_offered_segment
from rlfleet.services.generation.kept_weights import KeptWeights
from rlfleet.services.generation.lora_adapter import LoraAdapterConfig, validate_adapter
from rlfleet.services.generation.push_validation import TensorSpec, validate_manifest
from rlfleet.v1 import weights_pb2
from rlfleet.wire import shm, weight_delta
from rlfleet.wire.dtypes import dtype_name


@dataclass
class StreamedLoad:
    """A full push loaded into the paused engine as its bytes arrive (``WeightSwaps.stream``): what its
    commit or rollback needs, and what it holds until then (the swap lock, a share of the kept weights
    it rolls back to, the watermark)."""

    watermark: Watermark
    kept: KeptWeights
    task: asyncio.Future | None = None
    """The load (``WeightSwaps._load_streamed``): done once every byte is in the engine, or it stopped."""
    mode: str = ""
    started: float = field(default_factory=time.monotonic)
    locked: bool = False
    """It holds the swap lock (from before the pause to the commit or the rollback)."""
    shares_kept: bool = False
    paused: bool = False
    touched: bool = False
    """The engine's weights were written (a load began): a rollback loads the kept ones."""
    committed: bool = False
    ended: bool = False

    def end(self, lock: asyncio.Lock) -> None:
        """Let go of what it holds (once)."""
        if self.ended:
            return
        self.ended = True
        self.watermark.close()
        if self.shares_kept:
            self.kept.shares -= 1
            self.kept.release()
        if self.locked:
            lock.release()


@dataclass
class StagedPush:
    push: WeightPush
    transport: str
    resync: bool
    manifest: weights_pb2.WeightManifest
    segment: shm.Segment | None = None
    nccl: dict[str, Any] | None = field(default=None)
    delta: list[weight_delta.Span] | None = None
    """A delta push: its tensors located in the kept weights it patches."""
    loads_from: KeptWeights | None = None
    """Set at a delta's commit: the kept weights it patched, which the worker loads from."""
    adapter: tuple[LoraAdapterConfig, list[str]] | None = None
    """A LoRA adapter push: its config and its tensors' names in peft's form."""
    streamed: StreamedLoad | None = None
    """Loaded into the engine as its bytes arrive (``streamed_apply``)."""
    arriving: Watermark | None = None
    """An shm push offered while its sender still writes the segment: the sender's watermark (``follow``)."""
    applying: asyncio.Future | None = None
    """Its apply, once begun (``WeightSwaps.apply``): it runs to its end even if the call goes, and ``close``
    waits for it (it reads the segment)."""

    @classmethod
    def begin(cls, manifest: weights_pb2.WeightManifest, checkpoint: dict[str, TensorSpec],
              max_bytes: int, kept: weights_pb2.WeightManifest | None = None) -> "StagedPush":
        """Validate ``manifest`` (which ``push_rules.check_manifest`` passed) against the checkpoint (a delta:
        against ``kept``, the full manifest of the weights it patches; an adapter: as an adapter of the
        checkpoint's linear layers) and prepare where its bytes go.

        Names, dtypes and shapes are checked against the served model first, then
        the size against ``max_bytes``: only a push that passes both is given memory."""
        delta, adapter = None, None
        if manifest.HasField("lora"):
            config = LoraAdapterConfig(rank=manifest.lora.rank, alpha=manifest.lora.alpha,
                                       target_modules=tuple(manifest.lora.target_modules))
            push = WeightPush.from_manifest(manifest, max_bytes)
            adapter = (config, validate_adapter(push.names, push.dtypes, push.shapes, checkpoint, config))
        elif weight_delta.is_delta(manifest):
            push = WeightPush.from_manifest(manifest, max_bytes)  # dtypes and shapes well-formed first
            delta = weight_delta.spans(manifest, kept)
        else:
            validate_manifest(manifest, checkpoint)
            push = WeightPush.from_manifest(manifest, max_bytes)
        source = manifest.WhichOneof("source")
        staged = cls(push=push, transport=source or "grpc", resync=manifest.resync, manifest=manifest, delta=delta,
                     adapter=adapter)
        if source == "shm":
            staged.segment = open_offered_segment(manifest, push.total_bytes, "at this replica")
            if manifest.shm.watermark_path:  # still being written: followed (``follow``)
                try:
                    staged.arriving = Watermark.offered(manifest.shm.watermark_path)
                except ValueError as err:
                    staged.close()
                    raise InvalidArgument(f"manifest.shm.watermark_path: {err}") from None
                except OSError as err:
                    staged.close()
                    raise FailedPrecondition(f"{shm.SHM_UNAVAILABLE} at this replica: its watermark: {err}") from None
                return staged
            push.add_all(staged.segment.buffer)  # the bytes are all there (checksummed if asked)
            return staged
        if source == "nccl":
            rendezvous = manifest.nccl
            staged.nccl = dict(master_address=rendezvous.master_address, master_port=rendezvous.master_port,
                               world_size=rendezvous.world_size, rank_offset=rendezvous.rank_offset,
                               packed=rendezvous.packed)
        try:
            staged.segment = shm.create_segment(push.total_bytes)
        except OSError as err:
            raise ResourceExhausted(f"cannot stage a {push.total_bytes}-byte push in {shm.SHM_DIR}: "
                                    f"{err.strerror} (raise the container's shm_size)") from None
        if staged.nccl is None:
            push.attach_sink(staged.segment.buffer)  # grpc and relay: the chunks land here
        return staged

    @property
    def version(self) -> int:
        return self.push.version

    @property
    def mode(self) -> str:
        return self.push.mode

    def verify(self) -> int:
        """Check the staged bytes against the manifest's fingerprints (``WeightPush.verify``): the tensors
        checked; INVALID_ARGUMENT naming those that differ."""
        return self.push.verify(self.segment.as_uint8())

    def update_info(self, verify: bool = False) -> dict[str, Any]:
        """What the worker engine (``transfer.RlfleetUpdateInfo``) needs to load the push (``verify``: and to
        check what it loaded)."""
        if self.loads_from is not None:  # a delta, patched into the kept weights: their layout, what changed
            return self.loads_from.update_info([span.name for span in self.delta or ()], verify)
        info: dict[str, Any] = dict(
            names=list(self.push.names),
            dtype_names=[dtype_name(d) for d in self.push.dtypes],
            shapes=[list(s) for s in self.push.shapes],
            total_bytes=self.push.total_bytes, verify=verify, fingerprints=list(self.push.fingerprints))
        # Our own descriptor, not the name: the trainer may unlink the name (a cut push)
        # between the stage and the commit; the worker is our child and opens it through /proc.
        info["shm_path"] = self.segment.fd_path
        return info

    async def follow(self) -> None:
        """An shm push offered as it is written (``arriving``): the sender's watermark followed until every
        byte is in the segment (``push.received`` moves with it, and a streamed load's own watermark).
        ABORTED if the sender gives up first."""
        arriving, push = self.arriving, self.push
        while True:
            arrived = min(arriving.arrived, push.total_bytes)
            if arrived > push.received:
                push.received = arrived
                if push.progress is not None:
                    push.progress(arrived)
            if arrived == push.total_bytes:
                return
            if arriving.cut and arriving.arrived == arrived:
                raise Aborted(f"the sender of version {push.version} gave up after {arrived} of {push.total_bytes} "
                              f"bytes; nothing applied")
            await asyncio.sleep(POLL_SECONDS)

    def close(self) -> None:
        if self.applying is not None and not self.applying.done():
            self.applying.add_done_callback(lambda _: self.close())
            return
        self.push.sink = None
        self.push.progress = None
        if self.arriving is not None:
            self.arriving.close()
            self.arriving = None
        if self.segment is not None:
            self.segment.close()  # unlinks only the segment this service created
            self.segment = None
