"""The environment service's Prometheus metrics: its sandbox's isolation and the tool calls it runs."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
EPISODE_SANDBOXES_STARTED = Counter("rlfleet_episode_sandboxes_started_total",
                                    "Ready sandboxes started (for a call or an episode): a bwrap and the zygote's interpreter (environment)")
EPISODE_SANDBOXES_REUSED = Counter("rlfleet_episode_sandboxes_reused_total",
                                   "Calls or episodes given a sandbox an earlier one left, reset and checked clean "
                                   "(environment): the starts saved")
EPISODE_SANDBOX_RESETS = Counter("rlfleet_episode_sandbox_resets_total",
                                 "Separate resets of sandboxes before they are parked (one after each call is the call's), by "
                                 "outcome: clean (parked) or failed (ended) (environment)", ["outcome"])
EPISODE_SANDBOXES = Gauge("rlfleet_episode_sandboxes",
                          "Ready sandboxes alive (environment), by state: held by a call or an episode, or idle "
                          "(parked for the next)", ["state"])
SANDBOX_CPU = Histogram("rlfleet_episode_sandbox_cpu_seconds",
                        "CPU of a ready sandbox (environment), by step: start (bwrap and the zygote until ready), "
                        "call (the call's processes and the zygote's fork and reset after it, as the zygote "
                        "reports it) or reset (a separate one, before a sandbox is parked)",
                        ["step"], buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0, 10.0))
