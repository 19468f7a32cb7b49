"""``rlfleet-viewer`` / ``python -m rlfleet.services.viewer``."""


def main(argv=None) -> None:
    from rlfleet.services.viewer.web import run

    run(argv)


if __name__ == "__main__":
    main()
