"""rlfleet on a Ray cluster: every service a Ray actor hosting the real service process.

    pip install "rlfleet[ray,services]"     # the nodes need the services (and vLLM on GPU nodes)
    rlfleet-ray up fleet.yaml               # or Fleet.up(load_config("fleet.yaml")) from Python

See docs/guides/ray.md. Importing this package imports nothing of Ray; its functions do.
"""

from rlfleet.ray.config import FleetConfig, RunSpec, ServiceSpec, load_config
from rlfleet.ray.fleet import Fleet, FleetError
from rlfleet.ray.trainer import collector_address, run_trainer

__all__ = ["Fleet", "FleetConfig", "FleetError", "RunSpec", "ServiceSpec", "collector_address", "load_config", "run_trainer"]
