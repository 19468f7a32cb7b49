"""The collector's parts, wired from its config (``build``): what ``CollectorService`` supervises and serves.

In the order they depend on each other: the upstream channel settings; the version gate and the mismatch
breaker; the replica pool and where its replicas are found; the durable state (the ledger, in SQLite or
PostgreSQL, and the run it holds; ``fresh`` deletes it first); the prompt source over it; the channels to the
reference, reward, trajectory (and environment) services; the weight fan-out and its spool; the rollout
pipeline. Nothing here starts a task or makes a call: ``CollectorService.start`` does.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import grpc

from rlfleet.choices import ADVANTAGE_MODES, KL_ESTIMATORS
from rlfleet.rpc.channel import ChannelSettings, aio_channel
from rlfleet.services.collector.admission import VersionGate
from rlfleet.services.collector.config import CollectorConfig
from rlfleet.services.collector.dataset import load_records
from rlfleet.services.collector.discovery import Discovery, make_discovery
from rlfleet.services.collector.episode_runner import EpisodeBudget, EpisodeRunner
from rlfleet.services.collector.fanout import WeightFanout
from rlfleet.services.collector.filtering import FilterRule
from rlfleet.services.collector.ledger import PromptLedger
from rlfleet.services.collector.mismatch import MismatchBreaker
from rlfleet.services.collector.replicas import ReplicaPool
from rlfleet.services.collector.rolling import RollingSettings
from rlfleet.services.collector.rollout import Pipeline, PipelineOptions
from rlfleet.services.collector.run import Run
from rlfleet.services.collector.source import PromptSource
from rlfleet.services.collector.spool import DatabaseSpool
from rlfleet.services.collector.state_schema import LEGACY_FILES
from rlfleet.services.common.database import DatabaseUnavailable, purge_database
from rlfleet.services.common.errors import InvalidArgument, StartupError
from rlfleet.services.common.upstream import upstream_settings
from rlfleet.v1 import environment_pb2_grpc, reference_pb2_grpc, reward_pb2_grpc, trajectory_pb2_grpc, weights_pb2

log = logging.getLogger("rlfleet.collector")


@dataclass
class CollectorParts:
    settings: ChannelSettings
    state_dir: Path
    gate: VersionGate
    mismatch: MismatchBreaker
    pool: ReplicaPool
    discovery: Discovery
    ledger: PromptLedger
    run: Run
    """The run the state belongs to (``run.py``)."""
    source: PromptSource
    addresses: dict[str, str]
    """The upstream services (not the replicas) by name."""
    channels: dict[str, grpc.aio.Channel]
    trajectory: trajectory_pb2_grpc.TrajectoryServiceStub
    fanout: WeightFanout
    pipeline: Pipeline


def build(config: CollectorConfig, *,
          on_commit: Callable[[int, weights_pb2.WeightManifest | None], Awaitable[None]],
          on_fatal: Callable[[str, BaseException], None],
          on_lost: Callable[[DatabaseUnavailable], None]) -> CollectorParts:
    """The collector's parts for ``config``. ``on_commit`` makes a pushed version the committed one durably,
    ``on_fatal`` fails the service (a background part raised what nobody expected), ``on_lost`` is told when
    the PostgreSQL connection is lost. StartupError for a dataset that cannot be read."""
    settings = upstream_settings(config, config.max_message_bytes)
    state_dir = Path(config.state_dir)
    if not config.database_url:
        state_dir.mkdir(parents=True, exist_ok=True)
    gate = VersionGate(groups_per_step=config.groups_per_step, max_staleness=config.max_staleness,
                       sync=config.mode == "sync")
    mismatch = MismatchBreaker(config.mismatch_kl_threshold, config.mismatch_trip_batches, config.mismatch_kl_target,
                               config.mismatch_horizon)
    pool = ReplicaPool(settings)
    discovery = make_discovery(config.generation_addresses, config.generation_addresses_file,
                               config.resolve_generation_addresses)
    records = load_records(config.dataset_path) if config.dataset_path else []
    if config.fresh:
        delete_state(config, state_dir)
    # The durable state: a SQLite file in the state directory, or PostgreSQL (``ledger.py``).
    ledger = PromptLedger(config.database_url or state_dir / "prompts.sqlite3", schema=config.database_schema,
                          max_dead_letters=config.max_dead_letters,
                          state_dir=None if config.database_url else state_dir, on_lost=on_lost)
    run = ledger.open_run()
    try:
        source = PromptSource(ledger, records, prompt_field=config.prompt_field,
                              ground_truth_field=config.ground_truth_field, shuffle=config.shuffle, seed=config.seed,
                              epochs=config.epochs, max_submitted=config.max_submitted_prompts,
                              curriculum_revisit=config.curriculum_revisit_fraction if config.curriculum else None)
    except InvalidArgument as exc:
        ledger.close()
        raise StartupError(f"dataset_path: {config.dataset_path}: {exc}") from None
    addresses = {"reference": config.reference_address, "reward": config.reward_address,
                 "trajectory": config.trajectory_address}
    if config.environment_address:
        addresses["environment"] = config.environment_address
    channels = {name: aio_channel(address, settings) for name, address in addresses.items()}
    trajectory = trajectory_pb2_grpc.TrajectoryServiceStub(channels["trajectory"])
    # The spool beside the state: files in the state directory, or the PostgreSQL database's rows.
    fanout = WeightFanout(pool, gate, state_dir / "spool", config.max_push_bytes, on_commit=on_commit,
                          on_fatal=on_fatal, swap_mode=config.swap_mode, update_strategy=config.update_strategy,
                          rolling=RollingSettings(max_unavailable=config.rolling_max_unavailable,
                                                  drain_seconds=config.rolling_drain_seconds,
                                                  max_seconds=config.rolling_max_seconds,
                                                  settle_seconds=config.rolling_settle_seconds),
                          spool=DatabaseSpool(ledger) if ledger.in_postgresql else None)
    episodes = None
    if "environment" in channels:
        episodes = EpisodeRunner(environment_pb2_grpc.EnvironmentServiceStub(channels["environment"]), settings,
                                 EpisodeBudget(config.max_turns, config.max_episode_tokens))
    pipeline = Pipeline(pipeline_options(config), gate, pool, source,
                        reference_pb2_grpc.ReferenceServiceStub(channels["reference"]),
                        reward_pb2_grpc.RewardServiceStub(channels["reward"]), trajectory, settings,
                        on_fatal=on_fatal, episodes=episodes)
    return CollectorParts(settings=settings, state_dir=state_dir, gate=gate, mismatch=mismatch, pool=pool,
                          discovery=discovery, ledger=ledger, run=run, source=source, addresses=addresses,
                          channels=channels, trajectory=trajectory, fanout=fanout, pipeline=pipeline)


def pipeline_options(config: CollectorConfig) -> PipelineOptions:
    return PipelineOptions(
        group_size=config.group_size, sampling=dict(config.sampling), default_reward_fn=config.reward_fn,
        kl_estimator=KL_ESTIMATORS[config.kl_estimator], advantage_mode=ADVANTAGE_MODES[config.advantage_mode],
        update_kl_controller=config.update_kl_controller, max_groups_in_flight=config.max_groups_in_flight,
        max_generations_in_flight=config.max_generations_in_flight, max_scoring_in_flight=config.max_scoring_in_flight,
        max_groups_per_call=config.max_groups_per_call, default_environment=config.environment,
        prompt_attempts=config.prompt_attempts, retry_backoff_seconds=config.retry_backoff_seconds,
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
