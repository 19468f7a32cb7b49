"""The trainer inside the cluster: a training function run as a Ray task, pointed at the fleet's collector.

    ref = run_trainer("rlfleet", train_grpo.main, ["--model-dir", "/models/policy", "--steps", "100"],
                      num_cpus=4, num_gpus=1)
    result = ray.get(ref)

The collector's address is read from the registry when the task starts (wherever the collector runs
then), and passed as ``--collector ADDRESS`` ahead of ``argv``: any trainer whose ``main(argv)`` takes
that flag (``examples/train_grpo.py``) runs unchanged. Outside the cluster a trainer needs nothing of
Ray: ``connect(fleet.address("collector"))``.
"""

from __future__ import annotations

from typing import Any, Callable


def collector_address(fleet: str = "rlfleet", run: str | None = None) -> str:
    """The collector's ``host:port`` now (``run``'s, in a fleet that runs share), from inside the cluster
    (a task, an actor, a driver)."""
    from rlfleet.ray.config import run_key
    from rlfleet.ray.fleet import connect
    from rlfleet.registry import Registry

    key = run_key("collector", run) if run else "collector"
    address = Registry(connect(), fleet).address(key)
    if address is None:
        raise LookupError(f"fleet {fleet!r} has no {key} serving now")
    return address


def _trainer_task(fleet: str, run: str | None, main: Callable[[list[str]], Any], argv: list[str]) -> Any:
    return main(["--collector", collector_address(fleet, run), *argv])


def run_trainer(fleet: str, main: Callable[[list[str]], Any], argv: list[str], run: str | None = None,
                **ray_options):
    """``main(["--collector", ADDRESS, *argv])`` as a Ray task with ``ray_options`` (num_cpus, num_gpus,
    resources, runtime_env...); its ObjectRef. ``run``: that run's collector, in a fleet that runs share."""
    import ray

    return ray.remote(_trainer_task).options(**ray_options).remote(fleet, run, main, argv)
