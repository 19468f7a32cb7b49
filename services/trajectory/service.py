"""The trajectory service: the buffer plus its servicer, under the shared server lifecycle."""

from __future__ import annotations

import asyncio
import logging

import grpc

from rlfleet.services.common.database import purge_database
from rlfleet.services.common.server import Service
from rlfleet.services.trajectory.buffer import TrajectoryBuffer
from rlfleet.services.trajectory.buffer_metrics import BUFFER_METRICS
from rlfleet.services.trajectory.config import TrajectoryConfig
from rlfleet.services.trajectory.servicer import TrajectoryServicer
from rlfleet.services.trajectory.store import TrajectoryStore
from rlfleet.v1 import trajectory_pb2, trajectory_pb2_grpc
from rlfleet.wire.batch_schema import row_schema

log = logging.getLogger("rlfleet.trajectory")


class TrajectoryService(Service[TrajectoryConfig]):
    """Serves TrajectoryService; health is SERVING once the database is open and indexed. Lease expiry
    is supervised: if it dies, health turns NOT_SERVING and every call is refused with the reason."""

    service_names = (trajectory_pb2.DESCRIPTOR.services_by_name["TrajectoryService"].full_name,)

    def __init__(self, config: TrajectoryConfig):
        super().__init__(config)
        self.buffer = TrajectoryBuffer(self._open_store, config.default_lease_seconds, spawn=self.supervise)
        BUFFER_METRICS.occupancy = self.buffer.occupancy  # /metrics shows what the buffer holds

    def _open_store(self) -> TrajectoryStore:
        config = self.config
        return TrajectoryStore(config.database_url or config.db_path, config.capacity,
                               capacity_bytes=config.capacity_bytes,
                               synchronous=config.synchronous,
                               idempotency_window=config.idempotency_window,
                               max_filtered_groups=config.max_filtered_groups,
                               sample_groups_per_version=config.sample_groups_per_version,
                               max_sample_groups=config.max_sample_groups,
                               lock_timeout_seconds=config.lock_timeout_seconds, schema=config.database_schema,
                               documented=row_schema() if config.batch_schema else None)

    def torch_threads(self) -> int:
        return 1  # small tensors: see Service.torch_threads

    def add_to_server(self, server: grpc.aio.Server) -> None:
        trajectory_pb2_grpc.add_TrajectoryServiceServicer_to_server(TrajectoryServicer(self.buffer, self), server)

    async def start(self) -> None:
        config = self.config
        if config.fresh:  # before the store opens: once per process, never on a reopen after a lost connection
            dropped = await asyncio.to_thread(purge_database, config.database_url or config.db_path, role="trajectory",
                                              schema=config.database_schema,
                                              lock_timeout_seconds=config.lock_timeout_seconds)
            log.warning("fresh: the trajectory store's state deleted, a new run starts", extra={"tables": dropped})
        await self.buffer.start()
        log.info("trajectory store open", extra={"database": self.buffer.database, "capacity": self.config.capacity,
                                                 "capacity_bytes": self.config.capacity_bytes})

    async def stop(self) -> None:
        await self.stop_supervised()  # lease expiry, cancelled: not a failure
        await self.buffer.stop()
