"""Prometheus metrics shared by all services (served on ``metrics_port``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RPC_SECONDS = Histogram("rlfleet_rpc_seconds", "RPC handling time", ["method"])
RPC_ERRORS = Counter("rlfleet_rpc_errors_total", "RPCs that ended with an error status", ["method", "code"])
READY = Gauge("rlfleet_ready", "1 when the service reports SERVING")


def serve_metrics(port: int) -> None:
    """Start the /metrics HTTP endpoint in a daemon thread (no-op for port 0)."""
    if port:
        start_http_server(port)
