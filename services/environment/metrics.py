"""The environment service's Prometheus metrics: its sandbox's isolation and the tool calls it runs."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from rlfleet.services.environment.sandbox import GATE

SANDBOX_ISOLATION = Gauge("rlfleet_sandbox_isolation",
                          "1 for the isolation the python tool's sandbox found at start (environment): "
                          "bwrap, or rlimits-only", ["isolation"])
TOOL_CALLS = Counter("rlfleet_tool_calls_total",
                     "Tool calls run for episodes (environment), by tool and outcome (ok, error)", ["tool", "outcome"])
TOOL_CALLS_WAITING = Gauge("rlfleet_tool_calls_waiting",
                           "Sandboxed tool calls waiting for one of the max_tool_calls_in_flight to end (environment)")
TOOL_CALLS_WAITING.set_function(lambda: GATE.waiting)
TOOL_CALLS_LIMIT = Gauge("rlfleet_tool_calls_in_flight_limit",
                         "Sandboxed tool calls that may run at once (environment: max_tool_calls_in_flight)")
TOOL_CALLS_LIMIT.set_function(lambda: GATE.limit)
