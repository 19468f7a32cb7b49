"""The collector service: the lifecycle of the parts ``build.py`` wires. It starts them in order, supervises
their loops (one that dies takes the service to NOT_SERVING, and every trainer call then answers
FAILED_PRECONDITION with the reason), says whether it serves, and stops them.

Each concern is a part the servicers call through its own interface: the weight fan-out
(``fanout.py``), submissions (``submissions.py``), the mismatch breaker's state (``breaker_state.py``), what
follows a commit (``commits.py``), the watches of the upstream services and the replicas (``watchers.py``),
the status (``status_view.py``), the prompt ledger."""

from __future__ import annotations

import logging

import grpc

from rlfleet.services.collector.build import build
from rlfleet.services.collector.config import CollectorConfig
from rlfleet.services.collector.run import check_call as check_run_call
from rlfleet.services.collector.servicer import CollectorServicer, TrajectoryProxyServicer
from rlfleet.services.collector.status_metrics import STATUS_METRICS
from rlfleet.services.common.database import DatabaseUnavailable
from rlfleet.services.common.errors import Unavailable
from rlfleet.services.common.server import Service
from rlfleet.v1 import collector_pb2, collector_pb2_grpc, trajectory_pb2_grpc

log = logging.getLogger("rlfleet.collector")


class CollectorService(Service[CollectorConfig]):
    service_names = (
        collector_pb2.DESCRIPTOR.services_by_name["CollectorService"].full_name,
        "rlfleet.v1.TrajectoryService",
    )

    def __init__(self, config: CollectorConfig):
        super().__init__(config)
        parts = build(config, supervise=self.supervise, on_fatal=self.fail, on_lost=self._database_lost)
        self.settings, self.run, self.gate, self.pool = parts.settings, parts.run, parts.gate, parts.pool
        self.ledger, self.source, self.pipeline, self.fanout = parts.ledger, parts.source, parts.pipeline, parts.fanout
        self.trajectory = parts.trajectory
        self.upstream, self.replicas, self.breaker = parts.upstream, parts.replicas, parts.breaker
        self.commits, self.submissions, self.status_view = parts.commits, parts.submissions, parts.status
        self.not_serving_reason = "starting"
        """Why the collector does not serve yet ("" once it does)."""

    def torch_threads(self) -> int:
        return 1  # small tensors: see Service.torch_threads

    def add_to_server(self, server: grpc.aio.Server) -> None:
        collector_pb2_grpc.add_CollectorServiceServicer_to_server(CollectorServicer(self), server)
        trajectory_pb2_grpc.add_TrajectoryServiceServicer_to_server(TrajectoryProxyServicer(self), server)

    def _database_lost(self, lost: DatabaseUnavailable) -> None:
        """The connection to the collector's PostgreSQL database is lost: the collector stops serving
        (NOT_SERVING naming the database), as for any failed ledger write; restarted, it resumes from the
        database. Nothing acknowledged is lost, nothing half-written is taken for done."""
        self.fail("the collector database", lost)

    # --- lifecycle --------------------------------------------------------------
    async def start(self) -> None:
        """Wait for the dependencies, agree on the version, start the pipeline."""
        await self.breaker.restore()  # before SubmitPrompts is taken
        STATUS_METRICS.status = self.status  # what GetStatus shows of off-policy control, /metrics shows
        pending = await self.source.restore()  # first: SubmitPrompts waits for it
        _, self.pipeline.failed_prompts = await self.ledger.failures(0, 0)
        if pending:
            log.info("generating the prompts pending when the collector stopped", extra={"prompts": pending})
        await self.upstream.wait_for_all(self._waiting)
        await self.replicas.update_members()
        committed = await self.ledger.committed_version()
        self.not_serving_reason = "probing the generation replicas"
        versions = await self.replicas.probe_all()
        # The saved version is the truth once there is one: it is written (durably) at every
        # commit, so a replica ahead of it applied a push that never committed (the collector
        # died mid-commit) and is rolled back from the spool by the replica monitor.
        self.gate.restart_at(committed if committed is not None else max([0, *versions.values()]))
        await self.replicas.admit(versions, self.gate.version)
        log.info("collector ready", extra={"version": self.gate.version, "replicas": versions})
        log.info("%s: %s", self.run.describe(self.gate.version),
                 "resumed from the state it left" if self.run.resumed else "a new run")
        self.not_serving_reason = ""
        self.supervise(self.pipeline.run(), "the rollout loop")
        self.supervise(self.replicas.run(), "the replica monitor")
        self.supervise(self.replicas.watch_members(), "the replica discovery")
        self.supervise(self.upstream.run(), "the upstream health watch")

    def _waiting(self, reason: str) -> None:
        self.not_serving_reason = reason

    async def stop(self) -> None:
        await self.stop_supervised()
        self.fanout.close()
        self.ledger.close()
        await self.pool.close()
        await self.upstream.close()

    # --- whether it serves ------------------------------------------------------
    def status(self) -> collector_pb2.GetStatusResponse:
        return self.status_view.snapshot(self.serving_problem, bool(self.failure))

    @property
    def serving_problem(self) -> str:
        """Why the collector does not serve ("" when it does): it failed, it is starting, or an
        upstream outage."""
        return self.failure or self.not_serving_reason or self.upstream.problem()

    def check_serving(self) -> None:
        """FAILED_PRECONDITION once the collector failed; UNAVAILABLE until it serves (see
        ``not_serving_reason``)."""
        self.check_working()
        if self.not_serving_reason:
            raise Unavailable(f"the collector does not serve yet: {self.not_serving_reason}")

    def check_trainer_call(self, metadata=()) -> None:
        """What a trainer's push, submission or batch stream must pass: the collector works, the call is
        not from another run (``run.check_call`` on its ``metadata``), and the mismatch breaker is closed
        (FAILED_PRECONDITION naming the measurement otherwise)."""
        self.check_working()
        check_run_call(self.run, metadata)
        self.breaker.check()

    def check_submitting(self, metadata=()) -> None:
        """Submissions are taken from the moment the prompt ledger is read (before the replicas
        answer: the prompts wait durably), until the collector fails; not while the mismatch breaker is open."""
        self.check_trainer_call(metadata)
        self.submissions.check_open()
