"""Codec and gRPC throughput, as ratios against a plain memory copy.

    .venv/bin/python bench/codec.py [--sizes-mib 1 4 16 64 256] [--repeats 5]

For each payload size: the best-of-N time of a plain memory copy
(``torch.Tensor.clone``), of encode (tensor -> serialized message), of decode
(serialized message -> tensor), and of a gRPC round trip through a real echo
service process on loopback (payload sent and returned: 2x the bytes). The
table reports GB/s and each ratio to the memory copy measured in the same run,
so a noisy machine shifts both sides alike.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import grpc
import torch

from rlfleet.services.launch import ServiceProcess
from rlfleet.v1 import diagnostics_pb2, diagnostics_pb2_grpc, tensor_pb2
from rlfleet.wire import decode_tensordict, encode_tensordict


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args()

    limit = 2 * max(ns.sizes_mib) * 2**20 + 2**20
    echo = ServiceProcess("echo", ["--max-message-bytes", str(limit), "--log-level", "WARNING"],
                          module="tests.echo_service")  # tests/echo_service: run from the repository root
    echo.start(Path(tempfile.mkdtemp(prefix="rlfleet-bench-"))).wait_ready(120)
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    channel = grpc.insecure_channel(echo.address, options=options)
    stub = diagnostics_pb2_grpc.DiagnosticsServiceStub(channel)
    rows = []
    try:
        for mib in ns.sizes_mib:
            nbytes = mib * 2**20
            tensor = torch.randn(nbytes // 4)
            payload = {"x": tensor.reshape(1, -1)}
            copy_s = best_of(lambda: tensor.clone(), ns.repeats)
            encode_s = best_of(lambda: encode_tensordict(payload, batch_size=[1]).SerializeToString(), ns.repeats)
            raw = encode_tensordict(payload, batch_size=[1]).SerializeToString()
            decode_s = best_of(lambda: decode_tensordict(tensor_pb2.TensorDict.FromString(raw)), ns.repeats)
            request = diagnostics_pb2.EchoRequest(payload=encode_tensordict(payload, batch_size=[1]))
            reply = stub.Echo(request, timeout=120)
            assert torch.equal(decode_tensordict(reply.payload)["x"], payload["x"])
            rtt_s = best_of(lambda: stub.Echo(request, timeout=120), max(2, ns.repeats // 2))
            rows.append((mib, nbytes, copy_s, encode_s, decode_s, rtt_s))
    finally:
        channel.close()
        echo.stop()

    gbps = lambda n, s: n / s / 1e9  # noqa: E731
    print(f"{'size':>8} | {'memcpy GB/s':>11} | {'encode GB/s':>11} {'ratio':>6} | {'decode GB/s':>11} {'ratio':>6} "
          f"| {'gRPC rtt GB/s':>13} {'ratio':>6}")
    print("-" * 96)
    for mib, nbytes, copy_s, encode_s, decode_s, rtt_s in rows:
        print(f"{mib:>5} MiB | {gbps(nbytes, copy_s):>11.2f} | {gbps(nbytes, encode_s):>11.2f} {copy_s / encode_s:>6.2f} "
              f"| {gbps(nbytes, decode_s):>11.2f} {copy_s / decode_s:>6.2f} "
              f"| {gbps(2 * nbytes, rtt_s):>13.2f} {copy_s * 2 / rtt_s:>6.2f}")
    print("ratio = memcpy time / operation time for the same bytes (1.0 = as fast as a memory copy);"
          " gRPC rtt moves the payload both ways through a real echo service on loopback.")


if __name__ == "__main__":
    main()
