"""``rlfleet-echo`` / ``python -m rlfleet.services.echo``."""


def main(argv=None) -> None:
    from rlfleet.services.common.server import run
    from rlfleet.services.echo.config import EchoConfig

    run("rlfleet.services.echo.service:EchoService", EchoConfig, argv)


if __name__ == "__main__":
    main()
