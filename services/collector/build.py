"""The collector's parts, wired from its config (``build``): what ``CollectorService`` supervises and serves.

In the order they depend on each other: the upstream channel settings; the version gate; the replica
pool; the durable state (the ledger, in SQLite or PostgreSQL, and the run it holds; ``fresh`` deletes it
first); the prompt source over it; the channels to the reference, reward, trajectory (and environment)
services; the rollout pipeline; what follows a commit; the weight fan-out and its spool; the watches of the
upstream services and of the replicas (and where they are found); the mismatch breaker; submissions; the
status. Nothing here starts a task or makes a call: ``CollectorService.start`` does.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Coroutine

from rlfleet.choices import ADVANTAGE_MODES, KL_ESTIMATORS
from rlfleet.rpc.channel import ChannelSettings, aio_channel
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.breaker_state import BreakerState
from rlfleet.services.collector.commits import Commits
from rlfleet.services.collector.config import CollectorConfig
from rlfleet.services.collector.dataset import load_records
from rlfleet.services.collector.discovery import make_discovery
from rlfleet.services.collector.episode_runner import EpisodeBudget, EpisodeRunner
from rlfleet.services.collector.fanout import WeightFanout
from rlfleet.services.collector.filtering import FilterRule
from rlfleet.services.collector.ledger import PromptLedger
from rlfleet.services.collector.mismatch import MismatchBreaker
from rlfleet.services.collector.replicas import ReplicaPool, ReplicaRun
from rlfleet.services.collector.rolling import RollingSettings
from rlfleet.services.collector.rollout import Pipeline, PipelineOptions
from rlfleet.services.collector.run import Run
from rlfleet.services.collector.source import PromptSource
from rlfleet.services.collector.spool import DatabaseSpool
from rlfleet.services.collector.state_schema import LEGACY_FILES
from rlfleet.services.collector.status_view import StatusView
from rlfleet.services.collector.submissions import Submissions
from rlfleet.services.collector.watchers import ReplicaWatch, UpstreamWatch
from rlfleet.services.common.database import DatabaseUnavailable, purge_database
from rlfleet.services.common.errors import InvalidArgument, StartupError
from rlfleet.services.common.upstream import upstream_settings
from rlfleet.v1 import environment_pb2_grpc, reference_pb2_grpc, reward_pb2_grpc, trajectory_pb2_grpc

log = logging.getLogger("rlfleet.collector")


@dataclass
class CollectorParts:
    settings: ChannelSettings
    gate: VersionGate
    pool: ReplicaPool
    ledger: PromptLedger
    run: Run
    """The run the state belongs to (``run.py``)."""
    source: PromptSource
    trajectory: trajectory_pb2_grpc.TrajectoryServiceStub
    fanout: WeightFanout
    pipeline: Pipeline
    upstream: UpstreamWatch
    replicas: ReplicaWatch
    breaker: BreakerState
    commits: Commits
    submissions: Submissions
    status: StatusView


def build(config: CollectorConfig, *, supervise: Callable[[Coroutine, str], asyncio.Task],
          on_fatal: Callable[[str, BaseException], None],
          on_lost: Callable[[DatabaseUnavailable], None]) -> CollectorParts:
    """The collector's parts for ``config``. ``supervise`` runs a background task of the service's,
    ``on_fatal`` fails the service (a background part raised what nobody expected), ``on_lost`` is told when
    the PostgreSQL connection is lost. StartupError for a dataset that cannot be read."""
    settings = upstream_settings(config, config.max_message_bytes)
    state_dir = Path(config.state_dir)
    if not config.database_url:
        state_dir.mkdir(parents=True, exist_ok=True)
    gate = VersionGate(groups_per_step=config.groups_per_step, max_staleness=config.max_staleness,
                       sync=config.mode == "sync")
    ledger, source = durable_state(config, state_dir, on_lost)
    run = ledger.open_run()
    pool = ReplicaPool(settings, ReplicaRun(run.run_id, config.share_weight, config.run_name)
                       if config.shared_replicas else ReplicaRun())
    addresses = {"reference": config.reference_address, "reward": config.reward_address,
                 "trajectory": config.trajectory_address}
    if config.environment_address:
        addresses["environment"] = config.environment_address
    channels = {name: aio_channel(address, settings) for name, address in addresses.items()}
    trajectory = trajectory_pb2_grpc.TrajectoryServiceStub(channels["trajectory"])
    reward = reward_pb2_grpc.RewardServiceStub(channels["reward"])
    episodes = None
    if "environment" in channels:
        episodes = EpisodeRunner(environment_pb2_grpc.EnvironmentServiceStub(channels["environment"]), settings,
                                 EpisodeBudget(config.max_turns, config.max_episode_tokens))
    pipeline = Pipeline(pipeline_options(config), gate, pool, source,
                        reference_pb2_grpc.ReferenceServiceStub(channels["reference"]), reward, trajectory, settings,
                        on_fatal=on_fatal, episodes=episodes)
    commits = Commits(ledger, gate, source, pipeline, trajectory, settings, supervise)
    fanout = weight_fanout(config, pool, gate, state_dir, ledger, commits, on_fatal)
    upstream = UpstreamWatch(addresses, channels, pool, pipeline.upstream_up, config.replica_check_seconds)
    replicas = ReplicaWatch(pool, make_discovery(config.generation_addresses, config.generation_addresses_file,
                                                 config.resolve_generation_addresses), fanout, gate,
                            check_seconds=config.replica_check_seconds,
                            refresh_seconds=config.discovery_refresh_seconds,
                            startup_seconds=config.replica_startup_seconds)
    breaker = BreakerState(MismatchBreaker(config.mismatch_kl_threshold, config.mismatch_trip_batches,
                                           config.mismatch_kl_target, config.mismatch_horizon), gate, ledger)
    return CollectorParts(
        settings=settings, gate=gate, pool=pool, ledger=ledger, run=run, source=source, trajectory=trajectory,
        fanout=fanout, pipeline=pipeline, upstream=upstream, replicas=replicas, breaker=breaker, commits=commits,
        submissions=Submissions(config, source, reward, upstream, settings),
        status=StatusView(config, run, gate, pool, pipeline, source, ledger, fanout, breaker))


def durable_state(config: CollectorConfig, state_dir: Path,
                  on_lost: Callable[[DatabaseUnavailable], None]) -> tuple[PromptLedger, PromptSource]:
    """The ledger (a SQLite file in the state directory, or PostgreSQL: ``ledger.py``; ``fresh`` deletes it
    first) and the prompt source over it."""
    records = load_records(config.dataset_path) if config.dataset_path else []
    if config.fresh:
        delete_state(config, state_dir)
    ledger = PromptLedger(config.database_url or state_dir / "prompts.sqlite3", schema=config.database_schema,
                          max_dead_letters=config.max_dead_letters,
                          state_dir=None if config.database_url else state_dir, on_lost=on_lost)
    try:
        source = PromptSource(ledger, records, prompt_field=config.prompt_field,
                              ground_truth_field=config.ground_truth_field, shuffle=config.shuffle, seed=config.seed,
                              epochs=config.epochs, max_submitted=config.max_submitted_prompts,
                              curriculum_revisit=config.curriculum_revisit_fraction if config.curriculum else None)
    except InvalidArgument as exc:
        ledger.close()
        raise StartupError(f"dataset_path: {config.dataset_path}: {exc}") from None
    return ledger, source


def weight_fanout(config: CollectorConfig, pool: ReplicaPool, gate: VersionGate, state_dir: Path,
                  ledger: PromptLedger, commits: Commits,
                  on_fatal: Callable[[str, BaseException], None]) -> WeightFanout:
    """The fan-out, its spool beside the state (files in the state directory, or the database's rows)."""
    return WeightFanout(pool, gate, state_dir / "spool", config.max_push_bytes, on_commit=commits.committed,
                        on_fatal=on_fatal, swap_mode=config.swap_mode, update_strategy=config.update_strategy,
                        rolling=RollingSettings(max_unavailable=config.rolling_max_unavailable,
                                                drain_seconds=config.rolling_drain_seconds,
                                                max_seconds=config.rolling_max_seconds,
                                                settle_seconds=config.rolling_settle_seconds),
                        spool=DatabaseSpool(ledger) if ledger.in_postgresql else None, relay=config.weight_relay,
                        join_from_peers=config.join_from_peers)


def pipeline_options(config: CollectorConfig) -> PipelineOptions:
    return PipelineOptions(
        group_size=config.group_size, sampling=dict(config.sampling), default_reward_fn=config.reward_fn,
        kl_estimator=KL_ESTIMATORS[config.kl_estimator], advantage_mode=ADVANTAGE_MODES[config.advantage_mode],
        update_kl_controller=config.update_kl_controller, max_groups_in_flight=config.max_groups_in_flight,
        max_generations_in_flight=config.max_generations_in_flight, max_scoring_in_flight=config.max_scoring_in_flight,
        max_groups_per_call=config.max_groups_per_call, default_environment=config.environment,
        players=dict(config.players), prompt_attempts=config.prompt_attempts, retry_backoff_seconds=config.retry_backoff_seconds,
        filter_rule=FilterRule(config.dynamic_sampling, config.dynamic_sampling_min_score_range, config.pass_score),
        max_oversampling=config.max_oversampling, filter_window=max(32, 4 * config.groups_per_step))


def delete_state(config: CollectorConfig, state_dir: Path) -> None:
    """``fresh``: the previous run's durable state goes before the ledger opens it (a new run starts)."""
    dropped = purge_database(config.database_url or str(state_dir / "prompts.sqlite3"), role="collector",
                             schema=config.database_schema)
    shutil.rmtree(state_dir / "spool", ignore_errors=True)
    for name in LEGACY_FILES:
        (state_dir / name).unlink(missing_ok=True)
    log.warning("fresh: the collector's state deleted, a new run starts", extra={"tables": dropped})
