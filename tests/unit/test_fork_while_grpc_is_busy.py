"""A test process forks children safely while its threads are inside gRPC (``GRPC_ENABLE_FORK_SUPPORT=0``,
set by tests/conftest.py before grpc is imported). With grpcio's fork support on, its atfork handlers run
in a child forked with a ``preexec_fn`` (Ray starts its GCS server and raylets so) and some such children
die before they exec: 4 of 300 here with the setting removed."""

from __future__ import annotations

import signal
import subprocess
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

CHILDREN = 300


def block_sigint() -> None:  # a preexec_fn like Ray's: Python runs in the child between fork and exec
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def test_children_forked_with_a_preexec_fn_while_grpc_calls_run_all_reach_exec():
    server = grpc.server(futures.ThreadPoolExecutor(8))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    calls = [0] * 4

    def call_in_a_loop(i: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                stub.Check(health_pb2.HealthCheckRequest())
                calls[i] += 1

    threads = [threading.Thread(target=call_in_a_loop, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    try:
        while not all(calls):  # every thread is making calls before the first fork
            stop.wait(0.01)
        died = sum(subprocess.Popen(["/bin/true"], preexec_fn=block_sigint).wait() != 0 for _ in range(CHILDREN))
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        server.stop(0)
    assert died == 0, f"{died} of {CHILDREN} children died before exec"
