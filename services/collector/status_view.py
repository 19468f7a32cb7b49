"""GetStatus assembled from the collector's parts, each asked through its own interface: the gate, the
pool, the pipeline's counts, the prompt source and ledger, the fan-out (spool, rolling updates), the
mismatch breaker and the run."""

from __future__ import annotations

from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.breaker_state import BreakerState
from rlfleet.services.collector.config import CollectorConfig
from rlfleet.services.collector.fanout import WeightFanout
from rlfleet.services.collector.ledger import PromptLedger
from rlfleet.services.collector.replicas import ReplicaPool
from rlfleet.services.collector.rollout import Pipeline, PipelineStatus
from rlfleet.services.collector.run import Run
from rlfleet.services.collector.source import PromptSource
from rlfleet.v1 import collector_pb2


class StatusView:
    def __init__(self, config: CollectorConfig, run: Run, gate: VersionGate, pool: ReplicaPool, pipeline: Pipeline,
                 source: PromptSource, ledger: PromptLedger, fanout: WeightFanout, breaker: BreakerState):
        self._config, self._run, self._gate, self._pool, self._pipeline = config, run, gate, pool, pipeline
        self._source, self._ledger, self._fanout, self._breaker = source, ledger, fanout, breaker

    def run_info(self) -> collector_pb2.RunInfo:
        run = self._run
        return collector_pb2.RunInfo(run_id=run.run_id, created_at=run.created_at, resumed=run.resumed,
                                     policy_version=self._gate.version, name=self._config.run_name)

    def snapshot(self, not_serving_reason: str, failed: bool) -> collector_pb2.GetStatusResponse:
        """The collector's status; ``not_serving_reason`` why it does not serve ("" when it does)."""
        config, counts = self._config, self._pipeline.status()
        return collector_pb2.GetStatusResponse(
            policy_version=self._gate.version, mode=config.mode, max_staleness=self._gate.max_staleness,
            stages=[collector_pb2.StageStatus(name=s.name, queued=s.queued, in_flight=s.in_flight,
                                              items_per_second=s.rate()) for s in counts.stages],
            replicas=[collector_pb2.ReplicaStatus(address=r.address, healthy=r.healthy,
                                                  policy_version=r.policy_version, in_flight=r.in_flight,
                                                  weight_transfer_world_size=r.transfer_world_size,
                                                  draining=r.draining)
                      for r in self._pool.replicas],
            staleness_histogram=counts.staleness_histogram, trajectories=counts.trajectories,
            discarded_samples=counts.discarded_samples, group_size=config.group_size,
            groups_per_step=config.groups_per_step, pending_prompts=self._source.pending,
            failed_prompts=counts.failed_prompts + self._source.bad_rows, serving=not not_serving_reason,
            not_serving_reason=not_serving_reason, failed=failed, spool_error=self._fanout.spool_error,
            episodes=counts.episodes, episode_turns=counts.episode_turns, mismatch=self._breaker.status(),
            dynamic_sampling=self._dynamic_sampling(counts), discarded_tokens=counts.discarded_tokens,
            rolling_update=self._rolling(counts), run=self.run_info())

    def _dynamic_sampling(self, counts: PipelineStatus) -> collector_pb2.DynamicSamplingStatus:
        config = self._config
        return collector_pb2.DynamicSamplingStatus(
            enabled=config.dynamic_sampling, min_score_range=config.dynamic_sampling_min_score_range,
            filtered_groups=self._ledger.filtered_groups, filtered_samples=self._ledger.filtered_samples,
            filter_rate=counts.filter_rate, oversampling=1.0 / (1.0 - counts.expected_filter_loss),
            curriculum_skipped=self._source.curriculum_skipped, curriculum=config.curriculum)

    def _rolling(self, counts: PipelineStatus) -> collector_pb2.RollingUpdateStatus | None:
        """The rolling update in progress, else the last one (None before the first), with the pin counters."""
        update = self._fanout.rolling
        if update is None and not counts.pinned_groups:
            return None
        status = update.status() if update is not None else collector_pb2.RollingUpdateStatus()
        status.pinned_groups = counts.pinned_groups
        status.pin_violations, status.pins_retired = counts.pin_violations, counts.pins_retired
        return status
