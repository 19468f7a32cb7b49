"""The names a config or a request picks from, each list in one place: KL estimators, advantage
modes, weight-swap modes and update strategies (name <-> ``rlfleet.v1`` enum value), weight
transports, and the dtypes models load in.

Outside ``rlfleet.wire`` and ``rlfleet.client`` on purpose: importing either loads torch, and a
service's config imports this module, and is checked (exit 2 naming the setting) before any heavy
import. The SDK installs without the services, so the services import it from here.
"""

from __future__ import annotations

from typing import Literal

from rlfleet.v1 import reward_pb2, weights_pb2


def _enum_names(enum, prefix: str) -> dict[str, int]:
    # The enum's own names, lowercased (KL_ESTIMATOR_K3 -> "k3"): a value added to the proto is a
    # name here, in the proto's order.
    return {name.removeprefix(prefix).lower(): value for name, value in enum.items() if value != 0}


KL_ESTIMATORS: dict[str, int] = _enum_names(reward_pb2.KLEstimator, "KL_ESTIMATOR_")
"""``k1``, ``k2``, ``k3`` -> ``rlfleet.v1.KLEstimator`` (the formulas: ``services/reward/kl.py``)."""
ADVANTAGE_MODES: dict[str, int] = _enum_names(reward_pb2.AdvantageMode, "ADVANTAGE_MODE_")
"""``grpo``, ``grpo_no_std``, ``rloo`` -> ``rlfleet.v1.AdvantageMode`` (``services/reward/advantages.py``)."""

KLEstimatorName = Literal[tuple(KL_ESTIMATORS)]
"""A config field taking a KL estimator's name."""
AdvantageModeName = Literal[tuple(ADVANTAGE_MODES)]
"""A config field taking an advantage mode's name."""

MODEL_DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""Dtypes the services load Hugging Face models in (generation engine, reference model, reward
models): names of the dtype table (``rlfleet.wire.dtypes``, which answers for them too)."""
ModelDtypeName = Literal[MODEL_DTYPE_NAMES]
"""A config field taking a model dtype."""

SWAP_MODES: dict[str, int] = _enum_names(weights_pb2.UpdateMode, "UPDATE_MODE_")
"""``wait``, ``abort``, ``keep``, ``resume`` -> ``rlfleet.v1.UpdateMode``: what a push does to the requests in
flight (docs/guides/off-policy.md, "Weight-swap modes"). An unspecified mode is ``DEFAULT_SWAP_MODE``."""
DEFAULT_SWAP_MODE = "keep"
SWAP_MODE_NAMES: dict[int, str] = {0: DEFAULT_SWAP_MODE, **{value: name for name, value in SWAP_MODES.items()}}
"""``rlfleet.v1.UpdateMode`` -> its name, the unspecified value read as ``DEFAULT_SWAP_MODE``."""
SwapModeName = Literal[tuple(SWAP_MODES)]

UPDATE_STRATEGIES: dict[str, int] = _enum_names(weights_pb2.UpdateStrategy, "UPDATE_STRATEGY_")
"""``pause_all``, ``rolling`` -> ``rlfleet.v1.UpdateStrategy``: how the collector rolls a push out."""
UpdateStrategyName = Literal[tuple(UPDATE_STRATEGIES)]

WEIGHT_TRANSPORTS: tuple[str, ...] = ("grpc", "shm", "nccl")
"""How weights reach a generation replica (``GetEngineStatus.weight_transports``; a push's ``transport``
adds ``auto``: shm when the collector shares the trainer's host, else grpc)."""
