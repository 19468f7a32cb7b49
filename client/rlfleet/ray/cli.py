"""``rlfleet-ray``: a fleet on a running Ray cluster, from a config file.

    rlfleet-ray up fleet.yaml [--ray-address HEAD:6379]     # start it; prints every service's address
    rlfleet-ray status [--name rlfleet]                      # every instance: address, node, starts
    rlfleet-ray scale generation 4 [--name rlfleet]          # replicas join (re-synced) or leave
    rlfleet-ray down [--name rlfleet]                        # stop it

The fleet's actors are detached: ``up`` returns once every service serves, and the fleet runs on until
``down``. ``status``, ``scale`` and ``down`` find it by name in the cluster.
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet-ray", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description=__doc__.strip().replace("``", "`"))
    parser.add_argument("--ray-address", default=None,
                        help="the Ray cluster (ray.init's address; default: auto, or RAY_ADDRESS)")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start the fleet a config file describes (docs/guides/ray.md)")
    up.add_argument("config", help="the fleet's YAML config file")
    for name, text in (("status", "every instance's address, node and start count (JSON)"),
                       ("down", "stop every instance of the fleet")):
        command = commands.add_parser(name, help=text)
        command.add_argument("--name", default="rlfleet", help="the fleet's name (its config's `name`)")
    scale = commands.add_parser("scale", help="run N instances of a service (generation)")
    scale.add_argument("service", choices=["generation"])
    scale.add_argument("replicas", type=int)
    scale.add_argument("--name", default="rlfleet", help="the fleet's name (its config's `name`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="[rlfleet-ray] %(message)s", stream=sys.stderr)
    from rlfleet.ray import Fleet, load_config

    if ns.command == "up":
        config = load_config(ns.config)
        if ns.ray_address:
            config.ray_address = ns.ray_address
        fleet = Fleet.up(config)
        for key, record in fleet.status().items():
            print(f"{key}\t{record['address']}\t{record['node_id'][:12]}")
        return 0
    fleet = Fleet.attach(ns.name, ns.ray_address)
    if ns.command == "status":
        print(json.dumps(fleet.status(), indent=1))
    elif ns.command == "scale":
        print("\n".join(fleet.scale(ns.service, ns.replicas)))
    else:
        fleet.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
