"""Server lifecycle shared by every service.

build domain object -> grpc.aio server (interceptor, explicit message sizes,
keepalive) -> diagnostics, health (NOT_SERVING), reflection -> listen ->
``await service.start()`` (model load) -> SERVING -> wait for SIGTERM/SIGINT ->
NOT_SERVING -> ``server.stop(grace)`` -> ``service.stop()``.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import gc
import importlib
import logging
import signal
import sys
from typing import AsyncIterator, ClassVar, Generic, NoReturn, TypeVar

import grpc
import pydantic
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as _AsyncHealthServicer
from grpc_reflection.v1alpha import reflection

from rlfleet.services.common import metrics
from rlfleet.services.common.config import ServiceConfig
from rlfleet.services.common.errors import FailedPrecondition, StartupError
from rlfleet.services.common.files import write_atomically
from rlfleet.services.common.logs import setup_logging
from rlfleet.v1 import diagnostics_pb2, diagnostics_pb2_grpc

log = logging.getLogger("rlfleet.server")
C = TypeVar("C", bound=ServiceConfig)
T = TypeVar("T")


def grpc_options(config: ServiceConfig) -> list[tuple[str, int]]:
    """Channel/server options: explicit message sizes and keepalive."""
    keepalive_ms = int(config.keepalive_seconds * 1000)
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]


class HealthServicer(_AsyncHealthServicer):
    """grpcio's asyncio health servicer plus ``List`` (which it lacks: the base raised INTERNAL)."""

    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status) for name, status in self._server_status.items()})


class Service(abc.ABC, Generic[C]):
    """A domain object plus the servicers exposing it. One subclass per service."""

    #: Fully-qualified gRPC service names this service serves (for health/reflection).
    service_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: C):
        self.config = config
        self.health: HealthServicer | None = None
        self.failure = ""
        """Why the service stopped working ("" while it works): a supervised task died. Health is
        NOT_SERVING from then on and ``check_working`` refuses every call with this reason."""
        self._supervised: set[asyncio.Task] = set()
        self._stopping = False
        self._not_serving: asyncio.Task | None = None
        """The task ``fail`` starts to turn health NOT_SERVING, held here: the loop keeps only a weak
        reference to a task, and one collected before it ran would leave health SERVING."""
        self.failed = asyncio.Event()
        """Set when the service fails (long calls wait on it too, to end with the reason)."""

    def torch_threads(self) -> int:
        """Torch intra-op threads for this process (0: torch's default, one per core). Services
        whose tensors are a few hundred elements want 1: on a busy machine an op that fans out over
        the cores waits for a core to come free (a 256-element repeat_interleave took 14 ms with 2
        threads on 2 loaded cores, 0.08 ms with 1); their parallelism is across requests."""
        return 0

    @abc.abstractmethod
    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register this service's servicers on ``server``."""

    async def start(self) -> None:
        """Load models / open stores. Health is NOT_SERVING until this returns."""

    async def stop(self) -> None:
        """Release resources after the server stopped accepting RPCs."""

    def supervise(self, coroutine, name: str) -> asyncio.Task:
        """Run ``coroutine`` as a background task of this service: if it raises, the service fails
        (``fail``); ``stop_supervised`` cancels them all."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._supervised.add(task)
        task.add_done_callback(self._supervised_done)
        return task

    def _supervised_done(self, task: asyncio.Task) -> None:
        self._supervised.discard(task)
        if task.cancelled():
            if not self._stopping:  # only ``stop_supervised`` cancels them: anything else ended its work
                self.fail(task.get_name(), asyncio.CancelledError("cancelled while the service was running"))
        elif task.exception() is not None:
            self.fail(task.get_name(), task.exception())

    def fail(self, what: str, exc: BaseException) -> None:
        """``what`` (a background task, a callback) raised ``exc``, which nothing expected: the service
        can no longer do its job. Logs the traceback, turns health NOT_SERVING, and every later call
        checked by ``check_working`` answers FAILED_PRECONDITION with the reason."""
        log.error("%s died: the service stops serving until it is restarted", what, exc_info=exc)
        if self.failure:
            return  # the first failure is the reason; health is turning NOT_SERVING already
        self.failure = f"{what} died: {type(exc).__name__}: {exc} (see the service's log; restart it)"
        self.failed.set()
        self._not_serving = asyncio.get_running_loop().create_task(self.set_serving(False), name="not-serving")

    def check_working(self) -> None:
        """FAILED_PRECONDITION naming the reason once the service failed (see ``fail``)."""
        if self.failure:
            raise FailedPrecondition(f"{type(self).__name__} does not work: {self.failure}")

    async def while_working(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        """``stream``'s messages until the service fails, then FAILED_PRECONDITION with the reason: a
        long call (a reader's batch stream) must not wait on a service that stopped working.
        Refused at once if it failed already (``check_working``)."""
        self.check_working()
        messages = aiter(stream)
        failing = asyncio.ensure_future(self.failed.wait())
        step: asyncio.Future | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(messages))
                await asyncio.wait({step, failing}, return_when=asyncio.FIRST_COMPLETED)
                self.check_working()
                try:
                    message = step.result()
                except StopAsyncIteration:
                    return
                yield message
        finally:
            failing.cancel()
            if step is not None:
                step.cancel()  # (when still waiting) the stream's own cleanup runs before this call ends,
                await asyncio.gather(step, return_exceptions=True)  # and an error left unread is read
            if hasattr(messages, "aclose"):
                await messages.aclose()

    async def stop_supervised(self) -> None:
        """Cancel the supervised tasks and wait for them (a failure was reported when it happened)."""
        self._stopping = True
        tasks = list(self._supervised)
        for task in tasks:
            task.cancel()
        # Outcomes other than the cancellation were reported by ``_supervised_done`` as they came.
        await asyncio.gather(*tasks, return_exceptions=True)

    async def set_serving(self, serving: bool) -> None:
        """Flip health for every served name (e.g. NOT_SERVING during a weight swap)."""
        if self.health is None:
            return
        for name in ("", *self.service_names):
            # Asked per name: a failure while this awaits turns the names not set yet NOT_SERVING too
            # (and ``fail``'s own pass, queued behind this one, sets them all).
            serving = serving and not self.failure
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            await self.health.set(name, status)
        metrics.READY.set(1 if serving and not self.failure else 0)


async def serve(service: Service, stop_event: asyncio.Event | None = None) -> None:
    """Run ``service`` until SIGTERM/SIGINT (or ``stop_event``), then shut down gracefully."""
    config = service.config
    stop_event = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_event.set)

    # Imported here, not at the top: they load the codec (torch, tensordict: seconds), and a bad
    # config is refused before that (``run``).
    from rlfleet.services.common import security, tracing
    from rlfleet.services.common.diagnostics import DiagnosticsServicer
    from rlfleet.services.common.interceptors import ErrorInterceptor

    policy = security.access_policy(config)  # files read now: a bad one refuses the start
    tracing.setup(type(config).service_name, config.otlp_endpoint, config.trace_sample_ratio, config.otlp_insecure)
    credentials = security.server_credentials(config)

    if service.torch_threads():
        import torch

        torch.set_num_threads(service.torch_threads())
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(policy)], options=grpc_options(config),
        maximum_concurrent_rpcs=None,
    )
    _add_servicers(service, server, DiagnosticsServicer())
    await service.set_serving(False)

    address = f"{config.host}:{config.port}"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise StartupError(f"host/port: could not bind {address}")
    security.warn_if_exposed(config.host, credentials is not None, policy)
    health_server = await _health_server(service) if config.health_port else None
    await server.start()
    if config.port_file:
        # Atomic: a reader never sees a partial file. 0644 (not the 0600 default): a port is no secret.
        write_atomically(config.port_file, str(port), mode=0o644)
    metrics.serve_metrics(config.metrics_port, config.metrics_host)
    log.info("listening", extra={"port": port, "tls": credentials is not None, "mtls": bool(config.tls_client_ca_file),
                                 "auth": policy.enabled, "health_port": config.health_port or None,
                                 "service_names": list(service.service_names)})

    try:
        await _serve_until(service, stop_event)
    finally:
        await server.stop(config.grace_seconds)
        if health_server is not None:
            await health_server.stop(0)
        await service.stop()
        tracing.shutdown()  # after the service's last spans (a collector's final appends)
        log.info("stopped")


def _add_servicers(service: Service, server: grpc.aio.Server, diagnostics) -> None:
    """The service's own servicers, health (``service.health``), diagnostics and reflection of them all."""
    service.health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(service.health, server)
    diagnostics_pb2_grpc.add_DiagnosticsServiceServicer_to_server(diagnostics, server)
    service.add_to_server(server)
    names = (*service.service_names, diagnostics_pb2.DESCRIPTOR.services_by_name["DiagnosticsService"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)


async def _health_server(service: Service) -> grpc.aio.Server:
    """Health only, plaintext, on ``health_port``: for probes that cannot do TLS (Kubernetes' gRPC probes).
    It says whether the service serves, nothing else; the same servicer answers on both ports."""
    config = service.config
    health_server = grpc.aio.server(options=grpc_options(config))
    health_pb2_grpc.add_HealthServicer_to_server(service.health, health_server)
    if health_server.add_insecure_port(f"{config.host}:{config.health_port}") == 0:
        raise StartupError(f"health_port: could not bind {config.host}:{config.health_port}")
    await health_server.start()
    return health_server


async def _serve_until(service: Service, stop_event: asyncio.Event) -> None:
    """Start the service (SERVING once started; a failed start is raised) and serve until ``stop_event``,
    then NOT_SERVING for the shutdown."""
    starting = asyncio.create_task(service.start())
    stopping = asyncio.create_task(stop_event.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        starting.result()  # a failed start is fatal: raise it
        await service.set_serving(True)
        log.info("serving")
        await stopping
    else:
        starting.cancel()
    log.info("shutting down", extra={"grace_seconds": service.config.grace_seconds})
    await service.set_serving(False)


def run(service: str, config_cls: type[ServiceConfig], argv=None) -> None:
    """Console entry point body: parse config, set up logging, serve. ``service`` names the service
    class as ``"module:Class"``: it is imported once the config is valid, so that a bad setting is
    refused at once (exit 2, naming it), not after the service's heavy imports (torch, vLLM)."""
    try:
        config = config_cls.load(argv)
    except pydantic.ValidationError as exc:
        _refuse(config_cls.service_name, str(exc))
    setup_logging(config_cls.service_name, config.log_level, config.log_format)
    module, _, name = service.partition(":")
    service_cls = getattr(importlib.import_module(module), name)

    async def main() -> None:
        # Built inside the loop: grpc.aio channels bind to the loop that creates them.
        await serve(service_cls(config))

    atexit.register(exit_without_collecting)
    try:
        asyncio.run(main())
    except StartupError as exc:
        _refuse(config_cls.service_name, str(exc))


def exit_without_collecting() -> None:
    """Registered by ``run`` as an ``atexit`` handler: the interpreter's last garbage collection then skips
    every object alive at exit (``gc.freeze``). A service with torch, transformers or vLLM loaded holds
    hundreds of thousands of objects; that collection took a generation service ~2 s after it had
    stopped serving, and every replica stop in the tests paid it. What it would have done is to run
    the finalizers of garbage cycles, which Python does not promise at exit anyway: a service releases
    what must not outlive it (shared memory, files, child processes) in its ``stop()``, before this runs."""
    gc.freeze()


def _refuse(service_name: str, why: str) -> NoReturn:
    """A configuration the service cannot work with: say which setting, exit 2 (no traceback)."""
    print(f"rlfleet-{service_name}: refusing to start: {why}", file=sys.stderr)
    raise SystemExit(2)
