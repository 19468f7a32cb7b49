"""Prometheus metrics shared by all services (served on ``metrics_port``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RPC_SECONDS = Histogram("rlfleet_rpc_seconds", "RPC handling time", ["method"])
RPC_ERRORS = Counter("rlfleet_rpc_errors_total", "RPCs that ended with an error status", ["method", "code"])
READY = Gauge("rlfleet_ready", "1 when the service reports SERVING")
REPLICA_OUTSTANDING = Gauge("rlfleet_replica_outstanding_samples",
                            "Samples a generation replica has outstanding (collector; one series per member)",
                            ["replica"])
REPLICA_HEALTHY = Gauge("rlfleet_replicas_in_rotation", "Generation replicas in rotation (collector)")
REPLICA_MEMBERS = Gauge("rlfleet_replicas", "Generation replicas discovery lists (collector)")
TRAINER_WAIT_SECONDS = Counter("rlfleet_trainer_wait_seconds_total",
                               "Seconds trainers' batch requests waited for a batch (collector): trainers idle "
                               "for want of rollouts; its rate over time is the fraction of time they wait")

SANDBOX_ISOLATION = Gauge("rlfleet_sandbox_isolation",
                          "1 for the isolation the python tool's sandbox found at start (environment): "
                          "bwrap, or rlimits-only", ["isolation"])
TOOL_CALLS = Counter("rlfleet_tool_calls_total",
                     "Tool calls run for episodes (environment), by tool and outcome (ok, error)", ["tool", "outcome"])


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Start the /metrics HTTP endpoint on ``host`` in a daemon thread (no-op for port 0)."""
    if port:
        start_http_server(port, addr=host)
