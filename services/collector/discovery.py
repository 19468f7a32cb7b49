"""Where the generation replicas are: one small interface, the sources behind it.

``Discovery.endpoints()`` answers the replicas to drive now; the collector asks again every
``discovery_refresh_seconds`` and ``ReplicaPool.update`` applies the difference (a replica that
appears is re-synced to the committed weights before it gets work; one that goes leaves the
rotation, its calls in flight finishing or failing over as any failed call does). Sources:

- ``StaticList``: the configured ``generation_addresses``;
- ``AddressFile``: a JSON list of ``host:port`` in a file, re-read each time (an autoscaler, a
  registry sidecar or a test writes it; a file that is missing or not a list keeps the last answer,
  with a WARNING);
- ``Dns``: wraps either, resolving each name: a name with several IPs (a Kubernetes headless
  Service) is one replica per IP, whose TLS certificate is checked against the name. A lookup that
  fails keeps that name's last answer (a DNS blip must not empty the fleet);
- ``RayDiscovery``: the generation replicas a fleet on a Ray cluster registered (``rlfleet.ray``:
  ``generation_addresses: ["ray+gcs://GCS_HOST:PORT/FLEET"]``). A replica whose node died stays
  listed (out of rotation: its calls fail) until it republishes from the node it restarted on or is
  scaled away: it leaves once its old process is long gone, not while the replica monitor may still
  be probing it. An unreadable registry keeps the last answer.

Knows no gRPC.
"""

from __future__ import annotations

import abc
import asyncio
import ipaddress
import json
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rlfleet.collector.discovery")


@dataclass(frozen=True)
class Endpoint:
    """One replica to dial."""

    address: str
    """``host:port`` (or ``[v6]:port``) dialled."""
    tls_name: str | None = None
    """The name its certificate must hold, when ``address`` is an IP that a name resolved to."""


class Discovery(abc.ABC):
    """The replicas to drive now."""

    @abc.abstractmethod
    async def endpoints(self) -> list[Endpoint]:
        """Every replica, each once, in a stable order."""

    def describe(self) -> str:
        return type(self).__name__


class StaticList(Discovery):
    def __init__(self, addresses: list[str]):
        self.addresses = list(dict.fromkeys(addresses))

    async def endpoints(self) -> list[Endpoint]:
        return [Endpoint(address) for address in self.addresses]

    def describe(self) -> str:
        return f"the list {self.addresses}"


class AddressFile(Discovery):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._last: list[str] = []
        self._warned = ""

    async def endpoints(self) -> list[Endpoint]:
        try:
            addresses = json.loads(await asyncio.to_thread(self.path.read_text))
            if not isinstance(addresses, list) or not all(isinstance(a, str) and ":" in a for a in addresses):
                raise ValueError("expected a JSON list of 'host:port' strings")
        except (OSError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
            if problem != self._warned:  # once per distinct problem, not every refresh
                log.warning("generation_addresses_file %s unreadable (%s): keeping the last %d replicas",
                            self.path, problem, len(self._last))
                self._warned = problem
            return [Endpoint(address) for address in self._last]
        self._warned = ""
        self._last = list(dict.fromkeys(addresses))
        return [Endpoint(address) for address in self._last]

    def describe(self) -> str:
        return f"the file {self.path}"


class Dns(Discovery):
    def __init__(self, names: Discovery):
        self.names = names
        self._last: dict[str, list[Endpoint]] = {}

    async def endpoints(self) -> list[Endpoint]:
        named = await self.names.endpoints()
        resolved = await asyncio.gather(*(self._resolve(endpoint.address) for endpoint in named))
        self._last = {endpoint.address: found for endpoint, found in zip(named, resolved)}
        return list({e.address: e for found in resolved for e in found}.values())

    async def _resolve(self, address: str) -> list[Endpoint]:
        host, _, port = address.rpartition(":")
        if not host or host == "localhost" or _is_ip(host.strip("[]")):
            return [Endpoint(address)]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:
            last = self._last.get(address)
            if last is None:
                return [Endpoint(address)]  # never resolved: let gRPC try the name itself
            log.warning("cannot resolve %s (%s): keeping its last %d replicas", host, exc, len(last))
            return last
        ips = sorted({info[4][0] for info in infos})
        return [Endpoint(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}", tls_name=host) for ip in ips]

    def describe(self) -> str:
        return f"{self.names.describe()}, names resolved (one replica per IP)"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


RAY_SCHEME = "ray+gcs://"


class RayDiscovery(Discovery):
    """The ``service`` records of fleet ``fleet`` in the registry of the Ray cluster whose GCS is at
    ``gcs_address`` (``rlfleet.registry``: read from the GCS directly, no Ray driver attached).
    Imports ray only when built: the collector needs the ``ray`` extra only with this source."""

    def __init__(self, gcs_address: str, fleet: str, service: str = "generation", registry=None):
        if registry is None:
            from rlfleet.registry import Registry

            registry = Registry(gcs_address, fleet)
        self.registry = registry
        self.service = service
        self._last: list[str] = []
        self._warned = ""

    @classmethod
    def from_url(cls, url: str) -> "RayDiscovery":
        from rlfleet.registry import replica_group

        gcs_address, fleet, run = parse_ray_url(url)
        return cls(gcs_address, fleet, replica_group(run))

    async def endpoints(self) -> list[Endpoint]:
        try:
            records = await asyncio.to_thread(self.registry.services, self.service, False)
        except Exception as exc:  # noqa: BLE001 - the GCS unreachable (head restarting): keep the last answer
            problem = f"{type(exc).__name__}: {exc}"
            if problem != self._warned:
                log.warning("Ray registry at %s unreadable (%s): keeping the last %d replicas",
                            self.registry.gcs_address, problem, len(self._last))
                self._warned = problem
            return [Endpoint(address) for address in self._last]
        self._warned = ""
        self._last = list(dict.fromkeys(record["address"] for record in records.values()))
        return [Endpoint(address) for address in self._last]

    def describe(self) -> str:
        whose = "" if self.service == "generation" else f" ({self.service})"
        return f"the Ray registry of fleet {self.registry.fleet!r}{whose} at {self.registry.gcs_address}"


def parse_ray_url(url: str) -> tuple[str, str, str | None]:
    """``ray+gcs://HOST:PORT/FLEET[/RUN]`` -> (``HOST:PORT``, ``FLEET``, ``RUN`` or None): the fleet's
    shared replicas, or those run ``RUN`` holds alone; ValueError naming what is wrong."""
    if not url.startswith(RAY_SCHEME):
        raise ValueError(f"{url!r} does not start with {RAY_SCHEME}")
    gcs_address, _, path = url[len(RAY_SCHEME):].partition("/")
    fleet, _, run = path.partition("/")
    if ":" not in gcs_address or not fleet or "/" in run or (_ and not run):
        raise ValueError(f"{url!r} is not {RAY_SCHEME}GCS_HOST:PORT/FLEET[/RUN]")
    return gcs_address, fleet, run or None


def make_discovery(addresses: list[str], addresses_file: str | None, resolve: bool) -> Discovery:
    if not addresses_file and addresses and addresses[0].startswith(RAY_SCHEME):
        return RayDiscovery.from_url(addresses[0])  # one entry: the config refuses mixing it with others
    names = AddressFile(addresses_file) if addresses_file else StaticList(addresses)
    return Dns(names) if resolve else names
