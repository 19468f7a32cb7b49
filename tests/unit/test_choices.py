"""rlfleet.choices: each list of names is spelt once, agrees with the proto enums, and is what the
configs, the reward math and the servicer accept."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest

from rlfleet.choices import ADVANTAGE_MODES, KL_ESTIMATORS, MODEL_DTYPE_NAMES
from rlfleet.v1 import reward_pb2


def test_names_are_the_enum_values_lowercased_without_their_prefix():
    assert KL_ESTIMATORS == {"k1": reward_pb2.KL_ESTIMATOR_K1, "k2": reward_pb2.KL_ESTIMATOR_K2,
                             "k3": reward_pb2.KL_ESTIMATOR_K3}
    assert ADVANTAGE_MODES == {"grpo": reward_pb2.ADVANTAGE_MODE_GRPO,
                               "grpo_no_std": reward_pb2.ADVANTAGE_MODE_GRPO_NO_STD,
                               "rloo": reward_pb2.ADVANTAGE_MODE_RLOO}


def test_each_kl_name_has_its_formula():
    from rlfleet.services.reward import kl

    assert kl.ESTIMATORS == {"k1": kl.kl_k1, "k2": kl.kl_k2, "k3": kl.kl_k3}


@pytest.mark.parametrize("path, field, names", [
    ("rlfleet.services.reward.config:RewardServiceConfig", "default_kl_estimator", tuple(KL_ESTIMATORS)),
    ("rlfleet.services.reward.config:RewardServiceConfig", "default_advantage_mode", tuple(ADVANTAGE_MODES)),
    ("rlfleet.services.collector.config:CollectorConfig", "kl_estimator", tuple(KL_ESTIMATORS)),
    ("rlfleet.services.collector.config:CollectorConfig", "advantage_mode", tuple(ADVANTAGE_MODES)),
    ("rlfleet.services.reference.config:ReferenceConfig", "dtype", MODEL_DTYPE_NAMES),
    ("rlfleet.services.generation.config:GenerationEngineConfig", "dtype", (*MODEL_DTYPE_NAMES, "auto")),
])
def test_config_fields_take_the_names_of_the_tables(path, field, names):
    import importlib

    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert get_args(cls.model_fields[field].annotation) == names


def test_model_dtypes_are_floating_rows_of_the_dtype_table():
    from rlfleet.wire import dtypes

    assert dtypes.MODEL_DTYPE_NAMES is MODEL_DTYPE_NAMES
    assert all(dtypes.BY_NAME[name].torch.is_floating_point for name in MODEL_DTYPE_NAMES)


def test_configs_import_without_torch():
    # A bad setting is refused before the service's heavy imports (services/common/server.py: run).
    code = ("import sys\n"
            "import rlfleet.services.generation.config, rlfleet.services.reference.config\n"
            "import rlfleet.services.reward.config, rlfleet.services.collector.config\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
