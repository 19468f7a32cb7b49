"""The KL controllers of the runs a reward service scores for: its own (``run_id`` empty), and one per run
that shares the service (``ComputeRewardsRequest.run_id``), so that one run's batches never move another's
coefficient.

A run's controller starts at the configured initial state at the run's first batch, or from its file if
the service kept one (``kl_state_path`` with the run id before the suffix: ``kl_state.json`` gives
``kl_state.<run id>.json``), and is written there after each update, as the service's own is. At most
``max_runs`` runs have one (RESOURCE_EXHAUSTED beyond). ``fresh`` deletes every run's file with the
service's own. Thread-safe: the service computes in worker threads.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from rlfleet.services.common.errors import NotFound, ResourceExhausted
from rlfleet.services.common.run_ids import check_run_id
from rlfleet.services.reward.config import RewardServiceConfig
from rlfleet.services.reward.controllers import (
    AdaptiveKLController,
    ConstantKLController,
    KLController,
)

log = logging.getLogger("rlfleet.reward")


def make_controller(config: RewardServiceConfig) -> KLController:
    if config.kl_controller == "adaptive":
        return AdaptiveKLController(config.init_kl_coef, target=config.kl_target, horizon=config.kl_horizon)
    return ConstantKLController(config.init_kl_coef)


class KLControllers:
    """The service's own controller and each sharing run's (see the module)."""

    def __init__(self, config: RewardServiceConfig) -> None:
        self.config = config
        self.own = make_controller(config)
        self._runs: dict[str, KLController] = {}
        self._lock = threading.Lock()

    def state_path(self, run_id: str = "") -> str | None:
        """Where ``run_id``'s controller is kept (None: in memory only)."""
        if not self.config.kl_state_path:
            return None
        path = Path(self.config.kl_state_path)
        return str(path if not run_id else path.with_name(f"{path.stem}.{run_id}{path.suffix}"))

    def load(self) -> None:
        """At start: ``fresh`` deletes every kept state; the service's own is restored (the runs' at first use)."""
        path = self.state_path()
        if path is None:
            return
        if self.config.fresh:  # a new run: its coefficient starts at the initial one
            own = Path(path)
            for kept in [own, *own.parent.glob(f"{own.stem}.*{own.suffix}")]:
                kept.unlink(missing_ok=True)
            log.warning("fresh: the KL controllers' state deleted, a new run starts", extra={"path": path})
        if self.own.load(path):
            log.info("KL controller state restored", extra={
                "path": path, "coef": self.own.coef, "updates": self.own.updates})

    def get(self, run_id: str, create: bool = True) -> KLController:
        """``run_id``'s controller (the service's own for ""); one not seen since the start is restored from
        its file, or made (``create``; else NotFound). InvalidArgument for a run id of another shape."""
        if not run_id:
            return self.own
        with self._lock:
            controller = self._runs.get(run_id)
            if controller is not None:
                return controller
            check_run_id(run_id)
            path = self.state_path(run_id)
            kept = path is not None and Path(path).exists()
            if not (create or kept):
                raise NotFound(f"run {run_id}: the reward service has scored no batch of it")
            if len(self._runs) >= self.config.max_runs:
                raise ResourceExhausted(f"run {run_id}: the reward service keeps KL controllers for max_runs="
                                        f"{self.config.max_runs} runs")
            controller = make_controller(self.config)
            if kept and controller.load(path):
                log.info("KL controller state restored", extra={"run_id": run_id, "path": path,
                                                                 "coef": controller.coef})
            self._runs[run_id] = controller
            return controller
