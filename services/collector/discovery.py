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
  fails keeps that name's last answer (a DNS blip must not empty the fleet).

A Ray- or registry-based source is one more ``Discovery`` subclass; nothing else changes.
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


def make_discovery(addresses: list[str], addresses_file: str | None, resolve: bool) -> Discovery:
    names = AddressFile(addresses_file) if addresses_file else StaticList(addresses)
    return Dns(names) if resolve else names
