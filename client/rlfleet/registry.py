"""Where a fleet's services are: records in the Ray cluster's GCS key-value store.

Every service actor publishes ``{address, node_id, pid, ...}`` under ``<fleet>/service/<key>`` once its
process serves, and again after every restart (on whatever node Ray placed it). Readers (the collector's
``RayDiscovery``, a restarted actor resolving its upstreams, ``Fleet.address``, a trainer task) ask the
GCS directly: no Ray driver is attached, so a process that reads the registry does not die with the
raylet it would have attached to, and reads cost one small RPC. The GCS lives on the head node and
outlives every worker node; its records outlive the actors that wrote them (``services()`` leaves out
records on dead nodes unless asked for all).

Uses Ray's GCS client (``ray._raylet.GcsClient``, the object behind ``ray.experimental.internal_kv``),
which is not a public API: the ``ray`` extra pins the major version, and this module is its one user.
It lives outside ``rlfleet.ray`` (the fleet's actors, CLI and trainer helpers, which write it) because the
collector reads it too: a service imports this module and nothing of the fleet's, and Ray only when it
reads (``ray`` is imported by the first call).
"""

from __future__ import annotations

import json
from typing import Any

NAMESPACE = b"rlfleet"
KINDS = ("service", "starts", "fresh", "error")
"""What the registry keeps per instance: its record (address...), its start count, the fresh-start marker
(``runs.py``), the error its last start failed with."""


def replica_group(run: str | None) -> str:
    """The ``service`` a generation replica's record holds: ``generation`` for the fleet's shared replicas,
    ``generation@RUN`` for those a run that trains full weights holds alone (the fleet writes it, the
    collectors' ``RayDiscovery`` reads it: each run's collector finds its own replicas alone)."""
    return f"generation@{run}" if run else "generation"


class Registry:
    """The records of fleet ``fleet`` in the cluster whose GCS listens at ``gcs_address`` (``host:port``)."""

    def __init__(self, gcs_address: str, fleet: str, gcs=None):
        """``gcs``: a ``ray._raylet.GcsClient`` (or anything with its kv and node calls); None connects to
        ``gcs_address`` on first use."""
        self.gcs_address = gcs_address
        self.fleet = fleet
        self._gcs = gcs

    def _client(self):
        if self._gcs is None:
            from ray._raylet import GcsClient

            self._gcs = GcsClient(address=self.gcs_address)
        return self._gcs

    def _key(self, kind: str, name: str = "") -> bytes:
        return f"{self.fleet}/{kind}/{name}".encode()

    def publish(self, key: str, record: dict[str, Any]) -> None:
        """``key``'s record (its address and node), replacing the previous one."""
        self._client().internal_kv_put(self._key("service", key), json.dumps(record).encode(), True, NAMESPACE)

    def withdraw(self, key: str) -> None:
        """``key``'s address out (it stops): nobody sends it work any more."""
        self.delete("service", key)

    def forget(self, key: str) -> None:
        """Every record of ``key`` (it is gone from the fleet): address, start count, markers, error."""
        for kind in KINDS:
            self.delete(kind, key)

    def put(self, kind: str, key: str, value: str) -> None:
        self._client().internal_kv_put(self._key(kind, key), value.encode(), True, NAMESPACE)

    def get(self, kind: str, key: str) -> str | None:
        value = self._client().internal_kv_get(self._key(kind, key), NAMESPACE)
        return value.decode() if value else None

    def delete(self, kind: str, key: str) -> None:
        self._client().internal_kv_del(self._key(kind, key), False, NAMESPACE)

    def count_start(self, key: str) -> int:
        """One more start of ``key``'s process; the starts since the fleet's ``up``. Kept here, not in the
        actor: an actor Ray restarts (on another node) counts on from its predecessor's."""
        count = int(self.get("starts", key) or 0) + 1
        self.put("starts", key, str(count))  # one actor per key at a time: no concurrent writer
        return count

    def clear(self) -> None:
        """Every record of the fleet (its spec included)."""
        self._client().internal_kv_del(f"{self.fleet}/".encode(), True, NAMESPACE)

    def records(self) -> dict[str, dict[str, Any]]:
        """Every service record by key, dead nodes' included."""
        prefix = self._key("service")
        keys = self._client().internal_kv_keys(prefix, NAMESPACE)
        if not keys:
            return {}
        values = self._client().internal_kv_multi_get(keys, NAMESPACE)
        return {key[len(prefix):].decode(): json.loads(value) for key, value in values.items() if value}

    def alive_nodes(self) -> set[str]:
        """Hex ids of the nodes the GCS holds alive."""
        infos = self._client().get_all_node_info()
        return {node_id.hex() for node_id, info in infos.items() if info.state == 0}  # GcsNodeInfo.ALIVE

    def node_ip(self, node_id: str) -> str | None:
        """The IP the cluster knows node ``node_id`` (hex) by: where its services are reached, what the
        credentials' certificates must hold."""
        infos = self._client().get_all_node_info()
        return next((info.node_manager_address for key, info in infos.items() if key.hex() == node_id), None)

    def services(self, service: str | None = None, alive_only: bool = True) -> dict[str, dict[str, Any]]:
        """The records (of ``service`` only, if given) on live nodes (``alive_only``) or all, sorted by key."""
        alive = self.alive_nodes() if alive_only else None
        found = {key: record for key, record in self.records().items()
                 if (alive is None or record.get("node_id") in alive)
                 and (service is None or record.get("service") == service)}
        return dict(sorted(found.items(), key=lambda item: _natural(item[0])))

    def address(self, key: str) -> str | None:
        """``key``'s address while its node is alive, else None."""
        return self.services().get(key, {}).get("address")

    def put_spec(self, spec: dict[str, Any]) -> None:
        self._client().internal_kv_put(self._key("spec"), json.dumps(spec).encode(), True, NAMESPACE)

    def spec(self) -> dict[str, Any] | None:
        value = self._client().internal_kv_get(self._key("spec"), NAMESPACE)
        return json.loads(value) if value else None


def _natural(key: str) -> tuple[str, int]:
    """``generation-10`` after ``generation-9``."""
    stem, _, index = key.rpartition("-")
    return (stem, int(index)) if index.isdigit() else (key, -1)
