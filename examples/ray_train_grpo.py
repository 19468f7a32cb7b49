"""examples/train_grpo.py's GRPO loop as a Ray task inside the cluster, against a fleet that
``rlfleet.ray`` started (``rlfleet-ray up fleet.yaml``).

    python examples/ray_train_grpo.py --fleet rlfleet --model-dir /models/policy --steps 30 \\
        [--ray-address HEAD:6379] [--num-gpus 1] [--credentials ./credentials] [train_grpo.py flags]

The task reads the collector's address from the fleet's registry when it starts and runs
``train_grpo.main`` there; its metrics come back to this driver (``--out``/metrics.json here too).
The task imports ``train_grpo`` from this file's directory: on a multi-node cluster ship it with
``--working-dir examples`` (the job's runtime_env: Ray takes a ``working_dir`` at ``ray.init`` or job
submission only, never per task) or install it on the nodes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXAMPLES = str(Path(__file__).resolve().parent)
PATH_FLAGS = ("--model-dir", "--credentials")
"""train_grpo.py's flags naming paths: made absolute here, since the task runs elsewhere (in the shipped
copy of --working-dir, or in Ray's working directory)."""


def absolute_paths(argv: list[str]) -> list[str]:
    """``argv`` with the value of every flag in ``PATH_FLAGS`` absolute (``--flag value`` or ``--flag=value``)."""
    out = list(argv)
    for index, arg in enumerate(out):
        flag, equals, value = arg.partition("=")
        if flag in PATH_FLAGS and equals:
            out[index] = f"{flag}={Path(value).resolve()}"
        elif arg in PATH_FLAGS and index + 1 < len(out):
            out[index + 1] = str(Path(out[index + 1]).resolve())
    return out


def train(argv: list[str]) -> list[dict]:
    """On a Ray worker: train_grpo.main(argv); its metrics."""
    sys.path.insert(0, EXAMPLES)
    import train_grpo

    return train_grpo.main(argv)["metrics"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", default="rlfleet", help="the fleet's name (its config's `name`)")
    parser.add_argument("--ray-address", default=None, help="the cluster (default: auto)")
    parser.add_argument("--num-cpus", type=float, default=1)
    parser.add_argument("--num-gpus", type=float, default=0)
    parser.add_argument("--working-dir", default=None,
                        help="a directory holding train_grpo.py, shipped to the nodes (the job's runtime_env)")
    parser.add_argument("--out", type=Path, default=Path("runs") / "ray-demo")
    ns, rest = parser.parse_known_args(argv)

    import ray

    from rlfleet.ray import run_trainer

    runtime_env = {"working_dir": ns.working_dir} if ns.working_dir else None
    ray.init(address=ns.ray_address or "auto", logging_level="WARNING", runtime_env=runtime_env)
    options = {"num_cpus": ns.num_cpus, "num_gpus": ns.num_gpus}
    metrics = ray.get(run_trainer(ns.fleet, train, [*absolute_paths(rest), "--out", str(ns.out.resolve())],
                                  **options))
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"[ray-demo] {len(metrics)} steps; metrics in {ns.out / 'metrics.json'}", file=sys.stderr)
    return metrics


if __name__ == "__main__":
    main()
