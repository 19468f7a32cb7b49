"""Prometheus metrics of the runs sharing a replica, read from the engine's status at scrape time: one
series per run it serves now, labelled ``run``, so a run that ends (``EndRun``) leaves its series with it
and their number is bounded by ``max_runs``."""

from __future__ import annotations

from typing import Callable

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

from rlfleet.services.common.metrics import StatusCollector
from rlfleet.services.generation.status import EngineStatus


class RunMetrics(StatusCollector):
    """A Prometheus collector over ``status`` (the engine's ``status``; None: no family)."""

    status: Callable[[], EngineStatus] | None

    def families(self, status: EngineStatus):
        version = GaugeMetricFamily("rlfleet_replica_run_policy_version",
                                    "The version of each run this replica serves (0: the base weights)", labels=["run"])
        requests = GaugeMetricFamily("rlfleet_replica_run_requests", "Generate calls of each run in flight here, "
                                     "waiting for the run's fair share of the batch or running",
                                     labels=["run", "state"])
        tokens = CounterMetricFamily("rlfleet_replica_run_generated_tokens", "Tokens sampled for each run since "
                                     "the replica started serving it", labels=["run"])
        for run in status.runs:
            version.add_metric([run.run_id], run.policy_version)
            requests.add_metric([run.run_id, "waiting"], run.requests_waiting)
            requests.add_metric([run.run_id, "running"], run.requests_in_flight - run.requests_waiting)
            tokens.add_metric([run.run_id], run.generated_tokens)
        yield from (version, requests, tokens)
        yield GaugeMetricFamily("rlfleet_replica_max_runs", "Runs this replica serves at once", value=status.max_runs)


RUN_METRICS = RunMetrics()
REGISTRY.register(RUN_METRICS)
