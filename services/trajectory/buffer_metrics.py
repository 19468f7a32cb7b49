"""Prometheus metrics of the trajectory buffer's occupancy, read from its index at scrape time: the
trajectories ready and leased against ``capacity``, their bytes against ``capacity_bytes``. A full
buffer refuses appends (RESOURCE_EXHAUSTED): backpressure on the collector, the trainer falling behind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from prometheus_client.core import REGISTRY, GaugeMetricFamily


@dataclass(frozen=True)
class Occupancy:
    ready: int
    leased: int
    capacity: int
    bytes: int
    capacity_bytes: int


class BufferMetrics:
    """A Prometheus collector over ``occupancy`` (the trajectory service's; None, or None returned: no
    family, e.g. while the store is not open)."""

    def __init__(self) -> None:
        self.occupancy: Callable[[], Occupancy | None] | None = None

    def describe(self):
        return []  # families are known at scrape time only

    def collect(self):
        occupancy = self.occupancy() if self.occupancy is not None else None
        if occupancy is None:
            return
        trajectories = GaugeMetricFamily("rlfleet_buffer_trajectories", "Trajectories in the buffer, ready for a "
                                         "trainer or leased to one (unacknowledged)", labels=["state"])
        trajectories.add_metric(["ready"], occupancy.ready)
        trajectories.add_metric(["leased"], occupancy.leased)
        yield trajectories
        yield GaugeMetricFamily("rlfleet_buffer_capacity_trajectories", "The trajectories the buffer holds at most "
                                "(capacity): an append past it is refused", value=occupancy.capacity)
        yield GaugeMetricFamily("rlfleet_buffer_bytes", "Serialized bytes of the ready and leased trajectories",
                                value=occupancy.bytes)
        yield GaugeMetricFamily("rlfleet_buffer_capacity_bytes", "The bytes the buffer holds at most "
                                "(capacity_bytes)", value=occupancy.capacity_bytes)


BUFFER_METRICS = BufferMetrics()
REGISTRY.register(BUFFER_METRICS)
