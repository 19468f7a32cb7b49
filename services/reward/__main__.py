"""``rlfleet-reward`` / ``python -m rlfleet.services.reward``."""


def main(argv=None) -> None:
    from rlfleet.services.common.server import run
    from rlfleet.services.reward.config import RewardServiceConfig
    from rlfleet.services.reward.service import RewardService

    run(RewardService, RewardServiceConfig, argv)


if __name__ == "__main__":
    main()
