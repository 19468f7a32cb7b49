"""Generation replicas: membership, least-loaded selection, failure handling, re-sync.

The members come from a ``Discovery`` source (``discovery.py``) through ``update``: a replica that
appears starts out of rotation, and the collector's replica monitor brings it in once it answers and
serves the committed version (re-synced from the spooled weights if it does not) — exactly the path
of a replica that failed a call and came back. One that disappears leaves the rotation at once; its
calls in flight finish (or fail over like any failed call) and its channel closes when the last ends.
Work goes to the healthy replica with the fewest samples outstanding (not calls: a group of 16 weighs
16 single samples), except that a group's later turns stay where its prefix is cached.

During a rolling update (``rolling.py``) replicas serve two versions: a replica being drained takes no
new work, and a request pinned to a version goes only to a replica serving it (``acquire(version=)``);
a drained replica that is the last to serve its version also waits for the groups pinned to it
(``hold_pin``) to end. ``VersionRetired`` when no replica in rotation serves a pinned version any more.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfleet.rpc.channel import ChannelSettings, aio_channel
from rlfleet.services.collector.discovery import Endpoint
from rlfleet.services.collector import metrics
from rlfleet.services.common.background import BackgroundTasks
from rlfleet.services.common.errors import Unavailable
from rlfleet.v1 import generation_pb2, generation_pb2_grpc, weights_pb2

log = logging.getLogger("rlfleet.collector.replicas")


@dataclass
class Replica:
    """One generation service endpoint."""

    address: str
    channel: grpc.aio.Channel = field(repr=False)
    stub: generation_pb2_grpc.GenerationServiceStub = field(repr=False)
    healthy: bool = False
    policy_version: int = 0
    in_flight: int = 0
    """Samples outstanding here (a Generate call of ``n`` samples counts ``n``)."""
    gone: bool = False
    """Discovery no longer lists it: out of rotation for good; its channel closes once idle."""
    failures: int = 0
    last_error: str = ""
    shm_refused: bool = False
    """It could not open a segment of ours (another host or IPC namespace): grpc pushes stream to it."""
    transfer_world_size: int = 0
    """Its inference workers (NCCL ranks in an nccl push), from its last probe."""
    max_push_bytes: int = 0
    """The largest push it accepts, from its last probe (0: not reported yet)."""
    relays: bool = False
    """It takes relayed pushes (``relay`` among its weight transports, from its last probe)."""
    tls_name: str = ""
    """The name its TLS certificate carries when that is not its address (a name resolved to one replica
    per IP): checked by whoever calls it, the relays and the peers that share weights with it too."""
    follows_segments: bool = False
    """It takes a segment still being written, with its watermark (``shm-watermark`` among its weight
    transports): a grpc push is offered to it as it arrives."""
    draining: bool = False
    """A rolling update is about to switch it: no new work (requests pinned to its version excepted,
    when it is the last replica serving that version)."""


class VersionRetired(Exception):
    """No replica in rotation serves the version a request is pinned to any more."""


@dataclass(frozen=True)
class ReplicaRun:
    """Which run this collector's calls are on the services runs share (``GenerateRequest.run_id``,
    ``WeightManifest.run_id``, ``ComputeRewardsRequest.run_id``) and its weight in the replicas' fair share:
    their own run ("") unless they are shared between runs (``shared_replicas``)."""

    run_id: str = ""
    share_weight: float = 0.0
    name: str = ""
    """The run's name (``run_name``), by which other runs' episodes ask for its policy (``players``)."""

    def generate_request(self, **fields) -> generation_pb2.GenerateRequest:
        """A Generate call of this run (``fields``: the rest of the request)."""
        return generation_pb2.GenerateRequest(run_id=self.run_id, run_name=self.name, share_weight=self.share_weight,
                                              **fields)

    def label(self, manifest: weights_pb2.WeightManifest) -> None:
        """A push of this run's weights names the run."""
        manifest.run_id, manifest.run_name = self.run_id, self.name

    def version(self, status: generation_pb2.GetEngineStatusResponse) -> int:
        """The run's version a replica serves (a named run it does not serve yet: 0, the base weights)."""
        if not self.run_id:
            return status.policy_version
        return next((run.policy_version for run in status.runs if run.run_id == self.run_id), 0)


class ReplicaPool:
    """The set of generation replicas this collector drives."""

    def __init__(self, settings: ChannelSettings, run: ReplicaRun = ReplicaRun()):
        self.settings = settings
        self.run = run
        """This collector's run on the replicas: what its requests, pushes and probes name."""
        self.replicas: list[Replica] = []
        self._changed = asyncio.Condition()
        self._closing = BackgroundTasks()
        self._turn = 0
        self.pins: collections.Counter[int] = collections.Counter()
        """Groups pinned to each version and still generating (``hold_pin``)."""

    async def update(self, endpoints: list[Endpoint]) -> tuple[list[Replica], list[Replica]]:
        """Make the members ``endpoints``: (the replicas added, out of rotation until the monitor
        brings them in; the replicas removed)."""
        wanted = {endpoint.address: endpoint for endpoint in endpoints}
        current = {replica.address for replica in self.replicas}
        added = [self._replica(endpoint) for address, endpoint in wanted.items() if address not in current]
        removed = [replica for replica in self.replicas if replica.address not in wanted]
        for replica in removed:
            replica.healthy, replica.gone = False, True
            metrics.REPLICA_OUTSTANDING.remove(replica.address)
            if replica.in_flight == 0:
                self._close(replica)
        self.replicas = [replica for replica in self.replicas if replica.address in wanted] + added
        if added or removed:
            await self._notify()
        return added, removed

    def _replica(self, endpoint: Endpoint) -> Replica:
        settings, tls_name = self.settings, ""
        if endpoint.tls_name and settings.tls and not settings.server_name:
            settings, tls_name = dataclasses.replace(settings, server_name=endpoint.tls_name), endpoint.tls_name
        channel = aio_channel(endpoint.address, settings)
        metrics.REPLICA_OUTSTANDING.labels(endpoint.address).set(0)
        return Replica(endpoint.address, channel, generation_pb2_grpc.GenerationServiceStub(channel), tls_name=tls_name)

    def _close(self, replica: Replica) -> None:
        self._closing.start(replica.channel.close(), f"close-channel-{replica.address}")

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    async def acquire(self, exclude: set[str] = frozenset(), timeout: float | None = None,
                      prefer: Replica | None = None, samples: int = 1, version: int | None = None) -> Replica:
        """``prefer`` while it is healthy and not excluded (an episode's group stays where its prefix is
        cached), else the healthy replica with the fewest samples outstanding (waits for one); counts
        ``samples`` on it until ``release``. ``version``: only a replica serving it (VersionRetired
        when none in rotation does); replicas being drained take no new work, but do take requests
        pinned to their version when no other replica serves it."""
        async def pick():
            async with self._changed:
                while True:
                    serving = self._serving(version)
                    if not serving and version is not None:
                        raise VersionRetired(f"no replica in rotation serves version {version} any more")
                    if any(r is prefer for r in serving) and prefer.address not in exclude:
                        return self._take(prefer, samples)
                    candidates = [r for r in serving if r.address not in exclude]
                    if not candidates and exclude:
                        candidates = serving  # all others are down: allow a retry anywhere
                    if candidates:
                        return self._take(self._least_loaded(candidates), samples)
                    await self._changed.wait()
        return await asyncio.wait_for(pick(), timeout)

    def _serving(self, version: int | None) -> list[Replica]:
        """The replicas that take a request pinned to ``version`` (None: any): healthy, serving it, not
        being drained unless none other serves it."""
        healthy = [r for r in self.replicas if r.healthy and (version is None or r.policy_version == version)]
        open_ = [r for r in healthy if not r.draining]
        return open_ if open_ or version is None else healthy

    def hold_pin(self, version: int) -> None:
        """A group pinned to ``version`` started: the last replica serving it drains only once it ended."""
        self.pins[version] += 1

    async def release_pin(self, version: int) -> None:
        self.pins[version] -= 1
        if self.pins[version] <= 0:
            del self.pins[version]
            await self._notify()

    async def drain(self, replica: Replica, deadline: float) -> bool:
        """Take ``replica`` out of new work and wait (until the monotonic ``deadline``) for what it runs
        to end, and, should it be the last replica serving its version, for the groups pinned to that
        version; whether it drained in time. ``undrain`` puts it back."""
        replica.draining = True
        version = replica.policy_version

        def drained() -> bool:
            others = [r for r in self.replicas if r is not replica and r.healthy and not r.draining
                      and r.policy_version == version]  # one draining (or applying) will not serve it
            return replica.in_flight == 0 and (bool(others) or self.pins[version] == 0)
        async with self._changed:
            self._changed.notify_all()
            try:
                await asyncio.wait_for(self._changed.wait_for(drained), max(deadline - time.monotonic(), 0))
                return True
            except asyncio.TimeoutError:
                return drained()

    async def undrain(self, replica: Replica) -> None:
        replica.draining = False
        await self._notify()

    @staticmethod
    def _take(replica: Replica, samples: int) -> Replica:
        replica.in_flight += samples
        metrics.REPLICA_OUTSTANDING.labels(replica.address).set(replica.in_flight)
        return replica

    def least_loaded(self) -> Replica | None:
        """The healthy replica with the fewest samples outstanding now, of those taking new work (None:
        none is healthy)."""
        serving = self._serving(None)
        return self._least_loaded(serving) if serving else None

    def _least_loaded(self, candidates: list[Replica]) -> Replica:
        """The fewest samples outstanding; ties taken in turn (the first of a list of idle replicas
        would otherwise get all the work whenever they are idle: 41% of it with 4 fast replicas)."""
        fewest = min(r.in_flight for r in candidates)
        tied = [r for r in candidates if r.in_flight == fewest]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def release(self, replica: Replica, samples: int = 1) -> None:
        replica.in_flight -= samples
        if replica.gone:
            if replica.in_flight == 0:
                self._close(replica)
            return
        metrics.REPLICA_OUTSTANDING.labels(replica.address).set(replica.in_flight)
        if replica.draining and replica.in_flight == 0:
            self._closing.start(self._notify(), "notify-drained")  # a drain waits for this

    async def _notify(self) -> None:
        """Wake whoever waits on the pool's membership or load (``acquire``, ``drain``)."""
        async with self._changed:
            self._changed.notify_all()

    async def mark_failed(self, replica: Replica, error: str) -> None:
        if replica.healthy:
            log.warning("replica %s out of rotation: %s", replica.address, error)
        replica.healthy = False
        replica.failures += 1
        replica.last_error = error
        await self._notify()

    async def mark_healthy(self, replica: Replica, version: int) -> None:
        replica.healthy = True
        replica.policy_version = version
        await self._notify()

    async def probe(self, replica: Replica, timeout: float = 5.0) -> int | None:
        """The replica's policy version if it is SERVING, else None."""
        try:
            health = await health_pb2_grpc.HealthStub(replica.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout)
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                return None
            status = await replica.stub.GetEngineStatus(
                generation_pb2.GetEngineStatusRequest(), timeout=timeout, metadata=self.settings.metadata())
            replica.transfer_world_size = status.weight_transfer_world_size
            replica.max_push_bytes = status.max_push_bytes
            replica.relays = "relay" in status.weight_transports
            replica.follows_segments = "shm-watermark" in status.weight_transports
            return self.run.version(status)
        except grpc.RpcError:
            return None
        except asyncio.CancelledError:
            # Discovery dropped the replica while this probe was in flight: closing its channel cancels
            # the call, which grpc.aio raises as a CancelledError in the caller. Not a cancellation of
            # the monitor (that one re-raises): let it end the whole watch and no replica would ever
            # be re-synced again.
            task = asyncio.current_task()
            if replica.gone and task is not None and not getattr(task, "cancelling", lambda: 1)():
                return None
            raise

    def require_any(self) -> list[Replica]:
        healthy = self.healthy()
        if not healthy:
            raise Unavailable("no generation replica is healthy")
        return healthy

    async def settled(self) -> None:
        """Until the side work started so far (a gone replica's channel closing, a drain's wake-up) ended."""
        await self._closing.wait()

    async def close(self) -> None:
        await asyncio.gather(*(r.channel.close() for r in self.replicas), self._closing.wait(), return_exceptions=True)
