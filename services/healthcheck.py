"""Exit 0 iff a gRPC server reports SERVING on ``grpc.health.v1``.

    python -m rlfleet.services.healthcheck HOST:PORT [--service NAME] [--timeout SECONDS]
        [--tls-ca CA.pem [--tls-cert CERT.pem --tls-key KEY.pem] [--tls-server-name NAME]]

For container HEALTHCHECKs and probes: prints the status (or the error) on one
line, exits 1 when the server is NOT_SERVING, unreachable or too slow. Imports
only grpc, so a check costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys


def status(address: str, service: str = "", timeout: float = 3.0, credentials=None,
           server_name: str | None = None) -> int:
    """The health status enum of ``service`` ("" = the whole server) at ``address``; over TLS when
    given ``credentials`` (``grpc.ssl_channel_credentials``)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (grpc.secure_channel(address, credentials, options=options) if credentials is not None
               else grpc.insecure_channel(address))
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def check(address: str, service: str = "", timeout: float = 3.0, credentials=None,
          server_name: str | None = None) -> str:
    """The health status name of ``service`` ("" = the whole server) at ``address``."""
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckResponse.ServingStatus.Name(status(address, service, timeout, credentials,
                                                                    server_name))


def tls_credentials(ca: str | None, cert: str | None = None, key: str | None = None):
    """Channel credentials from PEM files (None without ``ca`` and ``cert``)."""
    if not ca and not cert:
        return None
    import grpc

    def read(path: str | None) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as file:
            return file.read()

    return grpc.ssl_channel_credentials(root_certificates=read(ca), certificate_chain=read(cert),
                                        private_key=read(key))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.services.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="HOST:PORT of the gRPC server")
    parser.add_argument("--service", default="", help='service name to check ("" = whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="deadline of the Check call, in seconds")
    parser.add_argument("--tls-ca", help="PEM CA the server's certificate is checked against (TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate, for a server that requires one (mTLS)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", help="the name the server's certificate holds, if not the address's host")
    ns = parser.parse_args(argv)
    if bool(ns.tls_cert) != bool(ns.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    import grpc

    try:
        credentials = tls_credentials(ns.tls_ca, ns.tls_cert, ns.tls_key)
    except OSError as error:
        print(f"{ns.address}: cannot read a TLS file: {error}")
        return 1
    try:
        status = check(ns.address, ns.service, ns.timeout, credentials, ns.tls_server_name)
    except grpc.RpcError as error:
        print(f"{ns.address}: {error.code().name}: {error.details()}")
        return 1
    print(f"{ns.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
