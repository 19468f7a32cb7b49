"""Exit 0 iff a gRPC server reports SERVING on ``grpc.health.v1``.

    python -m rlfleet.services.healthcheck HOST:PORT [--service NAME] [--timeout SECONDS]

For container HEALTHCHECKs and probes: prints the status (or the error) on one
line, exits 1 when the server is NOT_SERVING, unreachable or too slow. Imports
only grpc, so a check costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys


def status(address: str, service: str = "", timeout: float = 3.0) -> int:
    """The health status enum of ``service`` ("" = the whole server) at ``address``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def check(address: str, service: str = "", timeout: float = 3.0) -> str:
    """The health status name of ``service`` ("" = the whole server) at ``address``."""
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckResponse.ServingStatus.Name(status(address, service, timeout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.services.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="HOST:PORT of the gRPC server")
    parser.add_argument("--service", default="", help='service name to check ("" = whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="deadline of the Check call, in seconds")
    ns = parser.parse_args(argv)
    import grpc

    try:
        status = check(ns.address, ns.service, ns.timeout)
    except grpc.RpcError as error:
        print(f"{ns.address}: {error.code().name}: {error.details()}")
        return 1
    print(f"{ns.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
