"""``rlfleet-generation`` / ``python -m rlfleet.services.generation``."""


def main(argv=None) -> None:
    from rlfleet.services.common.server import run
    from rlfleet.services.generation.config import GenerationConfig

    run("rlfleet.services.generation.service:GenerationService", GenerationConfig, argv)


if __name__ == "__main__":
    main()
