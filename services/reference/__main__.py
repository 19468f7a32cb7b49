"""``rlfleet-reference`` / ``python -m rlfleet.services.reference``."""


def main(argv=None) -> None:
    from rlfleet.services.common.server import run
    from rlfleet.services.reference.config import ReferenceServiceConfig

    run("rlfleet.services.reference.service:ReferenceService", ReferenceServiceConfig, argv)


if __name__ == "__main__":
    main()
