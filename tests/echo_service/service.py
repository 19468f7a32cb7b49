"""The echo service: scaffolding only, used to test and benchmark the transport."""

from __future__ import annotations

import asyncio

import grpc

from rlfleet.services.common.server import Service
from tests.echo_service.config import EchoConfig


class EchoService(Service[EchoConfig]):
    """Serves only DiagnosticsService.Echo (registered for every service by the server)."""

    def add_to_server(self, server: grpc.aio.Server) -> None:
        pass

    async def start(self) -> None:
        await asyncio.sleep(self.config.startup_delay_seconds)
