"""``rlfleet-environment`` / ``python -m rlfleet.services.environment``."""

import os


def main(argv=None) -> None:
    # The python tool forks a sandbox from inside RPC handlers; with gRPC's fork support on, the forked
    # child runs gRPC's atfork handlers while other threads are in gRPC and dies with SIGSEGV before it
    # can exec (seen with grpcio 1.85). Read once, when grpc is first imported: so here, before it is.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    from rlfleet.services.common.server import run
    from rlfleet.services.environment.config import EnvironmentServiceConfig

    run("rlfleet.services.environment.service:EnvironmentService", EnvironmentServiceConfig, argv)


if __name__ == "__main__":
    main()
