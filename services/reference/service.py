"""The reference service: a ReferenceScorer behind a MicroBatcher, exposed over gRPC."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from rlfleet.services.common.server import Service
from rlfleet.services.reference.batcher import MicroBatcher
from rlfleet.services.reference.config import ReferenceServiceConfig
from rlfleet.services.reference.scorer import ReferenceScorer
from rlfleet.services.reference.servicer import ReferenceServicer
from rlfleet.v1 import reference_pb2, reference_pb2_grpc

log = logging.getLogger("rlfleet.reference")


class ReferenceService(Service[ReferenceServiceConfig]):
    """Loads the frozen model in :meth:`start`; health stays NOT_SERVING until then. The batching loop
    is supervised: if it dies, health turns NOT_SERVING and every call is refused with the reason."""

    service_names = (reference_pb2.DESCRIPTOR.services_by_name["ReferenceService"].full_name,)

    def __init__(self, config: ReferenceServiceConfig):
        super().__init__(config)
        self.scorer = ReferenceScorer(config)
        # Answers Unavailable until the model is loaded (the scorer's validation says so).
        self.batcher = MicroBatcher(self.scorer, token_budget=config.micro_batch_token_limit, spawn=self.supervise)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        reference_pb2_grpc.add_ReferenceServiceServicer_to_server(
            ReferenceServicer(self.batcher, self.config.model_path, self), server)

    async def start(self) -> None:
        started = time.perf_counter()
        # Loading takes seconds to minutes: keep the loop free for health checks.
        await asyncio.to_thread(self.scorer.load)
        log.info("reference model loaded", extra={
            "model": self.config.model_path, "vocab_size": self.scorer.vocab_size,
            "max_len": self.scorer.max_len, "seconds": round(time.perf_counter() - started, 2),
        })

    async def stop(self) -> None:
        await self.stop_supervised()  # cancels the batching loop (supervised): not a failure
        await self.batcher.aclose()  # then fails whatever still waits on it
