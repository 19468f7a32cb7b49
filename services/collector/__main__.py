"""``rlfleet-collector`` / ``python -m rlfleet.services.collector``."""


def main(argv=None) -> None:
    from rlfleet.services.collector.config import CollectorConfig
    from rlfleet.services.common.server import run

    run("rlfleet.services.collector.service:CollectorService", CollectorConfig, argv)


if __name__ == "__main__":
    main()
