"""The collector's watches, once it serves: the upstream services' health (``UpstreamWatch``) and the
generation replicas (``ReplicaWatch``: who is a member, who is in rotation, who needs a re-sync).

Each is a loop ``CollectorService`` supervises, and a part with its own state: the outages for
``Status.serving``; the replicas' rotation in the pool."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfleet.services.collector import metrics
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.discovery import Discovery
from rlfleet.services.collector.fanout import WeightFanout
from rlfleet.services.collector.replicas import Replica, ReplicaPool
from rlfleet.wire import shm

log = logging.getLogger("rlfleet.collector")


class UpstreamWatch:
    """The upstream services (reference, reward, trajectory, environment: not the replicas) by name, and
    which of them are down: the pipeline draws no prompt meanwhile (``upstream_up`` cleared)."""

    def __init__(self, addresses: dict[str, str], channels: dict[str, grpc.aio.Channel], pool: ReplicaPool,
                 upstream_up: asyncio.Event, check_seconds: float):
        self.addresses, self.channels = addresses, channels
        self._pool, self._upstream_up, self._check_seconds = pool, upstream_up, check_seconds
        self.outages: dict[str, str] = {}
        """Upstream services found down since the start (name -> what their health check answered),
        and "generation" while no replica is in rotation: ``Status.serving`` is false meanwhile."""

    def down(self, name: str) -> bool:
        return name in self.outages

    def problem(self) -> str:
        """The outages in words ("" when none)."""
        return "; ".join(f"{name} at {self.addresses[name]} is down: {answer}" if name in self.addresses
                         else f"{name}: {answer}" for name, answer in sorted(self.outages.items()))

    async def health(self, name: str) -> str:
        """What ``name``'s health check answers: "" when SERVING, else the status or error code."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.channels[name]).Check(
                health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return ""
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def wait_for_all(self, waiting: Callable[[str], None]) -> None:
        """Until every upstream service serves; ``waiting`` is told what the collector waits for."""
        for name in self.channels:
            while answer := await self.health(name):
                reason = f"waiting for {name} at {self.addresses[name]}: {answer}"
                waiting(reason)
                log.info(reason)
                await asyncio.sleep(1.0)

    async def run(self) -> None:
        """Once serving: the upstream services' health every ``replica_check_seconds`` (and whether any
        replica is in rotation), for ``Status.serving``; the pipeline draws no prompt while one of them is
        down. An outage is one WARNING line, its end one INFO line; nothing submitted is lost."""
        while True:
            await asyncio.sleep(self._check_seconds)
            answers = dict(zip(self.channels, await asyncio.gather(*(self.health(n) for n in self.channels))))
            answers["generation"] = "" if self._pool.healthy() else "no replica in rotation"
            for name, answer in answers.items():
                if answer and name not in self.outages:
                    where = f" at {self.addresses[name]}" if name in self.addresses else ""
                    log.warning("%s%s is down (%s): generation pauses until it is back", name, where, answer)
                elif not answer and name in self.outages:
                    log.info("%s is back", name)
            self.outages = {name: answer for name, answer in answers.items() if answer}
            if any(name in self.addresses for name in self.outages):
                self._upstream_up.clear()
            else:
                self._upstream_up.set()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.channels.values()), return_exceptions=True)


class ReplicaWatch:
    """The generation replicas: members as discovery lists them, probed at the start, brought back into
    rotation at the committed version (re-synced or rolled back from the spool), and taken out when one
    serves another version than it should."""

    def __init__(self, pool: ReplicaPool, discovery: Discovery, fanout: WeightFanout, gate: VersionGate, *,
                 check_seconds: float, refresh_seconds: float, startup_seconds: float):
        self._pool, self._discovery, self._fanout, self._gate = pool, discovery, fanout, gate
        self._check_seconds, self._refresh_seconds = check_seconds, refresh_seconds
        self._startup_seconds = startup_seconds

    async def update_members(self) -> None:
        added, removed = await self._pool.update(await self._discovery.endpoints())
        for replica in added:
            log.info("replica %s joined (from %s): in rotation once it serves the committed version",
                     replica.address, self._discovery.describe())
        for replica in removed:
            log.info("replica %s left (no longer in %s): out of rotation; %d samples still in flight there",
                     replica.address, self._discovery.describe(), replica.in_flight)
        metrics.REPLICA_MEMBERS.set(len(self._pool.replicas))

    async def watch_members(self) -> None:
        """The replica list asked again every ``discovery_refresh_seconds`` (``discovery.py``): new replicas
        wait out of rotation for the replica monitor to re-sync them; gone ones leave at once."""
        while True:
            await asyncio.sleep(self._refresh_seconds)
            await self.update_members()

    async def probe_all(self) -> dict[str, int]:
        """Every replica's version, waiting (bounded) for all of them so the first groups spread over all."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._startup_seconds
        while True:
            replicas = self._pool.replicas
            probed = await asyncio.gather(*(self._pool.probe(r) for r in replicas))
            versions = {r.address: v for r, v in zip(replicas, probed) if v is not None}
            if len(versions) == len(replicas) or (versions and loop.time() >= deadline):
                return versions
            log.info("waiting for generation replicas", extra={"answered": sorted(versions), "replicas": len(replicas)})
            await asyncio.sleep(1.0)

    async def admit(self, versions: dict[str, int], version: int) -> None:
        """Into rotation: the replicas that answered serving ``version`` (the committed one)."""
        for replica in self._pool.replicas:
            if versions.get(replica.address) == version:
                await self._pool.mark_healthy(replica, version)

    async def run(self) -> None:
        """Bring failed replicas back: probe, re-sync (or roll back) to the committed version, rejoin.
        Replicas in rotation are probed too: one that restarted between two pushes (serving its
        checkpoint, not the committed version) goes out of rotation and is re-synced. Also sweeps
        shm segments left by killed processes."""
        while True:
            await asyncio.sleep(self._check_seconds)
            await asyncio.to_thread(shm.sweep_stale)
            metrics.REPLICA_HEALTHY.set(len(self._pool.healthy()))
            for replica in list(self._pool.replicas):
                if replica.gone:
                    continue
                if replica.healthy:
                    await self.check_in_rotation(replica)
                else:
                    await self._bring_back(replica)

    async def _bring_back(self, replica: Replica) -> None:
        if self._fanout.busy:
            return  # a push or re-sync moves versions (a rolling update, for minutes): next tick
        version = await self._pool.probe(replica)
        if version is None or self._fanout.busy:
            return
        if version != self._gate.version and not await self._fanout.resync(replica):
            return
        if replica.gone:
            return  # it left while it was being re-synced
        await self._pool.mark_healthy(replica, self._gate.version)
        log.info("replica %s in rotation", replica.address)

    async def check_in_rotation(self, replica: Replica) -> None:
        """A replica in rotation that serves another version than it should (it restarted) goes out."""
        pushes = self._fanout.pushes
        if self._fanout.busy:
            return
        version = await self._pool.probe(replica)
        if version is None or self._fanout.busy or self._fanout.pushes != pushes or not replica.healthy:
            return  # unreachable (its calls will tell), or versions moved meanwhile: judge next time
        if version != replica.policy_version:
            await self._pool.mark_failed(
                replica, f"serves version {version}, not {replica.policy_version} (restarted?)")
