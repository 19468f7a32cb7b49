"""Config of the echo service (tests only)."""

from __future__ import annotations

from pydantic import Field

from rlfleet.services.common.config import ServiceConfig


class EchoConfig(ServiceConfig):
    """The echo service: the shared scaffolding with no domain (diagnostics only)."""

    service_name = "echo"

    port: int = Field(50059, ge=0, le=65535)
    """gRPC port; 0 picks a free port (written to ``port_file``)."""
    startup_delay_seconds: float = Field(0.0, ge=0)
    """Simulated model-load time: health stays NOT_SERVING this long after the server listens."""
