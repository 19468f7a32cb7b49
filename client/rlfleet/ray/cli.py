"""``rlfleet-ray``: a fleet on a running Ray cluster, from a config file.

    rlfleet-ray up fleet.yaml [--fresh] [--ray-address HEAD:6379]   # start it; prints every service's address
    rlfleet-ray status [--name rlfleet]                      # every instance: address, node, starts
    rlfleet-ray address [collector] [--name rlfleet]         # one instance's host:port
    rlfleet-ray scale generation 4 [--name rlfleet]          # replicas join (re-synced) or leave
    rlfleet-ray runs add exp-b [--share-weight 2] [--fresh]  # a fleet that runs share: one more run
    rlfleet-ray runs add exp-c --replicas 2                  # one that trains full weights, on replicas of its own
    rlfleet-ray runs end exp-a                               # its collector and store stop, its slots freed
    rlfleet-ray down [--name rlfleet]                        # stop it

The fleet's actors are detached: ``up`` returns once every service serves, and the fleet runs on until
``down``. ``status``, ``address``, ``scale`` and ``down`` find it by name in the cluster. A plain ``up``
resumes the durable state of the collector, the trajectory store and the reward service (the run goes
on at its committed version); ``up --fresh`` deletes it first and starts a new run.
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet-ray", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description=__doc__.strip().replace("``", "`"))
    ray_address_help = "the Ray cluster (ray.init's address; default: auto, or RAY_ADDRESS)"
    parser.add_argument("--ray-address", default=None, help=ray_address_help)
    # Also after the command (`up fleet.yaml --ray-address ...`); SUPPRESS keeps one given before it.
    cluster = argparse.ArgumentParser(add_help=False)
    cluster.add_argument("--ray-address", default=argparse.SUPPRESS, help=ray_address_help)
    named = argparse.ArgumentParser(add_help=False, parents=[cluster])
    named.add_argument("--name", default="rlfleet", help="the fleet's name (its config's `name`)")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", parents=[cluster], help="start the fleet a config file describes (docs/guides/ray.md)")
    up.add_argument("config", help="the fleet's YAML config file")
    up.add_argument("--fresh", action="store_true",
                    help="start a new run: the collector, the trajectory store and the reward service delete "
                         "their durable state at their first start (default: resume it)")
    commands.add_parser("status", parents=[named], help="every instance's address, node and start count (JSON)")
    address = commands.add_parser("address", parents=[named], help="one instance's host:port (a trainer's --collector)")
    address.add_argument("key", nargs="?", default="collector", help="collector, trajectory, generation-0, ...")
    scale = commands.add_parser("scale", parents=[named], help="run N instances of a service (generation)")
    scale.add_argument("service", choices=["generation"])
    scale.add_argument("replicas", type=int)
    runs_parser = commands.add_parser("runs", help="the runs of a fleet that runs share (its config's `runs`)")
    run_commands = runs_parser.add_subparsers(dest="run_command", required=True)
    add = run_commands.add_parser("add", parents=[named], help="start a run's trajectory store and collector")
    add.add_argument("run", help="the run's name (its credentials name it: credentials --run NAME)")
    add.add_argument("--share-weight", type=float, default=1.0, help="its weight in each replica's fair share")
    add.add_argument("--port", type=int, default=0, help="its collector's fixed port (default: a free one)")
    add.add_argument("--replicas", type=int, default=0,
                     help="generation replicas of its own, for a run that trains full weights (default 0: it shares "
                          "the fleet's replicas, its policy a LoRA adapter)")
    add.add_argument("--settings", type=json.loads, default={},
                     help='its collector\'s own settings over the template\'s, as JSON: \'{"players": {"opponent": "exp-a"}}\'')
    add.add_argument("--fresh", action="store_true", help="a new run: delete the state a run of this name left")
    end = run_commands.add_parser("end", parents=[named], help="stop a run's collector and store, free its slots")
    end.add_argument("run")
    run_commands.add_parser("list", parents=[named], help="the fleet's runs, a line each: name, collector address")
    commands.add_parser("down", parents=[named], help="stop every instance of the fleet")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="[rlfleet-ray] %(message)s", stream=sys.stderr)
    from rlfleet.ray import FleetError

    try:
        return _run(ns)
    except (FleetError, LookupError, ValueError, OSError) as err:
        # What a user can act on (a service's refusal, a missing file, a bad config): its message, once.
        print(f"rlfleet-ray {ns.command}: error: {err}", file=sys.stderr)
        return 1


def _run(ns: argparse.Namespace) -> int:
    from rlfleet.ray import Fleet, load_config

    if ns.command == "up":
        config = load_config(ns.config)
        if ns.ray_address:
            config.ray_address = ns.ray_address
        fleet = Fleet.up(config, fresh=ns.fresh)
        for key, record in fleet.status().items():
            print(f"{key}\t{record['address']}\t{record['node_id'][:12]}")
        _say_run(fleet)
        return 0
    fleet = Fleet.attach(ns.name, ns.ray_address)
    if ns.command == "status":
        print(json.dumps(fleet.status(), indent=1))
    elif ns.command == "address":
        print(fleet.address(ns.key))
    elif ns.command == "scale":
        print("\n".join(fleet.scale(ns.service, ns.replicas)))
    elif ns.command == "runs":
        _runs(fleet, ns)
    else:
        fleet.down()
    return 0


def _runs(fleet, ns: argparse.Namespace) -> None:
    from rlfleet.ray import RunSpec
    from rlfleet.ray.config import run_key

    if ns.run_command == "add":
        fleet.add_run(ns.run, RunSpec(share_weight=ns.share_weight, port=ns.port, settings=ns.settings,
                                      replicas=ns.replicas), fresh=ns.fresh)
        print(f"{ns.run}\t{fleet.address(run_key('collector', ns.run))}")
        _say_run(fleet, [run_key("collector", ns.run)])
    elif ns.run_command == "end":
        fleet.end_run(ns.run)
    else:
        for run in fleet.runs():
            try:
                address = fleet.address(run_key("collector", run))
            except LookupError:
                address = "-"
            print(f"{run}\t{address}")


def _say_run(fleet, keys: list[str] | None = None) -> None:
    """Each collector's run after ``up`` (new, or resumed at which version), as its status reports it."""
    import logging

    for key in keys or fleet.collector_keys():
        run = fleet.collector_run(key)
        if run is not None:
            logging.getLogger("rlfleet.ray").info("%s: %s", key, run.describe())


if __name__ == "__main__":
    sys.exit(main())
