"""Prometheus metrics read from the collector's status at scrape time: the committed version, the
rollout's progress (trajectories appended, prompts pending and dead-lettered), what GetStatus shows
of off-policy control (dynamic sampling, thrown-away work, the admission bound, the measured
mismatch) and of rolling updates (the two-version window, pins), from the one place that computes it."""

from __future__ import annotations

from typing import Callable

from prometheus_client.core import REGISTRY, GaugeMetricFamily

from rlfleet.services.common.metrics import StatusCollector
from rlfleet.v1 import collector_pb2


class StatusMetrics(StatusCollector):
    """A Prometheus collector over ``status`` (the collector service's ``status``; None: no family)."""

    status: Callable[[], collector_pb2.GetStatusResponse] | None

    def families(self, status: collector_pb2.GetStatusResponse):
        sampling, mismatch = status.dynamic_sampling, status.mismatch
        for name, help_text, value in (
            ("rlfleet_policy_version", "The committed policy version", status.policy_version),
            ("rlfleet_trajectories_appended", "Trajectories appended for trainers since start", status.trajectories),
            ("rlfleet_pending_prompts", "Prompts in the ledger not yet appended or dead-lettered",
             status.pending_prompts),
            ("rlfleet_failed_prompts", "Prompts dead-lettered (failed for good) since the state directory "
                                       "was created", status.failed_prompts),
            ("rlfleet_filtered_groups", "Groups dynamic sampling filtered (never delivered), since the state "
                                        "directory was created", sampling.filtered_groups),
            ("rlfleet_filtered_samples", "Samples of those groups", sampling.filtered_samples),
            ("rlfleet_filter_rate", "Fraction of the recent groups filtered", sampling.filter_rate),
            ("rlfleet_oversampling", "Groups started per group expected to reach the trainer",
             sampling.oversampling or 1.0),
            ("rlfleet_discarded_samples", "Samples thrown away since start (aborted or too stale)",
             status.discarded_samples),
            ("rlfleet_discarded_tokens", "Sampled tokens thrown away since start", status.discarded_tokens),
            ("rlfleet_admission_staleness", "The staleness bound admission applies now (max_staleness, or less "
                                            "while a lag measures over mismatch_kl_target)",
             mismatch.admission_staleness),
            ("rlfleet_mismatch_breaker_open", "1 while the mismatch breaker is open", int(mismatch.breaker_open)),
            ("rlfleet_versions_serving", "Distinct policy versions the replicas in rotation serve (2 during a "
                                         "rolling update)",
             len({r.policy_version for r in status.replicas if r.healthy})),
            ("rlfleet_rolling_update_in_progress", "1 while a rolling update switches replicas",
             int(status.rolling_update.in_progress)),
            ("rlfleet_rolling_update_window_seconds", "Seconds two versions have served in the rolling update in "
                                                      "progress (the last one's whole window once over)",
             status.rolling_update.window_seconds),
            ("rlfleet_rolling_update_max_window_seconds", "The bound on that window (rolling_max_seconds)",
             status.rolling_update.max_window_seconds),
            ("rlfleet_pin_violations", "Samples that ran on another version than their request's pin (must stay "
                                       "0)", status.rolling_update.pin_violations),
            ("rlfleet_pins_retired", "Pinned groups generated again: no replica served their version any more",
             status.rolling_update.pins_retired),
        ):
            yield GaugeMetricFamily(name, help_text, value=value)
        by_lag = GaugeMetricFamily("rlfleet_mismatch_kl_k3", "k3 KL between trainer and behaviour log-probs "
                                   "trainers measured, per version lag (its last report within the horizon)",
                                   labels=["lag"])
        for measured in mismatch.measured:
            by_lag.add_metric([str(measured.lag)], measured.kl_k3)
        yield by_lag
        run = GaugeMetricFamily("rlfleet_run_info", "1, labelled with the run the collector holds (its id, its name "
                                "where runs share a fleet, and whether this process resumed it)",
                                labels=["run_id", "run", "resumed"])
        run.add_metric([status.run.run_id, status.run.name, str(status.run.resumed).lower()], 1)
        yield run


STATUS_METRICS = StatusMetrics()
REGISTRY.register(STATUS_METRICS)
