"""``rlfleet-reward`` / ``python -m rlfleet.services.reward``."""


def main(argv=None) -> None:
    from rlfleet.services.common.server import run
    from rlfleet.services.reward.config import RewardServiceConfig

    run("rlfleet.services.reward.service:RewardService", RewardServiceConfig, argv)


if __name__ == "__main__":
    main()
