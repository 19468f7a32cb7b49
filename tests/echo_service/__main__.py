"""``python -m tests.echo_service``, from the repository root."""


def main(argv=None) -> None:
    from rlfleet.services.common.server import run
    from tests.echo_service.config import EchoConfig

    run("tests.echo_service.service:EchoService", EchoConfig, argv)


if __name__ == "__main__":
    main()
