"""``rlfleet-trajectory`` / ``python -m rlfleet.services.trajectory``."""


def main(argv=None) -> None:
    from rlfleet.services.common.server import run
    from rlfleet.services.trajectory.config import TrajectoryConfig

    run("rlfleet.services.trajectory.service:TrajectoryService", TrajectoryConfig, argv)


if __name__ == "__main__":
    main()
