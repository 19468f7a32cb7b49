"""A real gRPC server between a service and its callers that forwards every call as bytes, for fault
tests that need a call's answer to arrive late, or never: ``hold`` keeps the next answer of a method
(the upstream has answered: its effect is durable) until the test releases it, at the worst instant
for the caller."""

from __future__ import annotations

import collections
import socket
import threading
from concurrent import futures

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from tests.waiting import wait_for


class Held:
    """One held answer: ``answered`` once the upstream answered (the caller still waits), then
    ``release`` sends it on."""

    def __init__(self):
        self.answered = threading.Event()
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def wait_released(self, timeout: float) -> None:
        self._released.wait(timeout)


class Interposer:
    def __init__(self, upstream: str, services: list[ServiceDescriptor], *, hold_seconds: float = 600.0):
        self._channel = grpc.insecure_channel(upstream)
        self._kinds = {f"/{service.full_name}/{method.name}": (method.client_streaming, method.server_streaming)
                       for service in services for method in service.methods}
        self._hold_seconds = hold_seconds
        self._lock = threading.Lock()
        self._holds: dict[str, collections.deque[Held]] = collections.defaultdict(collections.deque)
        self.answered: collections.Counter[str] = collections.Counter()
        """Calls the upstream answered, by method name (``Append``)."""
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        self._server.add_generic_rpc_handlers([_Handler(self)])
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self._server.start()

    def hold(self, method: str) -> Held:
        """Hold the next answer of ``method`` (its short name: ``Append``)."""
        held = Held()
        with self._lock:
            self._holds[method].append(held)
        return held

    def wait_answered(self, method: str, count: int, timeout: float) -> None:
        wait_for(lambda: self.answered[method] >= count, timeout, f"{count} answers of {method}")

    def close(self) -> None:
        with self._lock:
            for queue in self._holds.values():
                for held in queue:
                    held.release()
        self._server.stop(None)
        self._channel.close()

    def _answered(self, method: str) -> None:
        """Count the answer; hold it if a hold is waiting for this method."""
        short = method.rsplit("/", 1)[-1]
        with self._lock:
            self.answered[short] += 1
            held = self._holds[short].popleft() if self._holds[short] else None
        if held is not None:
            held.answered.set()
            held.wait_released(self._hold_seconds)

    def _unary(self, method: str, request: bytes, context: grpc.ServicerContext, streaming: bool):
        call = (self._channel.unary_stream if streaming else self._channel.unary_unary)(method)
        try:
            answer = call(request, metadata=_forwarded(context), timeout=_deadline(context))
            if streaming:
                yield from answer
                self._answered(method)
                return
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details())
        self._answered(method)
        yield answer

    def _stream(self, method: str, requests, context: grpc.ServicerContext, streaming: bool):
        call = (self._channel.stream_stream if streaming else self._channel.stream_unary)(method)
        try:
            answer = call(requests, metadata=_forwarded(context), timeout=_deadline(context))
            if streaming:
                context.add_callback(answer.cancel)
                yield from answer
                return
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details())
        self._answered(method)
        yield answer


def _deadline(context: grpc.ServicerContext) -> float | None:
    """The caller's time left (None without a deadline: gRPC then says some 3e11 years)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e9 else None


def _forwarded(context: grpc.ServicerContext) -> list[tuple[str, str | bytes]]:
    """The caller's metadata (its token), less what the channel sets itself."""
    return [(key, value) for key, value in context.invocation_metadata()
            if key != "user-agent" and not key.startswith((":", "grpc-"))]


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, interposer: Interposer):
        self._interposer = interposer

    def service(self, details: grpc.HandlerCallDetails):
        kind = self._interposer._kinds.get(details.method)
        if kind is None:
            return None
        client_streaming, server_streaming = kind
        method, interposer = details.method, self._interposer
        if not client_streaming:
            if server_streaming:
                return grpc.unary_stream_rpc_method_handler(
                    lambda request, context: interposer._unary(method, request, context, True))
            return grpc.unary_unary_rpc_method_handler(
                lambda request, context: next(interposer._unary(method, request, context, False)))
        if server_streaming:
            return grpc.stream_stream_rpc_method_handler(
                lambda requests, context: interposer._stream(method, requests, context, True))
        return grpc.stream_unary_rpc_method_handler(
            lambda requests, context: next(interposer._stream(method, requests, context, False)))


class StallingLink:
    """A TCP proxy from ``127.0.0.1:port`` to ``upstream`` that holds the first connection to carry more than
    ``stall_after`` bytes toward the upstream once it did (``stalled`` is set), until ``release``: a call in
    the middle of its bytes, held there for a fault test (a peer killed mid-share). Every other connection,
    before and after, passes as it is. A context manager; threads, for sync tests."""

    def __init__(self, port: int, upstream: str, stall_after: int):
        self.upstream, self.stall_after = upstream, stall_after
        self.stalled, self._released = threading.Event(), threading.Event()
        self._armed = True
        self._lock = threading.Lock()
        self._sockets: list = []
        self._listener = socket.create_server(("127.0.0.1", port))
        self.address = f"127.0.0.1:{port}"
        threading.Thread(target=self._accept, daemon=True, name="stalling-link").start()

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self.release()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def __enter__(self) -> "StallingLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            host, port = self.upstream.rsplit(":", 1)
            try:
                server = socket.create_connection((host, int(port)))
            except OSError:
                client.close()  # the upstream is not listening (yet): the caller sees a refused connection
                continue
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source, target, toward_upstream: bool) -> None:
        carried = 0
        try:
            while data := source.recv(1 << 16):
                target.sendall(data)
                carried += len(data)
                if toward_upstream and carried > self.stall_after:
                    with self._lock:
                        stall, self._armed = self._armed, False
                    if stall:
                        self.stalled.set()
                        self._released.wait()
            target.shutdown(socket.SHUT_WR)
        except OSError:
            for sock in (source, target):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
