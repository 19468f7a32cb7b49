"""Background work of the generation, trajectory and reference services runs under ``Service.supervise``:
a task that dies turns health NOT_SERVING and every later call is refused (FAILED_PRECONDITION) naming
why; one cancelled at stop is no failure. The real service objects, started without a server; a fault
injected where the task reads from below (the store, the scorer, the engine)."""

from __future__ import annotations

import asyncio
import sqlite3

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from rlfleet.services.common.errors import FailedPrecondition, Unavailable
from rlfleet.services.common.interceptors import status_for
from rlfleet.services.common.server import HealthServicer, Service
from rlfleet.v1 import generation_pb2, reference_pb2, trajectory_pb2
from rlfleet.wire import Ragged, encode_ragged
from tests.trajectories import make_trajectories

WAIT = 10.0
"""Bound on what a service does on its own (a store call, a 50 ms health poll, one forward pass of a tiny
model): milliseconds, 10 s for a loaded CI machine."""


async def started(service: Service) -> Service:
    """What ``serve`` does around ``start``, without the sockets: health, start, SERVING."""
    service.health = HealthServicer()
    await service.set_serving(False)
    await service.start()
    await service.set_serving(True)
    return service


async def health(service: Service) -> set[int]:
    """The statuses health answers, over the overall name and every served one."""
    return {(await service.health.Check(health_pb2.HealthCheckRequest(service=name), None)).status
            for name in ("", *service.service_names)}


async def failed_with(service: Service, reason: str) -> None:
    """The service failed for ``reason``, and health says NOT_SERVING for every name."""
    await asyncio.wait_for(service.failed.wait(), WAIT)
    assert reason in service.failure

    async def not_serving():
        while await health(service) != {health_pb2.HealthCheckResponse.NOT_SERVING}:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(not_serving(), WAIT)


def assert_refused(error: pytest.ExceptionInfo, service: Service, reason: str) -> None:
    """FAILED_PRECONDITION on the wire, with a message naming the service and the reason."""
    code, details = status_for(error.value)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details.startswith(f"{type(service).__name__} does not work: ") and reason in details


# --- trajectory: lease expiry ---------------------------------------------------------------------------
def trajectory_service(tmp_path):
    from rlfleet.services.trajectory.config import TrajectoryConfig
    from rlfleet.services.trajectory.service import TrajectoryService

    return TrajectoryService(TrajectoryConfig.load(["--db-path", str(tmp_path / "t.sqlite3")], environ={}))


async def test_trajectory_lease_expiry_that_dies_fails_the_service_and_ends_open_streams(tmp_path, monkeypatch):
    from rlfleet.services.trajectory.servicer import TrajectoryServicer
    from rlfleet.services.trajectory.store import TrajectoryStore

    service = await started(trajectory_service(tmp_path))
    servicer = TrajectoryServicer(service.buffer, service)
    await servicer.Append(trajectory_pb2.AppendRequest(trajectories=make_trajectories([1, 1])), None)

    def disk_error(store):
        raise sqlite3.OperationalError("disk I/O error")

    # Expiry runs again when a lease is added: the batch below makes it read the broken store.
    monkeypatch.setattr(TrajectoryStore, "expire", disk_error)
    reader_done = asyncio.Event()

    async def requests():
        yield trajectory_pb2.StreamBatchesRequest(open=trajectory_pb2.OpenBatchStream(batch_size=2, consumer="t"))
        await reader_done.wait()  # the trainer holds the stream open, as trainers do

    async def read_until_refused():
        delivered = [message async for message in servicer.StreamBatches(requests(), None)]
        pytest.fail(f"the stream ended normally after {len(delivered)} messages")

    reason = "the lease expiry died: OperationalError: disk I/O error"
    try:
        with pytest.raises(FailedPrecondition) as ended:  # a batch may come first; then the reason
            await asyncio.wait_for(read_until_refused(), WAIT)
        assert_refused(ended, service, reason)
        await failed_with(service, reason)
        # The stream's own cleanup ran: what it held is ready again.
        assert (await service.buffer.stats()).leased == 0
        for call in (servicer.Append(trajectory_pb2.AppendRequest(trajectories=make_trajectories([2, 2])), None),
                     servicer.GetStats(trajectory_pb2.GetStatsRequest(), None),
                     servicer.DropStale(trajectory_pb2.DropStaleRequest(below_policy_version=1), None)):
            with pytest.raises(FailedPrecondition) as refused:
                await call
            assert_refused(refused, service, reason)
        with pytest.raises(FailedPrecondition) as refused:
            await anext(servicer.StreamBatches(requests(), None))
        assert_refused(refused, service, reason)
    finally:
        reader_done.set()
        await service.stop()
    assert (await health(service)) == {health_pb2.HealthCheckResponse.NOT_SERVING}  # a failure outlives stop


async def test_a_trajectory_service_stopped_normally_has_not_failed(tmp_path):
    service = await started(trajectory_service(tmp_path))
    assert await health(service) == {health_pb2.HealthCheckResponse.SERVING}
    await service.stop()  # cancels lease expiry
    assert service.failure == "" and not service.failed.is_set()


# --- generation: the health watch ---------------------------------------------------------------------
class EngineBelow:
    """The engine's face to the service, in vLLM's place: serving until its liveness check raises
    (``serving``, which the health watch reads every 50 ms)."""

    def __init__(self, config):
        self.broken: Exception | None = None
        self.shut_down = False

    async def start(self) -> None:
        pass

    @property
    def serving(self) -> bool:
        if self.broken is not None:
            raise self.broken
        return True

    async def shutdown(self) -> None:
        self.shut_down = True

    def status(self):  # what /metrics reads of the runs sharing the replica: none here
        from types import SimpleNamespace

        return SimpleNamespace(runs=(), max_runs=0)


async def no_messages():
    return
    yield


def generation_service(monkeypatch):
    from rlfleet.services.generation import service as module
    from rlfleet.services.generation.config import GenerationConfig

    monkeypatch.setattr(module, "GenerationEngine", EngineBelow)
    return module.GenerationService(GenerationConfig.load(["--model", "/m"], environ={}))


async def test_generation_health_watch_that_dies_fails_the_service(monkeypatch):
    from rlfleet.services.generation.servicer import GenerationServicer

    service = await started(generation_service(monkeypatch))
    servicer = GenerationServicer(service.engine, service)
    assert await health(service) == {health_pb2.HealthCheckResponse.SERVING}
    service.engine.broken = RuntimeError("engine core unreachable")
    reason = "the engine health watch died: RuntimeError: engine core unreachable"
    try:
        await failed_with(service, reason)
        with pytest.raises(FailedPrecondition) as refused:
            await servicer.GetEngineStatus(generation_pb2.GetEngineStatusRequest(), None)
        assert_refused(refused, service, reason)
        with pytest.raises(FailedPrecondition) as refused:
            await anext(servicer.Generate(generation_pb2.GenerateRequest(), None))
        assert_refused(refused, service, reason)
        with pytest.raises(FailedPrecondition) as refused:
            await anext(servicer.UpdateWeights(no_messages(), None))
        assert_refused(refused, service, reason)
        # A later "SERVING" (the engine back after a swap) cannot undo the failure.
        await service.set_serving(True)
        assert await health(service) == {health_pb2.HealthCheckResponse.NOT_SERVING}
    finally:
        await service.stop()
    assert service.engine.shut_down


async def test_a_generation_service_stopped_normally_has_not_failed(monkeypatch):
    service = await started(generation_service(monkeypatch))
    await service.stop()  # cancels the health watch
    assert service.failure == "" and not service.failed.is_set() and service.engine.shut_down


# --- reference: the micro-batcher -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(request):
    from rlfleet.services.models.tiny import build_tiny_model

    return build_tiny_model(request.config.cache.mkdir("rlfleet-tiny-model"))


def reference_service(tiny_model):
    from rlfleet.services.reference.config import ReferenceServiceConfig
    from rlfleet.services.reference.service import ReferenceService

    return ReferenceService(ReferenceServiceConfig.load(["--model-path", str(tiny_model)], environ={}))


def score_request() -> reference_pb2.ScoreLogProbsRequest:
    request = reference_pb2.ScoreLogProbsRequest(response_starts=[2])
    encode_ragged(Ragged.from_list([torch.tensor([1, 2, 3, 4], dtype=torch.int64)]), out=request.token_ids)
    return request


async def test_reference_batcher_that_dies_fails_the_service(tiny_model, monkeypatch):
    from rlfleet.services.reference.scorer import ReferenceScorer
    from rlfleet.services.reference.servicer import ReferenceServicer

    service = await started(reference_service(tiny_model))
    servicer = ReferenceServicer(service.batcher, service.config.model_path, service)
    try:
        reply = await asyncio.wait_for(servicer.ScoreLogProbs(score_request(), None), WAIT)
        assert reply.model == service.config.model_path
        # A forward pass that raises is its callers' error; a result the loop cannot split is the loop's.
        monkeypatch.setattr(ReferenceScorer, "score_validated", lambda self, *args: None)
        with pytest.raises(Unavailable, match="reference micro-batcher died: AttributeError"):
            await asyncio.wait_for(servicer.ScoreLogProbs(score_request(), None), WAIT)  # the call in flight
        reason = "the reference micro-batcher died: AttributeError: "
        await failed_with(service, reason)
        with pytest.raises(FailedPrecondition) as refused:
            await servicer.ScoreLogProbs(score_request(), None)
        assert_refused(refused, service, reason)
    finally:
        await service.stop()
    assert service.failure.startswith(reason)  # stop reports nothing more, raises nothing


async def test_a_reference_service_stopped_normally_has_not_failed(tiny_model):
    from rlfleet.services.reference.servicer import ReferenceServicer

    service = await started(reference_service(tiny_model))
    servicer = ReferenceServicer(service.batcher, service.config.model_path, service)
    await asyncio.wait_for(servicer.ScoreLogProbs(score_request(), None), WAIT)  # starts the batching loop
    await service.stop()  # cancels the batching loop
    assert service.failure == "" and not service.failed.is_set()


# --- any service: a task cancelled while the service runs -------------------------------------------------
async def test_a_supervised_task_cancelled_while_the_service_runs_fails_it(tmp_path):
    """Only ``stop_supervised`` cancels a service's background work; a task that ends cancelled otherwise
    (a CancelledError raised inside it, say by a closed grpc.aio channel) stopped doing its job, and the
    service says so instead of going on without it."""
    service = await started(trajectory_service(tmp_path))

    async def cancelled_inside():
        raise asyncio.CancelledError()

    task = service.supervise(cancelled_inside(), "the watch that got cancelled")
    await asyncio.gather(task, return_exceptions=True)
    await failed_with(service, "the watch that got cancelled died: CancelledError")
    await service.stop()


async def test_a_probe_cut_by_its_replica_leaving_answers_none_not_cancelled():
    """A replica dropped by discovery while the monitor probes it: closing its channel cancels the call
    (grpc.aio raises CancelledError in the caller); the probe answers "not serving" and the monitor goes on."""
    from grpc_health.v1 import health_pb2_grpc

    from rlfleet.client.channel import ChannelSettings
    from rlfleet.services.collector.discovery import Endpoint
    from rlfleet.services.collector.replicas import ReplicaPool

    answering = asyncio.Event()

    class SlowHealth(health_pb2_grpc.HealthServicer):
        async def Check(self, request, context):
            answering.set()
            await asyncio.sleep(60)

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(SlowHealth(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = ReplicaPool(ChannelSettings())
    try:
        (replica,), _ = await pool.update([Endpoint(f"127.0.0.1:{port}")])
        probing = asyncio.ensure_future(pool.probe(replica, timeout=30))
        await asyncio.wait_for(answering.wait(), WAIT)
        await pool.update([])  # discovery drops it: its channel closes under the probe
        assert await asyncio.wait_for(probing, WAIT) is None
        assert replica.gone
    finally:
        await pool.close()
        await server.stop(0)
