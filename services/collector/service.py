"""The collector service: serves the parts ``build.py`` wires (prompt source, version gate, replicas,
fan-out and rollout) and supervises their background tasks (one that dies takes the service to NOT_SERVING, and every
trainer call then answers FAILED_PRECONDITION with the reason)."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfleet.rpc.channel import call_with_retry
from rlfleet.rpc.errors import RlfleetClientError
from rlfleet.services.collector import metrics
from rlfleet.services.collector.build import build
from rlfleet.services.collector.config import CollectorConfig
from rlfleet.services.collector.mismatch import LagMismatch
from rlfleet.services.collector.prompt_item import PromptItem
from rlfleet.services.collector.run import check_call as check_run_call
from rlfleet.services.collector.servicer import CollectorServicer, TrajectoryProxyServicer
from rlfleet.services.collector.status_metrics import STATUS_METRICS
from rlfleet.services.common.database import DatabaseUnavailable
from rlfleet.services.common.errors import InvalidArgument, Unavailable, UpstreamError
from rlfleet.services.common.server import Service
from rlfleet.wire import shm
from rlfleet.v1 import collector_pb2, collector_pb2_grpc, reward_pb2, trajectory_pb2, trajectory_pb2_grpc, weights_pb2

log = logging.getLogger("rlfleet.collector")


class CollectorService(Service[CollectorConfig]):
    service_names = (
        collector_pb2.DESCRIPTOR.services_by_name["CollectorService"].full_name,
        "rlfleet.v1.TrajectoryService",
    )

    def __init__(self, config: CollectorConfig):
        super().__init__(config)
        parts = build(config, on_commit=self._committed, on_fatal=self.fail, on_lost=self._database_lost)
        self.settings, self.state_dir, self.run = parts.settings, parts.state_dir, parts.run
        self.gate, self.mismatch, self.pool, self.discovery = parts.gate, parts.mismatch, parts.pool, parts.discovery
        self.ledger, self.source, self.fanout, self.pipeline = parts.ledger, parts.source, parts.fanout, parts.pipeline
        self._addresses, self._channels, self.trajectory = parts.addresses, parts.channels, parts.trajectory
        """The upstream services (not the replicas) by name: their addresses and channels."""
        self.not_serving_reason = "starting"
        """Why the collector does not serve yet ("" once it does)."""
        self.outages: dict[str, str] = {}
        """Upstream services found down since the start (name -> what their health check answered),
        and "generation" while no replica is in rotation: ``Status.serving`` is false meanwhile."""

    def torch_threads(self) -> int:
        return 1  # small tensors: see Service.torch_threads

    def add_to_server(self, server: grpc.aio.Server) -> None:
        collector_pb2_grpc.add_CollectorServiceServicer_to_server(CollectorServicer(self), server)
        trajectory_pb2_grpc.add_TrajectoryServiceServicer_to_server(TrajectoryProxyServicer(self), server)

    # --- state ----------------------------------------------------------------
    def run_info(self) -> collector_pb2.RunInfo:
        return collector_pb2.RunInfo(run_id=self.run.run_id, created_at=self.run.created_at,
                                     resumed=self.run.resumed, policy_version=self.gate.version)

    def _database_lost(self, lost: DatabaseUnavailable) -> None:
        """The connection to the collector's PostgreSQL database is lost: the collector stops serving
        (NOT_SERVING naming the database), as for any failed ledger write; restarted, it resumes from the
        database. Nothing acknowledged is lost, nothing half-written is taken for done."""
        self.fail("the collector database", lost)

    async def _committed(self, version: int, spool_manifest: weights_pb2.WeightManifest | None = None) -> None:
        """Every replica that applied serves ``version``: it is durable before the trainer hears of it (in
        the collector's database: with the spool's manifest when the spool is there too). The dataset
        position lives there as well (moved with each prompt drawn)."""
        await self.ledger.commit_version(version, spool_manifest.SerializeToString()
                                         if spool_manifest is not None else None)
        if self.gate.sync:
            self.supervise(self.drop_stale(version), f"drop-stale-{version}")

    async def drop_stale(self, version: int) -> None:
        """Sync mode, after a commit: groups older than ``version`` still buffered (unread) can never
        reach the trainer; drop them from the trajectory service and generate their prompts again.
        Failures are retried at the next commit (which drops everything older, too)."""
        try:
            dropped = await call_with_retry(
                self.trajectory.DropStale, trajectory_pb2.DropStaleRequest(below_policy_version=version),
                method="DropStale", settings=self.settings)
        except RlfleetClientError as exc:
            log.warning("could not drop stale groups after the commit of v%d (retried at the next): %s", version, exc)
            return
        await self.regenerate(list(dropped.prompt_ids), int(dropped.dropped), f"dropped below v{version}")
        await self.ledger.forget_appended(version - 1)  # kept one commit longer: a leased batch may come back

    async def regenerate(self, prompt_ids: list[str], samples: int, why: str) -> None:
        """Generate again the prompts of stale groups that were deleted unread (counted as discarded)."""
        if not samples:
            return
        self.pipeline.discards.add(samples)
        missing = await self.source.regenerate(prompt_ids)
        await self.gate.reopen(len(prompt_ids))  # one group per prompt: its slot goes to a regenerated one
        log.info("stale groups deleted unread, prompts generated again",
                 extra={"why": why, "samples": samples, "prompts": len(prompt_ids) - len(missing)})
        if missing:
            log.warning("stale groups deleted whose prompts had left the ledger (not generated again)",
                        extra={"prompt_ids": missing[:20], "count": len(missing)})

    # --- lifecycle --------------------------------------------------------------
    async def start(self) -> None:
        """Wait for the dependencies, agree on the version, start the pipeline."""
        await self._restore_breaker()  # before SubmitPrompts is taken
        STATUS_METRICS.status = self.status  # what GetStatus shows of off-policy control, /metrics shows
        pending = await self.source.restore()  # first: SubmitPrompts waits for it
        _, self.pipeline.failed_prompts = await self.ledger.failures(0, 0)
        if pending:
            log.info("generating the prompts pending when the collector stopped", extra={"prompts": pending})
        await self._wait_for_dependencies()
        await self._update_members()
        committed = await self.ledger.committed_version()
        self.not_serving_reason = "probing the generation replicas"
        versions = await self._probe_replicas()
        # The saved version is the truth once there is one: it is written (durably) at every
        # commit, so a replica ahead of it applied a push that never committed (the collector
        # died mid-commit) and is rolled back from the spool by the replica monitor.
        self.gate.restart_at(committed if committed is not None else max([0, *versions.values()]))
        for replica in self.pool.replicas:
            if versions.get(replica.address) == self.gate.version:
                await self.pool.mark_healthy(replica, self.gate.version)
        log.info("collector ready", extra={"version": self.gate.version, "replicas": versions})
        log.info("%s: %s", self.run.describe(self.gate.version),
                 "resumed from the state it left" if self.run.resumed else "a new run")
        self.not_serving_reason = ""
        self.supervise(self.pipeline.run(), "the rollout loop")
        self.supervise(self._watch_replicas(), "the replica monitor")
        self.supervise(self._watch_members(), "the replica discovery")
        self.supervise(self._watch_upstream(), "the upstream health watch")

    async def _update_members(self) -> None:
        added, removed = await self.pool.update(await self.discovery.endpoints())
        for replica in added:
            log.info("replica %s joined (from %s): in rotation once it serves the committed version",
                     replica.address, self.discovery.describe())
        for replica in removed:
            log.info("replica %s left (no longer in %s): out of rotation; %d samples still in flight there",
                     replica.address, self.discovery.describe(), replica.in_flight)
        metrics.REPLICA_MEMBERS.set(len(self.pool.replicas))

    async def _watch_members(self) -> None:
        """The replica list asked again every ``discovery_refresh_seconds`` (``discovery.py``): new replicas
        wait out of rotation for the replica monitor to re-sync them; gone ones leave at once."""
        while True:
            await asyncio.sleep(self.config.discovery_refresh_seconds)
            await self._update_members()

    async def _probe_replicas(self) -> dict[str, int]:
        """Every replica's version, waiting (bounded) for all of them so the first groups spread over all."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.replica_startup_seconds
        while True:
            probed = await asyncio.gather(*(self.pool.probe(r) for r in self.pool.replicas))
            versions = {r.address: v for r, v in zip(self.pool.replicas, probed) if v is not None}
            if len(versions) == len(self.pool.replicas) or (versions and loop.time() >= deadline):
                return versions
            log.info("waiting for generation replicas",
                     extra={"answered": sorted(versions), "replicas": len(self.pool.replicas)})
            await asyncio.sleep(1.0)

    async def _health(self, name: str) -> str:
        """What ``name``'s health check answers: "" when SERVING, else the status or error code."""
        try:
            reply = await health_pb2_grpc.HealthStub(self._channels[name]).Check(
                health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return ""
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def _wait_for_dependencies(self) -> None:
        for name in self._channels:
            while answer := await self._health(name):
                self.not_serving_reason = f"waiting for {name} at {self._addresses[name]}: {answer}"
                log.info(self.not_serving_reason)
                await asyncio.sleep(1.0)

    async def _watch_upstream(self) -> None:
        """Once serving: the upstream services' health every ``replica_check_seconds`` (and whether any
        replica is in rotation), for ``Status.serving``; the pipeline draws no prompt while one of them is
        down. An outage is one WARNING line, its end one INFO line; nothing submitted is lost."""
        while True:
            await asyncio.sleep(self.config.replica_check_seconds)
            answers = dict(zip(self._channels, await asyncio.gather(*(self._health(n) for n in self._channels))))
            answers["generation"] = "" if self.pool.healthy() else "no replica in rotation"
            for name, answer in answers.items():
                if answer and name not in self.outages:
                    where = f" at {self._addresses[name]}" if name in self._addresses else ""
                    log.warning("%s%s is down (%s): generation pauses until it is back", name, where, answer)
                elif not answer and name in self.outages:
                    log.info("%s is back", name)
            self.outages = {name: answer for name, answer in answers.items() if answer}
            if any(name in self._addresses for name in self.outages):
                self.pipeline.upstream_up.clear()
            else:
                self.pipeline.upstream_up.set()

    async def _watch_replicas(self) -> None:
        """Bring failed replicas back: probe, re-sync (or roll back) to the committed version, rejoin.
        Replicas in rotation are probed too: one that restarted between two pushes (serving its
        checkpoint, not the committed version) goes out of rotation and is re-synced. Also sweeps
        shm segments left by killed processes."""
        while True:
            await asyncio.sleep(self.config.replica_check_seconds)
            await asyncio.to_thread(shm.sweep_stale)
            metrics.REPLICA_HEALTHY.set(len(self.pool.healthy()))
            for replica in list(self.pool.replicas):
                if replica.gone:
                    continue
                if replica.healthy:
                    await self._check_in_rotation(replica)
                    continue
                if self.fanout.busy:
                    continue  # a push or re-sync moves versions (a rolling update, for minutes): next tick
                version = await self.pool.probe(replica)
                if version is None or self.fanout.busy:
                    continue
                if version != self.gate.version and not await self.fanout.resync(replica):
                    continue
                if replica.gone:
                    continue  # it left while it was being re-synced
                await self.pool.mark_healthy(replica, self.gate.version)
                log.info("replica %s in rotation", replica.address)

    async def _check_in_rotation(self, replica) -> None:
        pushes = self.fanout.pushes
        if self.fanout.busy:
            return
        version = await self.pool.probe(replica)
        if version is None or self.fanout.busy or self.fanout.pushes != pushes or not replica.healthy:
            return  # unreachable (its calls will tell), or versions moved meanwhile: judge next time
        if version != replica.policy_version:
            await self.pool.mark_failed(
                replica, f"serves version {version}, not {replica.policy_version} (restarted?)")

    async def stop(self) -> None:
        await self.stop_supervised()
        self.fanout.close()
        self.ledger.close()
        await self.pool.close()
        await asyncio.gather(*(c.close() for c in self._channels.values()), return_exceptions=True)

    def status(self) -> collector_pb2.GetStatusResponse:
        pipeline = self.pipeline
        return collector_pb2.GetStatusResponse(
            policy_version=self.gate.version, mode=self.config.mode, max_staleness=self.gate.max_staleness,
            stages=[collector_pb2.StageStatus(name=s.name, queued=s.queued, in_flight=s.in_flight,
                                              items_per_second=s.rate()) for s in pipeline.stages.values()],
            replicas=[collector_pb2.ReplicaStatus(address=r.address, healthy=r.healthy,
                                                  policy_version=r.policy_version, in_flight=r.in_flight,
                                                  weight_transfer_world_size=r.transfer_world_size,
                                                  draining=r.draining)
                      for r in self.pool.replicas],
            staleness_histogram=pipeline.append.staleness_histogram(), trajectories=pipeline.append.appended,
            discarded_samples=pipeline.discards.samples, group_size=self.config.group_size,
            groups_per_step=self.config.groups_per_step, pending_prompts=self.source.pending,
            failed_prompts=pipeline.failed_prompts + self.source.bad_rows, serving=not self.serving_problem,
            not_serving_reason=self.serving_problem, failed=bool(self.failure),
            spool_error=self.fanout.spool_error, episodes=pipeline.append.episodes_appended,
            episode_turns=pipeline.append.episode_turns, mismatch=self.mismatch_status(),
            dynamic_sampling=collector_pb2.DynamicSamplingStatus(
                enabled=self.config.dynamic_sampling, min_score_range=self.config.dynamic_sampling_min_score_range,
                filtered_groups=self.ledger.filtered_groups, filtered_samples=self.ledger.filtered_samples,
                filter_rate=pipeline.filter_rate.rate, oversampling=1.0 / (1.0 - pipeline.filter_rate.expected_loss),
                curriculum_skipped=self.source.curriculum_skipped, curriculum=self.config.curriculum),
            discarded_tokens=pipeline.discards.tokens, rolling_update=self.rolling_status(), run=self.run_info(),
        )

    def rolling_status(self) -> collector_pb2.RollingUpdateStatus | None:
        """The rolling update in progress, else the last one (None before the first), with the pin counters."""
        update, generate = self.fanout.rolling, self.pipeline.generate
        if update is None and not generate.pinned_groups:
            return None
        status = update.status() if update is not None else collector_pb2.RollingUpdateStatus()
        status.pinned_groups = generate.pinned_groups
        status.pin_violations, status.pins_retired = generate.pin_violations, generate.pins_retired
        return status

    def mismatch_status(self) -> collector_pb2.MismatchStatus:
        breaker = self.mismatch
        return collector_pb2.MismatchStatus(
            breaker_open=breaker.open, reason=breaker.reason, threshold=breaker.threshold or 0.0,
            trip_batches=breaker.trip_batches, consecutive_over=breaker.consecutive_over, reports=breaker.reports,
            kl_target=breaker.kl_target or 0.0, admission_staleness=self.gate.admission_staleness,
            measured=[collector_pb2.LagMismatch(lag=m.lag, kl_k3=m.kl_k3, kl_k1=m.kl_k1, ess_token=m.ess_token,
                                                tokens=m.tokens) for m, _ in sorted(breaker.measured.values(),
                                                                                    key=lambda kept: kept[0].lag)],
            latest=[collector_pb2.LagMismatch(lag=m.lag, kl_k3=m.kl_k3, kl_k1=m.kl_k1, ess_token=m.ess_token,
                                              tokens=m.tokens) for m in breaker.latest.values()])

    async def report_mismatch(self, policy_version: int, lags: list[LagMismatch], report_id: str = "") -> None:
        """A trainer's measurement: opening the breaker holds admission (durably: a restarted collector
        keeps it open); the KL target bounds it. A report whose id was taken already changes nothing."""
        saved: dict[str, str | None] = {}
        opened = self.mismatch.report(policy_version, lags, report_id)
        if opened is None:
            return
        if opened:
            saved["mismatch_breaker"] = json.dumps({"reason": self.mismatch.reason})
        if self.mismatch.kl_target is not None:  # what admission acts on survives a restart
            saved["mismatch_measured"] = json.dumps(self.mismatch.measurements())
        if saved:
            await self.ledger.set_meta(saved)  # before admission is held: a restart keeps what it acted on
        if opened:
            await self.gate.hold(True)
        await self.gate.bound_admission(self.mismatch.admission_staleness(self.gate.max_staleness))

    async def close_mismatch_breaker(self) -> bool:
        await self.ledger.set_meta({"mismatch_breaker": None})  # durably closed first: a restart keeps it closed
        was_open = self.mismatch.close()
        await self.gate.hold(False)
        return was_open

    async def _restore_breaker(self) -> None:
        """The breaker's state as the database keeps it (``mismatch_breaker`` while open: what it opened on;
        ``mismatch_measured``: the mismatch per lag, with ``mismatch_kl_target``)."""
        measured = await self.ledger.meta("mismatch_measured")
        if self.mismatch.kl_target is not None and measured is not None:
            self.mismatch.restore_measurements(json.loads(measured))
            await self.gate.bound_admission(self.mismatch.admission_staleness(self.gate.max_staleness))
        breaker = await self.ledger.meta("mismatch_breaker")
        if breaker is not None:
            self.mismatch.reason = json.loads(breaker)["reason"]
            log.error("the mismatch breaker is open since before this start: %s", self.mismatch.reason)
            await self.gate.hold(True)

    def check_trainer_call(self, metadata=()) -> None:
        """What a trainer's push, submission or batch stream must pass: the collector works, the call is
        not from another run (``run.check_call`` on its ``metadata``), and the mismatch breaker is closed
        (FAILED_PRECONDITION naming the measurement otherwise)."""
        self.check_working()
        check_run_call(self.run, metadata)
        self.mismatch.check()

    @property
    def serving_problem(self) -> str:
        """Why the collector does not serve ("" when it does): it failed, it is starting, or an
        upstream outage."""
        if self.failure:
            return self.failure
        if self.not_serving_reason:
            return self.not_serving_reason
        return "; ".join(f"{name} at {self._addresses[name]} is down: {answer}" if name in self._addresses
                         else f"{name}: {answer}" for name, answer in sorted(self.outages.items()))

    def check_serving(self) -> None:
        """FAILED_PRECONDITION once the collector failed; UNAVAILABLE until it serves (see
        ``not_serving_reason``)."""
        self.check_working()
        if self.not_serving_reason:
            raise Unavailable(f"the collector does not serve yet: {self.not_serving_reason}")

    def check_submitting(self, metadata=()) -> None:
        """Submissions are taken from the moment the prompt ledger is read (before the replicas
        answer: the prompts wait durably), until the collector fails; not while the mismatch breaker is open."""
        self.check_trainer_call(metadata)
        if not self.source.restored:
            raise Unavailable("the collector is starting: its prompt ledger is not read yet")

    async def submit(self, items: list[PromptItem]) -> list[str]:
        """Queue validated prompts durably, once the reward service said it takes their tasks."""
        self._check_episodes(items)
        await self._check_tasks(items)
        return await self.source.submit(items)

    def _check_episodes(self, items: list[PromptItem]) -> None:
        """A prompt run as an episode needs an environment service and a text or chat prompt."""
        for index, item in enumerate(items):
            environment = item.environment or self.config.environment
            if not environment:
                continue
            if "environment" not in self._channels:
                raise InvalidArgument(f"prompts[{index}].environment: {environment[:64]!r} needs a collector "
                                      "with an environment_address (this one has none)")
            item.episode_prompt(f"prompts[{index}].prompt")

    async def _check_tasks(self, items: list[PromptItem]) -> None:
        """Ask the reward service whether it has each prompt's reward function and takes its arguments:
        a prompt it would refuse is refused now (NOT_FOUND / INVALID_ARGUMENT naming the prompt).
        While the reward service is down the prompts are taken unchecked (a WARNING): taking them
        durably matters more, and the reward stage still dead-letters what it refuses."""
        if "reward" in self.outages:
            log.warning("reward service down: %d prompts taken without checking their reward functions",
                        len(items))
            return
        first: dict[tuple, int] = {}  # distinct task -> the first prompt carrying it
        for index, item in enumerate(items):
            key = (item.reward_fn or self.config.reward_fn, item.ground_truth, tuple(sorted(item.reward_args.items())))
            first.setdefault(key, index)
        tasks = [reward_pb2.Task(reward_fn=fn, ground_truth=truth, args=dict(args)) for fn, truth, args in first]
        try:
            await call_with_retry(self.pipeline.score.reward.CheckTasks, reward_pb2.CheckTasksRequest(tasks=tasks),
                                  method="CheckTasks", settings=self.settings, timeout=30)
        except RlfleetClientError as error:
            if error.code not in ("INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED"):
                log.warning("reward service unreachable (%s): %d prompts taken without checking their reward "
                            "functions", error.code, len(items))
                return
            # The refused task, typed (its index in ``tasks``): named as the first prompt carrying it.
            refused, carriers = error.sample_error, list(first.values())
            if refused is not None and 0 <= refused.sample < len(carriers):
                raise UpstreamError(error.code, f"prompts[{carriers[refused.sample]}]: {refused.description}") from None
            raise UpstreamError(error.code, f"prompts: {error.details}") from None
