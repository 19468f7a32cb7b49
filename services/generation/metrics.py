"""The generation service's own metrics (vLLM exports its ``vllm:*`` ones; the runs': ``run_metrics``)."""

from prometheus_client import Counter, Gauge, Histogram

WEIGHT_CHECKS = Counter(
    "rlfleet_replica_weight_checks_total",
    "Weight pushes checked against their fingerprints: the staged bytes at the commit (step=staged), the "
    "engine's parameters after the load (step=engine); result=ok or mismatch",
    ["step", "result"])

WEIGHT_CHECK_SECONDS = Histogram(
    "rlfleet_replica_weight_check_seconds",
    "Time a push's checks took: the staged bytes' fingerprints at the commit (step=staged), the tensors' as "
    "they load and the engine's parameters' after it, in the workers (step=engine; the slowest worker's)",
    ["step"], buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0))

STREAMED_PUSH_BYTES = Gauge(
    "rlfleet_replica_streamed_push_bytes",
    "The push being loaded into vLLM as it arrives (streamed_apply): its bytes that arrived (stage=arrived) "
    "and those the workers loaded (stage=loaded); 0 when none is",
    ["stage"])
