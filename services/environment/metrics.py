"""The environment service's Prometheus metrics: its sandbox's isolation and the tool calls it runs."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

SANDBOX_ISOLATION = Gauge("rlfleet_sandbox_isolation",
                          "1 for the isolation the python tool's sandbox found at start (environment): "
                          "bwrap, or rlimits-only", ["isolation"])
TOOL_CALLS = Counter("rlfleet_tool_calls_total",
                     "Tool calls run for episodes (environment), by tool and outcome (ok, error)", ["tool", "outcome"])
