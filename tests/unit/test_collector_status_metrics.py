"""The collector's off-policy metrics are its status, read at scrape time."""

from __future__ import annotations

from prometheus_client import generate_latest

from rlfleet.services.collector.status_metrics import STATUS_METRICS
from rlfleet.v1 import collector_pb2


def test_the_metrics_show_what_the_status_shows_and_follow_it():
    status = collector_pb2.GetStatusResponse(
        policy_version=7, trajectories=96, pending_prompts=12, failed_prompts=1, discarded_samples=8, discarded_tokens=2048,
        dynamic_sampling=collector_pb2.DynamicSamplingStatus(filtered_groups=5, filtered_samples=20, filter_rate=0.25,
                                                             oversampling=4 / 3),
        mismatch=collector_pb2.MismatchStatus(admission_staleness=2, breaker_open=True, measured=[
            collector_pb2.LagMismatch(lag=0, kl_k3=1e-6), collector_pb2.LagMismatch(lag=3, kl_k3=0.25)]))
    previous, STATUS_METRICS.status = STATUS_METRICS.status, lambda: status
    try:
        text = generate_latest().decode()
        for line in ("rlfleet_policy_version 7.0", "rlfleet_trajectories_appended 96.0",
                     "rlfleet_pending_prompts 12.0", "rlfleet_failed_prompts 1.0", "rlfleet_filtered_groups 5.0", "rlfleet_filtered_samples 20.0", "rlfleet_filter_rate 0.25",
                     "rlfleet_discarded_tokens 2048.0", "rlfleet_discarded_samples 8.0",
                     "rlfleet_admission_staleness 2.0", "rlfleet_mismatch_breaker_open 1.0",
                     'rlfleet_mismatch_kl_k3{lag="0"} 1e-06', 'rlfleet_mismatch_kl_k3{lag="3"} 0.25'):
            assert line in text.splitlines(), line
        status.dynamic_sampling.filtered_groups = 6  # read at every scrape
        assert "rlfleet_filtered_groups 6.0" in generate_latest().decode().splitlines()
    finally:
        STATUS_METRICS.status = previous
