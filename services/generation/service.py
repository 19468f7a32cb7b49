"""The generation service: GenerationEngine + servicer + health that follows the engine."""

from __future__ import annotations

import asyncio

import grpc

from rlfleet.services.common.server import Service
from rlfleet.services.common.upstream import upstream_settings
from rlfleet.services.generation.config import GenerationConfig
from rlfleet.services.generation.relayed import RelayedPushes
from rlfleet.services.generation.run_metrics import RUN_METRICS
from rlfleet.services.generation.vllm_engine import GenerationEngine
from rlfleet.services.generation.servicer import GenerationServicer
from rlfleet.v1 import generation_pb2, generation_pb2_grpc


class GenerationService(Service[GenerationConfig]):
    service_names = (generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,)

    def __init__(self, config: GenerationConfig):
        super().__init__(config)
        self.engine = GenerationEngine(config)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        relayed = RelayedPushes(upstream_settings(self.config, self.config.max_message_bytes))
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(
            GenerationServicer(self.engine, self, relayed), server)

    async def start(self) -> None:
        await self.engine.start()
        RUN_METRICS.status = self.engine.status  # the runs sharing this replica, on /metrics
        # Supervised: a watch that died would leave health stuck at its last answer (SERVING through
        # swaps, or after the engine core died); the service fails instead, naming why.
        self.supervise(self._follow_engine_health(), "the engine health watch")

    async def _follow_engine_health(self) -> None:
        # NOT_SERVING during wait/abort swaps (and if a swap failed), SERVING otherwise.
        serving = True
        while True:
            await asyncio.sleep(0.05)
            if self.engine.serving != serving:
                serving = self.engine.serving
                await self.set_serving(serving)

    async def stop(self) -> None:
        RUN_METRICS.status = None
        await self.stop_supervised()
        await self.engine.shutdown()
