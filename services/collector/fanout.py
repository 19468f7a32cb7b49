"""Weight fan-out: one trainer push, staged on every generation replica, then committed.

The control plane stays here; the bytes take the fastest road each replica
accepts (``transports.py``). A push runs in two phases:

1. **Stage.** The bytes come to lie in one shared-memory segment: the
   trainer's (shm, mapped where it lies) or the collector's own (grpc: the
   chunks are written into it as they arrive and checked). Every replica is
   then offered that segment and maps the very same pages; a replica that
   cannot (another host or IPC namespace) gets the bytes as grpc chunks read
   from it, and from then on gets a grpc push's chunks forwarded as they
   arrive. Each replica answers STAGED. The segment is also spooled (``spool.py``:
   files, or the collector's database) for re-syncing replicas later, beside
   the staging: off the commit's path for files; the database's spool must
   hold every byte before the version commits, in one transaction with it.
2. **Commit.** Once the trainer's bytes are complete and verified (the push is
   *decided*), every staged replica is told to apply; the version commits
   (durably, in the collector's database) when they applied. From the decision on, the
   push completes even if the trainer goes away, so a trainer's cut can never
   leave an engine ahead of the collector.

A delta push (only the tensors that changed, ``rlfleet.wire.weight_delta``) runs the same two
phases: it must be on the committed version, whose bytes the spool holds (``_delta_base``; else
FAILED_PRECONDITION and the SDK sends a full push), and is spooled patched into them. A replica
that cannot take it (not at the base, or keeping no weights) answers FAILED_PRECONDITION: it leaves
rotation, and the monitor re-syncs it with the spool's full copy.

A rolling push (``WeightManifest.strategy``, or the collector's ``update_strategy``) stages the same
way, but is committed a few replicas at a time while the others serve, admission open
(``rolling.py``).

Before the decision, any failure (trainer cut, bad bytes) cancels every
replica call, and replicas discard what they staged. A replica found ahead of
the committed version (the collector died mid-commit) is rolled back from
the spool by the replica monitor.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import grpc

from rlfleet.choices import SWAP_MODES, UPDATE_STRATEGIES
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.metrics import WEIGHT_PUSH_SENT_BYTES
from rlfleet.services.collector.replicas import Replica, ReplicaPool
from rlfleet.services.collector.rolling import RollingSettings, RollingUpdate
from rlfleet.services.collector.spool import DatabaseSpool, DatabaseSpoolWrite, FileSpool, FileSpoolWrite
from rlfleet.services.collector.spool_writer import SpoolWriter
from rlfleet.services.collector.transports import ReplicaOutcome, ReplicaPush
from rlfleet.services.common import tracing
from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument, OutOfRange, ResourceExhausted, Unavailable
from rlfleet.services.common.relay import Relay, name_downstream
from rlfleet.services.common.watermark import Watermark
from rlfleet.services.common.weight_stream import MAX_POLICY_VERSION, PushReceiver, WeightPush, open_offered_segment
from rlfleet.v1 import generation_pb2, weights_pb2
from rlfleet.wire import shm, weight_delta
from rlfleet.wire.push_rules import check_manifest, is_rolling

log = logging.getLogger("rlfleet.collector.fanout")
PROBE_SECONDS = 2.0
"""How long a push waits for a replica out of rotation to answer before leaving it out."""


@dataclass
class PushOutcome:
    version: int
    replicas: list[ReplicaOutcome]
    received_bytes: int
    seconds: float


@dataclass(frozen=True)
class SpoolWrite:
    """A push's spool write, beside its staging: the spool's handle for this version and whether it copied
    every byte (``copied``, set by the writer)."""

    spool: FileSpoolWrite | DatabaseSpoolWrite
    copied: asyncio.Future

    async def manifest(self) -> weights_pb2.WeightManifest | None:
        """The manifest a database spool switches to with the version, once every byte is there; None while it
        could not copy them (the spool keeps the version it has)."""
        return self.spool.manifest if await self.copied else None


@dataclass
class RunningRelay:
    """A push's relay (``relay.py``) and the task sending it."""

    relay: Relay
    task: asyncio.Task
    counted: bool = False

    def cancel(self) -> None:
        """Stop sending (a relay that ended is left as it is); what it sent goes to the egress metric, once."""
        if not self.task.done():
            self.task.cancel()
        if not self.counted:
            self.counted = True
            WEIGHT_PUSH_SENT_BYTES.labels(transport="relay").inc(self.relay.sent_bytes)


@dataclass
class PushCommit:
    """What a push brings to its commit: the replica calls (``streams``), those that staged it, the push,
    when it started, the decision the spool writer waits for (none without a spool write), the spool write
    (a database spool commits with the version), and whether it rolls out a few replicas at a time."""

    streams: list[ReplicaPush]
    staged: list[ReplicaPush]
    push: WeightPush
    started: float
    decision: asyncio.Future | None = None
    spool_write: SpoolWrite | None = None
    rolling: bool = False


class WeightFanout:
    """Receives pushes from the trainer, stages and commits them on every replica, keeps the spool."""

    def __init__(self, pool: ReplicaPool, gate: VersionGate, spool_dir: Path | None, max_push_bytes: int | None,
                 on_commit: Callable[[int, weights_pb2.WeightManifest | None], Awaitable[None]] | None = None,
                 on_fatal=None, swap_mode: str = "", spool: DatabaseSpool | None = None,
                 update_strategy: str = "pause_all", rolling: RollingSettings = RollingSettings(), relay: bool = True,
                 join_from_peers: bool = True):
        self.pool = pool
        self.relay = relay
        self.join_from_peers = join_from_peers
        """A re-synced replica takes the full weights from a serving peer first (``_from_peer``), the spool after."""
        """Relay pushes through the replicas that refuse our segments (``relay.py``), else a copy to each."""
        self.swap_mode = swap_mode
        """The run's swap mode (``CollectorConfig.swap_mode``): overrides each push's; "" leaves it."""
        self.update_strategy = update_strategy
        """How a push that names no strategy is rolled out: "pause_all" or "rolling"."""
        self.rolling_settings = rolling
        self.rolling: RollingUpdate | None = None
        """The rolling update in progress, else the last one (status)."""
        self.gate = gate
        self.spool: FileSpool | DatabaseSpool = spool if spool is not None else FileSpool(Path(spool_dir))
        """Where pushes are spooled for re-syncs: ``spool`` (the database's), else files in ``spool_dir``."""
        self.max_push_bytes = max_push_bytes
        self.on_commit = on_commit
        """Makes a version the committed one, durably (with the spool's manifest when the spool commits with
        the version); raises OSError or Unavailable when it could not."""
        self.on_fatal = on_fatal
        """Told of a background part of a push that raised what nobody expected: the service fails."""
        self._lock = asyncio.Lock()  # one push (or re-sync) at a time: versions are monotone
        self.pushes = 0  # pushes and re-syncs begun: a probe that straddled one is not trusted
        self._staging = shm.SegmentCache()  # where grpc pushes land, kept between pushes
        self.spool_writer = SpoolWriter(self.spool, self._release, on_fatal)
        """Each push's bytes spooled beside its staging (off the commit's path for files)."""

    @property
    def spool_error(self) -> str:
        """Why the spool does not hold the committed version (``Status.spool_error``); "" when current."""
        return self.spool_writer.error

    async def push(self, messages: AsyncIterator[tuple[str, object]]) -> PushOutcome:
        """``messages`` yields ("manifest", WeightManifest) then, for grpc pushes, ("chunk", WeightChunk)."""
        async with self._lock:
            self.pushes += 1
            await self.spool_writer.done()
            # Traced: one span per push, with a stage and a commit span per replica under it.
            with tracing.span("push weights"):
                return await self._push(messages)

    async def targets(self, manifest: weights_pb2.WeightManifest) -> list[Replica]:
        """The replicas a push goes to: those in rotation, and those out of rotation that answer now
        (a push is the way back for a replica the spool cannot re-sync; it takes the push as a
        re-sync, whatever version it serves). Never refused while one of them answers."""
        others = [r for r in self.pool.replicas if not r.healthy]
        answered = await asyncio.gather(*(self.pool.probe(r, timeout=PROBE_SECONDS) for r in others))
        back = [r for r, version in zip(others, answered) if version is not None]
        targets = self.pool.healthy() + back
        if not targets:
            raise Unavailable(f"no generation replica answers (of {len(self.pool.replicas)}: "
                              + "; ".join(f"{r.address}: {r.last_error or 'not serving'}" for r in others) + ")")
        return targets

    def _settle(self, manifest: weights_pb2.WeightManifest) -> bool:
        """The trainer's manifest checked (a WireError is INVALID_ARGUMENT, by the interceptor), its swap mode
        and version settled; whether it rolls out a few replicas at a time."""
        default_strategy = UPDATE_STRATEGIES[self.update_strategy]
        check_manifest(manifest, "trainer", default_strategy)
        run_id = self.pool.run.run_id
        if run_id and not manifest.HasField("lora"):
            raise FailedPrecondition(f"run {run_id} shares its generation replicas with other runs: it pushes LoRA "
                                     f"adapters (push_adapter); a run that trains full weights needs replicas of "
                                     f"its own")
        self.pool.run.label(manifest)
        rolling = is_rolling(manifest, default_strategy)
        if rolling:
            # Each replica is drained before it switches: what is left running there is aborted (and
            # generated again), never continued on the new weights.
            manifest.mode = weights_pb2.UPDATE_MODE_ABORT
        elif self.swap_mode:
            manifest.mode = SWAP_MODES[self.swap_mode]  # the SDK's names: docs/guides/off-policy.md, Weight-swap modes
        if manifest.version == 0:
            if self.gate.version >= MAX_POLICY_VERSION:
                raise OutOfRange(f"manifest.version: no version is left after {self.gate.version} "
                                 f"(the largest policy version is {MAX_POLICY_VERSION})")
            manifest.version = self.gate.version + 1
        if manifest.version <= self.gate.version:
            raise FailedPrecondition(
                f"weights version {manifest.version} is not newer than current {self.gate.version}")
        return rolling

    async def _push(self, messages: AsyncIterator[tuple[str, object]]) -> PushOutcome:
        started = time.monotonic()
        receiver = PushReceiver(messages)
        manifest = await receiver.manifest()
        rolling = self._settle(manifest)
        push = WeightPush.from_manifest(manifest, self.push_limit())
        tracing.set_attributes({"rlfleet.policy_version": manifest.version, "rlfleet.bytes": push.total_bytes,
                                "rlfleet.source": manifest.WhichOneof("source") or "grpc",
                                "rlfleet.delta": weight_delta.is_delta(manifest)})
        spooled = await self._spooled_manifests(manifest)
        source = manifest.WhichOneof("source")
        if source == "nccl":
            return await self._push_nccl(manifest, push, started)
        if source == "shm":
            segment = open_offered_segment(manifest, push.total_bytes, "at the collector")
        else:
            segment = self._staging_segment(push.total_bytes)
            push.attach_sink(segment.buffer)
        handed_off = False
        relay = watermark = None
        try:
            replicas = await self.targets(manifest)
            spool = self.spool.begin(manifest, spooled)
            # Replicas known to live elsewhere get the bytes as they arrive: relayed from one to the next
            # (one copy from here), or (``relay`` off, or a replica that cannot take a relay) each a copy
            # of a grpc push's chunks. Those on this host are offered the segment: as it is written, with
            # its watermark, to those that follow one (they load the bytes as they arrive); the others
            # once it holds every verified byte (shm: right away).
            relayed = [r for r in replicas if r.shm_refused and r.relays and self.relay]
            remote = [r for r in replicas if source is None and r.shm_refused and r not in relayed]
            following = [r for r in replicas if source is None and r.follows_segments and r not in relayed
                         and r not in remote]
            if following:
                watermark = Watermark.create()
                push.progress = watermark.advance
            if relayed:
                relay, streams = self._relay(manifest, push, segment, relayed)
            else:
                streams = []
            streams += [ReplicaPush.start(r, _offered(manifest, r), self.pool.settings, None) for r in remote]
            streams += [ReplicaPush.start(r, _offered(manifest, r), self.pool.settings, segment, watermark)
                        for r in following]
            try:
                if source == "shm":
                    await asyncio.to_thread(push.add_all, segment.buffer)
                    push.finish()
                    if relay is not None:
                        relay.relay.moved()
                else:
                    await receiver.chunks(push, forward=self._forward(streams, relay) if streams else None)
                    await receiver.end()
            except BaseException:
                if watermark is not None:
                    watermark.cut_off()  # the replicas following the segment stop loading it
                for s in streams:
                    s.cancel()
                if relay is not None:
                    relay.cancel()
                await spool.discard()
                raise
            # Every byte is here and verified: the push is decided.
            streams += [ReplicaPush.start(r, _offered(manifest, r), self.pool.settings, segment)
                        for r in replicas if r not in relayed and r not in remote and r not in following]
            handed_off = True  # the spool writer closes the segment once it copied it
            return await _finish_shielded(_closing(self._decide(streams, push, spool, started, segment, rolling,
                                                                relay), watermark))
        finally:
            if not handed_off:
                self._release(segment)
                if watermark is not None:
                    watermark.close()

    def _relay(self, manifest: weights_pb2.WeightManifest, push: WeightPush, segment: shm.Segment,
               replicas: list[Replica]) -> tuple[RunningRelay, list[ReplicaPush]]:
        """Each of ``replicas`` stages the push on its own call, its bytes relayed through all of them in
        the pool's order, starting now: the relay sends what ``segment`` holds as it arrives."""
        push_id = uuid.uuid4().hex
        streams = []
        for replica in replicas:
            offered = weights_pb2.WeightManifest()
            offered.CopyFrom(_offered(manifest, replica))
            offered.relay.push_id = push_id
            streams.append(ReplicaPush.start(replica, offered, self.pool.settings, None))
        relay = Relay(push_id, push, segment.buffer, [r.address for r in replicas], self.pool.settings,
                      tls_names={r.address: r.tls_name for r in replicas})
        log.info("relaying version %d through %d replicas: %s", push.version, len(replicas),
                 " -> ".join(relay.downstream))
        task = asyncio.ensure_future(_relay_and_retry(relay))
        task.add_done_callback(_fail_unreached(streams))
        return RunningRelay(relay, task), streams

    @staticmethod
    def _forward(streams: list[ReplicaPush], relay: RunningRelay | None):
        """What each of a grpc push's verified chunks goes on to: the relay, and a copy to each stream
        that is not relayed."""
        copies = [s for s in streams if s.transport == "grpc"]

        async def forward(chunk: weights_pb2.WeightChunk) -> None:
            if relay is not None:
                relay.relay.moved()
            if copies:
                await asyncio.gather(*(s.send_chunk(chunk) for s in copies))
        return forward

    async def _spooled_manifests(self, manifest: weights_pb2.WeightManifest) -> list[weights_pb2.WeightManifest]:
        """What the spool holds now (``manifests()``), which a delta patches and an adapter sits on. A delta
        push gets FAILED_PRECONDITION (the SDK then sends a full push) unless it is on the committed
        version and the spool holds that version's weights (not an adapter's)."""
        if not weight_delta.is_delta(manifest):
            try:
                return await self.spool.manifests()
            except Unavailable:
                return []  # the database is away: this push's spool write fails too
        base = manifest.delta.base_version
        if base != self.gate.version:
            raise FailedPrecondition(f"delta push on version {base}: the committed version is {self.gate.version}; "
                                     f"send a full push")
        spooled = await self.spool.manifests()
        head = spooled[-1] if spooled else None
        if head is None or head.version != base or self.spool_error or head.HasField("lora"):
            held = "an adapter" if head is not None and head.HasField("lora") else \
                self.spool_error or "never spooled"
            raise FailedPrecondition(f"delta push on version {base}: the collector's spool does not hold that "
                                     f"version's weights ({held}); send a full push")
        weight_delta.spans(manifest, head)  # the delta fits the spooled base, or a WireError names what does not
        return spooled

    async def _decide(self, streams: list[ReplicaPush], push: WeightPush, spool, started: float,
                      segment: shm.Segment, rolling: bool, relay: RunningRelay | None = None) -> PushOutcome:
        decision = asyncio.get_running_loop().create_future()
        copied = asyncio.get_running_loop().create_future()
        self.spool_writer.start(spool, segment, decision, copied)
        try:
            try:
                staged = await self._stage(streams, push.version)
            finally:
                if relay is not None:  # every replica staged or failed: nothing is left for it to send
                    relay.cancel()
                    for stream in streams:
                        stream.sent_bytes += relay.relay.sent.get(stream.replica.address, 0)
            return await self._commit(PushCommit(streams, staged, push, started, decision, SpoolWrite(spool, copied),
                                                 rolling))
        finally:
            if not decision.done():
                decision.set_result(False)

    async def _stage(self, streams: list[ReplicaPush], version: int) -> list[ReplicaPush]:
        """The replicas that staged the push (a cancel discards it on every replica)."""
        try:
            staged_ok = await asyncio.gather(*(s.wait_staged() for s in streams))
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        staged = [s for s, ok in zip(streams, staged_ok) if ok]
        if not staged:
            await self._raise_nothing_staged(version, streams)
        return staged

    async def _commit(self, commit: PushCommit) -> PushOutcome:
        """Every staged replica applies (all at once behind a closed admission gate, or ``rolling``: a few
        at a time, admission open), then the version commits."""
        version, update = commit.push.version, None
        if commit.rolling:
            update = self.rolling = RollingUpdate(self.pool, self.rolling_settings, self.gate.version, version,
                                                  len(commit.staged))
            await self.gate.begin_rolling()
        else:
            await self.gate.begin_push()
        committed = None
        try:
            if update is None:
                await asyncio.gather(*(s.commit() for s in commit.staged))
            else:
                await update.run(commit.staged)
            outcomes = [s.outcome() for s in commit.streams]
            for stream, outcome in zip(commit.streams, outcomes):
                if not outcome.applied:
                    await self.pool.mark_failed(stream.replica, outcome.error)
            if not any(o.applied for o in outcomes):
                errors = "; ".join(f"{o.address}: {o.error}" for o in outcomes)
                raise Unavailable(f"no replica applied version {version}: {errors}")
            await self._record(commit, outcomes)
            if commit.decision is not None:
                commit.decision.set_result(True)
            committed = version
            for stream, outcome in zip(commit.streams, outcomes):
                if outcome.applied and not stream.replica.healthy:
                    await self.pool.mark_healthy(stream.replica, version)  # a push brought it back
                    log.info("replica %s back in rotation with version %d", stream.replica.address, version)
        finally:
            if update is None:
                await self.gate.end_push(committed)
            else:
                update.finish(committed is not None)
                await self.gate.end_rolling(committed)
        transports = sorted({o.transport for o in outcomes if o.applied})
        log.info("weights committed", extra={"version": committed, "bytes": commit.push.total_bytes,
                                             "applied": sum(o.applied for o in outcomes),
                                             "transports": transports})
        return PushOutcome(committed, outcomes, commit.push.total_bytes, time.monotonic() - commit.started)

    async def _record(self, commit: PushCommit, outcomes: list[ReplicaOutcome]) -> None:
        """The applied version made durable (``on_commit``) before the trainer (or a file spool) hears of it;
        a database spool's manifest switches with it, once every byte is there. Unavailable when it could not
        be: the replicas that applied run ahead of the committed version, out of rotation, rolled back from
        the spool (it still holds the previous version) by the monitor."""
        if self.on_commit is None:
            return
        version = commit.push.version
        try:
            manifest = None
            if commit.spool_write is not None and self.spool.commits_with_version:
                manifest = await commit.spool_write.manifest()
            await self.on_commit(version, manifest)
        except (OSError, Unavailable) as err:
            for stream, outcome in zip(commit.streams, outcomes):
                if outcome.applied:
                    await self.pool.mark_failed(stream.replica, f"applied version {version}, which "
                                                f"could not be made durable")
            raise Unavailable(f"version {version} was applied but could not be recorded durably at the "
                              f"collector ({err}); it stays at {self.gate.version}") from None

    async def _push_nccl(self, manifest: weights_pb2.WeightManifest, push: WeightPush,
                         started: float) -> PushOutcome:
        """The trainer broadcasts over NCCL (rank 0) to every worker of every healthy replica; each
        replica receives into a segment of its own (its stage), then applies from it like shm.

        The collector brokers the group (each replica's rank offset) and decides; the bytes never
        pass here, so an nccl push is not spooled (replicas that were down rejoin after the next
        shm or grpc push). The push is decided once every replica staged it."""
        rendezvous = manifest.nccl
        replicas = self.pool.require_any()
        offsets, world_size = nccl_rank_offsets(replicas)
        if rendezvous.world_size != world_size:
            raise FailedPrecondition(
                f"manifest.nccl.world_size is {rendezvous.world_size}, but the trainer and the "
                f"{sum(r.transfer_world_size for r in replicas)} workers of the {len(replicas)} healthy "
                f"replicas make {world_size}: read GetStatus again and retry")
        streams = []
        for replica, offset in zip(replicas, offsets):
            offered = weights_pb2.WeightManifest()
            offered.CopyFrom(manifest)
            offered.nccl.rank_offset = offset
            streams.append(ReplicaPush.start(replica, offered, self.pool.settings, None))
        staged = await self._stage(streams, push.version)
        push.received = push.total_bytes  # every staged replica holds every byte
        return await _finish_shielded(self._commit(PushCommit(streams, staged, push, started)))

    async def _raise_nothing_staged(self, version: int, streams: list[ReplicaPush]) -> None:
        outcomes = [s.outcome() for s in streams]
        errors = "; ".join(f"{o.address}: {o.error}" for o in outcomes)
        codes = {o.code for o in outcomes}
        # The same client error everywhere is the pusher's fault: replicas stay in rotation.
        if codes == {"FAILED_PRECONDITION"}:
            raise FailedPrecondition(f"no replica staged version {version}: {errors}")
        if codes == {"INVALID_ARGUMENT"}:
            raise InvalidArgument(f"no replica staged version {version}: {outcomes[0].error}")
        for stream in streams:
            await self.pool.mark_failed(stream.replica, stream.outcome().error)
        raise Unavailable(f"no replica staged version {version}: {errors}")

    def _staging_segment(self, size: int) -> shm.Segment:
        """Where a grpc push lands here: a segment the replicas on this host map as it is."""
        try:
            return self._staging.take(size)
        except OSError as err:
            raise ResourceExhausted(f"cannot stage a {size}-byte push in {shm.SHM_DIR} at the collector: "
                                    f"{err.strerror} (raise the collector container's shm_size)") from None

    def _release(self, segment: shm.Segment) -> None:
        """Done with a push's segment: ours is kept for the next grpc push, the trainer's let go."""
        if segment.owner:
            self._staging.keep(segment)
        else:
            segment.close()

    @property
    def busy(self) -> bool:
        """A push or re-sync is in flight: replicas' versions are moving."""
        return self._lock.locked()

    def close(self) -> None:
        self._staging.close()
        self.spool.close()

    # --- re-sync -------------------------------------------------------------
    def push_limit(self) -> int:
        """``max_push_bytes``, or the smallest limit the replicas reported (a replica would refuse more)."""
        if self.max_push_bytes is not None:
            return self.max_push_bytes
        reported = [r.max_push_bytes for r in self.pool.replicas if r.max_push_bytes]
        if not reported:
            raise Unavailable("no generation replica has reported its largest accepted push yet")
        return min(reported)

    async def resync(self, replica: Replica) -> bool:
        """Bring a replica that fell behind (or ran ahead) to the committed version, from the spool."""
        async with self._lock:
            self.pushes += 1
            await self.spool_writer.done()
            try:
                manifests = await self.spool.manifests()
            except Unavailable as err:
                log.warning("cannot re-sync %s: %s", replica.address, err)
                return False
            if not manifests or manifests[-1].version != self.gate.version:
                log.warning("cannot re-sync %s: the spool holds no bytes of version %d",
                            replica.address, self.gate.version)
                return False
            for manifest in manifests:  # an adapter after the weights it sits on
                manifest.mode = weights_pb2.UPDATE_MODE_ABORT
                manifest.resync = True
                self.pool.run.label(manifest)
                if self.join_from_peers and not manifest.HasField("lora"):
                    outcome = await self._from_peer(replica, manifest)
                    if outcome is not None:
                        continue
                segment = None
                try:
                    segment = await self.spool.load_segment(manifest)
                    stream = ReplicaPush.start(replica, manifest, self.pool.settings, segment)
                    if await stream.wait_staged():
                        await stream.commit()
                    outcome = stream.outcome()
                except (OSError, Unavailable) as err:
                    log.warning("re-sync of %s failed: %s", replica.address, err)
                    return False
                finally:
                    if segment is not None:
                        segment.close()
                if not outcome.applied:
                    log.warning("re-sync of %s failed: %s", replica.address, outcome.error)
                    return False
            replica.policy_version = manifest.version
            log.info("replica %s re-synced to version %d over %s", replica.address, manifest.version,
                     outcome.transport)
            return True


    async def _from_peer(self, replica: Replica, manifest: weights_pb2.WeightManifest) -> ReplicaOutcome | None:
        """``replica`` takes ``manifest``'s weights from a replica serving them (``ShareWeights``: a relayed push
        sent from the copy that peer keeps, while it serves on), staged and committed as any push (checked
        against the manifest's fingerprints). A peer in rotation keeps the weights of the committed version
        (an adapter since sits on them); one that does not answers FAILED_PRECONDITION. The outcome once one
        peer's applied; None when none could (none in rotation, or each failed): the spool's turn."""
        peers = [r for r in self.pool.replicas if r is not replica and r.healthy and r.relays]
        for peer in peers:
            push_id = uuid.uuid4().hex
            offered = weights_pb2.WeightManifest()
            offered.CopyFrom(manifest)
            offered.relay.push_id = push_id
            stream = ReplicaPush.start(replica, offered, self.pool.settings, None)
            request = generation_pb2.ShareWeightsRequest(push_id=push_id, version=manifest.version)
            name_downstream(request, [replica.address], {replica.address: replica.tls_name})
            share = asyncio.ensure_future(peer.stub.ShareWeights(
                request,
                metadata=self.pool.settings.metadata(),
                timeout=SHARE_SECONDS + manifest.total_bytes / SHARE_BYTES_PER_SECOND))
            stage = asyncio.ensure_future(stream.wait_staged())
            try:
                await asyncio.wait({stage, share}, return_when=asyncio.FIRST_COMPLETED)
                if not stage.done() and _share_failed(share, replica) is not None:
                    stream.cancel()  # the peer is done and the bytes never will be there: stop waiting for them
                await asyncio.wait({stage})  # ends False once cancelled (or with the read's CancelledError)
                if not stage.cancelled() and stage.exception() is None and stage.result():
                    await stream.commit()
                await asyncio.wait({share})
                why = _share_failed(share, replica) or ""
            finally:
                for task in (stage, share):
                    task.cancel()
                if not stream.applied:
                    stream.cancel()
            outcome = stream.outcome()
            if outcome.applied:
                log.info("replica %s joined at version %d from peer %s (%d bytes from it, none from the spool)",
                         replica.address, manifest.version, peer.address, manifest.total_bytes)
                return outcome
            log.warning("replica %s could not take version %d from peer %s (%s)", replica.address,
                        manifest.version, peer.address, outcome.error or why or "no reason given")
        return None


def _share_failed(share: asyncio.Future, replica: Replica) -> str | None:
    """Why a finished ``ShareWeights`` call did not bring ``replica`` the bytes; None if it did (or is running)."""
    if not share.done():
        return None
    if share.cancelled():
        return "its call was cancelled"
    error = share.exception()
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    if error is not None:
        return f"{type(error).__name__}: {error}"
    return "it cut the replica out" if replica.address in share.result().cut else None


SHARE_SECONDS = 60.0
SHARE_BYTES_PER_SECOND = 20e6
"""A peer's ``ShareWeights`` deadline: this much, plus the bytes at this (slow) rate; past it, the spool."""


async def _relay_and_retry(relay: Relay) -> list[str]:
    """``relay`` to its end; then the replicas a peer cut out (it could not reach them: they may still be
    reachable from here) get the bytes from here, relayed through them once more. The replicas the bytes
    never reached (their stage must fail: nothing else sends them the bytes)."""
    await relay.run()
    unreached = [address for address, _ in relay.cut]
    if relay.cut_after:
        log.warning("relay of version %d: %s cut out by a peer; sending from the collector", relay.push.version,
                    ", ".join(relay.cut_after))
        retry = Relay(relay.push_id, relay.push, relay.data, relay.cut_after, relay.settings, relay.chunk_bytes,
                      tls_names=relay.tls_names)
        retry.sent = relay.sent  # one count of what the collector sent
        await retry.run()
        unreached += retry.all_cut
    return unreached


def _fail_unreached(streams: list[ReplicaPush]):
    """A relay's done-callback: each replica the bytes never reached fails its stage now (a dead one's call
    breaks anyway; a live one that could not be reached would wait for them until the push's deadline)."""
    def done(task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        for stream in streams:
            if stream.replica.address in task.result():
                stream.fail("the relay could not reach it (see the relay's log)", "UNAVAILABLE")
    return done


def _offered(manifest: weights_pb2.WeightManifest, replica: Replica) -> weights_pb2.WeightManifest:
    """The manifest as a replica gets it: a replica out of rotation takes it as a re-sync (it may
    serve any version, even one that never committed)."""
    if replica.healthy:
        return manifest
    offered = weights_pb2.WeightManifest()
    offered.CopyFrom(manifest)
    offered.resync = True
    return offered


def nccl_rank_offsets(replicas: list[Replica]) -> tuple[list[int], int]:
    """Each replica's first NCCL rank and the group's world size: the trainer is rank 0, then
    every replica's workers (tensor x pipeline parallel) in order."""
    offsets, rank = [], 1
    for replica in replicas:
        if replica.transfer_world_size <= 0:
            raise FailedPrecondition(f"replica {replica.address} has not reported its worker count yet; retry")
        offsets.append(rank)
        rank += replica.transfer_world_size
    return offsets, rank


async def _closing(coroutine, watermark: Watermark | None):
    """``coroutine``'s result; ``watermark`` closed once it ended (the replicas following it are done)."""
    try:
        return await coroutine
    finally:
        if watermark is not None:
            watermark.close()


async def _finish_shielded(coroutine):
    """Run ``coroutine`` to the end even if the caller is cancelled (the push is decided)."""
    task = asyncio.ensure_future(coroutine)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                break
            cancelled = True
            log.warning("trainer went away after the push was decided: completing it")
    if cancelled:
        task.exception()  # retrieved: logged by the task if it failed
        raise asyncio.CancelledError
    return task.result()


__all__ = ["PushOutcome", "ReplicaOutcome", "WeightFanout"]
