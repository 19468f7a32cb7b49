"""Generation replicas: least-loaded selection, failure handling, re-sync.

A replica that fails a call is taken out of rotation. A monitor checks it
again; once it answers and serves the committed version (re-synced from the
spooled weights if it does not), it returns to rotation.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfleet.client.channel import ChannelSettings, aio_channel
from rlfleet.services.common.errors import Unavailable
from rlfleet.v1 import generation_pb2, generation_pb2_grpc

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
    failures: int = 0
    last_error: str = ""
    shm_refused: bool = False
    """It could not open a segment of ours (another host or IPC namespace): grpc pushes stream to it."""
    transfer_world_size: int = 0
    """Its inference workers (NCCL ranks in an nccl push), from its last probe."""
    max_push_bytes: int = 0
    """The largest push it accepts, from its last probe (0: not reported yet)."""


def expand_addresses(addresses: list[str]) -> list[str]:
    """``host:port`` entries; a host resolving to several IPs becomes several replicas
    (a Kubernetes headless Service). IP literals and unresolvable names pass through."""
    out: list[str] = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError):
            out.append(address)
            continue
        ips = sorted({info[4][0] for info in infos})
        if len(ips) <= 1 or host in ("localhost",):
            out.append(address)
        else:
            out.extend(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips)
    return list(dict.fromkeys(out))


class ReplicaPool:
    """The set of generation replicas this collector drives."""

    def __init__(self, addresses: list[str], settings: ChannelSettings):
        self.settings = settings
        self.replicas: list[Replica] = []
        for address in expand_addresses(addresses):
            channel = aio_channel(address, settings)
            self.replicas.append(Replica(address, channel, generation_pb2_grpc.GenerationServiceStub(channel)))
        self._changed = asyncio.Condition()

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    async def acquire(self, exclude: set[str] = frozenset(), timeout: float | None = None,
                      prefer: Replica | None = None) -> Replica:
        """``prefer`` while it is healthy and not excluded (an episode's group stays where its prefix is
        cached), else the healthy replica with the fewest requests in flight (waits for one)."""
        async def pick():
            async with self._changed:
                while True:
                    if prefer is not None and prefer.healthy and prefer.address not in exclude:
                        prefer.in_flight += 1
                        return prefer
                    candidates = [r for r in self.replicas if r.healthy and r.address not in exclude]
                    if not candidates and exclude:
                        candidates = self.healthy()  # all others are down: allow a retry anywhere
                    if candidates:
                        replica = min(candidates, key=lambda r: r.in_flight)
                        replica.in_flight += 1
                        return replica
                    await self._changed.wait()
        return await asyncio.wait_for(pick(), timeout)

    def least_loaded(self) -> Replica | None:
        """The healthy replica with the fewest requests in flight now (None: none is healthy)."""
        return min(self.healthy(), key=lambda r: r.in_flight, default=None)

    def release(self, replica: Replica) -> None:
        replica.in_flight -= 1

    async def mark_failed(self, replica: Replica, error: str) -> None:
        if replica.healthy:
            log.warning("replica %s out of rotation: %s", replica.address, error)
        replica.healthy = False
        replica.failures += 1
        replica.last_error = error
        async with self._changed:
            self._changed.notify_all()

    async def mark_healthy(self, replica: Replica, version: int) -> None:
        replica.healthy = True
        replica.policy_version = version
        async with self._changed:
            self._changed.notify_all()

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
            return status.policy_version
        except grpc.RpcError:
            return None

    def require_any(self) -> list[Replica]:
        healthy = self.healthy()
        if not healthy:
            raise Unavailable("no generation replica is healthy")
        return healthy

    async def close(self) -> None:
        await asyncio.gather(*(r.channel.close() for r in self.replicas), return_exceptions=True)
