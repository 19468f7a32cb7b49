import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.services.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.services.reward import controllers
from rlfleet.services.reward.controllers import AdaptiveKLController, ConstantKLController


def test_constant_controller_never_moves():
    controller = ConstantKLController(0.05)
    assert controller.update(100.0, n_steps=3) == 0.05
    assert controller.update(-1.0) == 0.05
    assert controller.steps == 4
    assert [update.kl for update in controller.history] == [100.0, -1.0]


def test_adaptive_controller_on_hand_computed_numbers():
    controller = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    # 9/6 - 1 = 0.5 -> clipped to 0.2; mult = 1 + 0.2 * 256 / 10000 = 1.00512
    assert controller.update(9.0, n_steps=256) == pytest.approx(0.100512, rel=1e-12)
    # 3/6 - 1 = -0.5 -> clipped to -0.2; mult = 1 - 0.2 * 100 / 10000 = 0.998
    assert controller.update(3.0, n_steps=100) == pytest.approx(0.100512 * 0.998, rel=1e-12)
    # 6.6/6 - 1 = 0.1 (inside the clip); mult = 1 + 0.1 * 1000 / 10000 = 1.01
    assert controller.update(6.6, n_steps=1000) == pytest.approx(0.100512 * 0.998 * 1.01, rel=1e-12)
    assert controller.steps == 1356
    assert [update.step for update in controller.history] == [256, 356, 1356]


def test_update_from_values_uses_mean_and_count():
    a = AdaptiveKLController(0.2, target=1.0, horizon=100)
    b = AdaptiveKLController(0.2, target=1.0, horizon=100)
    a.update_from_values([1.0, 1.1, 1.2])
    b.update(1.1, n_steps=3)
    assert a.coef == pytest.approx(b.coef)
    with pytest.raises(InvalidArgument, match="must not be empty"):
        a.update_from_values([])


@pytest.mark.parametrize("kl, n_steps, match", [
    (float("nan"), 1, "current_kl must be finite"),
    (float("inf"), 1, "current_kl must be finite"),
    (1.0, 0, "n_steps must be >= 1"),
    (1.0, 500, "n_steps=500 must be < 5 \\* horizon"),
])
def test_bad_updates_are_refused_and_change_nothing(kl, n_steps, match):
    controller = AdaptiveKLController(0.1, target=1.0, horizon=100)
    with pytest.raises(InvalidArgument, match=match):
        controller.update(kl, n_steps)
    assert (controller.coef, controller.steps, controller.history) == (0.1, 0, [])


@pytest.mark.parametrize("kwargs, match", [
    (dict(init_kl_coef=-0.1, target=1.0, horizon=1.0), "init_kl_coef"),
    (dict(init_kl_coef=0.1, target=0.0, horizon=1.0), "target"),
    (dict(init_kl_coef=0.1, target=1.0, horizon=0.0), "horizon"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        AdaptiveKLController(**kwargs)


def test_history_is_bounded():
    controller = ConstantKLController(0.1, max_history=3)
    for kl in range(10):
        controller.update(float(kl))
    assert [update.kl for update in controller.history] == [7.0, 8.0, 9.0]
    assert controller.steps == 10


kl_sequences = st.lists(
    st.tuples(st.floats(-1.0, 50.0), st.integers(1, 400)), min_size=0, max_size=40
)


@settings(max_examples=100, deadline=None)
@given(
    kl_sequences,
    st.floats(0.001, 1.0),
    st.floats(0.01, 20.0),
    st.floats(100.0, 1e5),
)
def test_adaptive_controller_reproduces_the_formula(sequence, init, target, horizon):
    controller = AdaptiveKLController(init, target=target, horizon=horizon)
    coef = init
    for current_kl, n_steps in sequence:
        proportional_error = min(max(current_kl / target - 1, -0.2), 0.2)
        coef *= 1 + proportional_error * n_steps / horizon
        assert controller.update(current_kl, n_steps) == pytest.approx(coef, rel=1e-12)
    assert controller.steps == sum(n for _, n in sequence)
    assert controller.coef > 0


@settings(max_examples=50, deadline=None)
@given(kl_sequences, st.booleans())
def test_state_round_trips_through_its_file(sequence, adaptive):
    def make():
        if adaptive:
            return AdaptiveKLController(0.1, target=3.0, horizon=1000)
        return ConstantKLController(0.1)

    controller = make()
    for current_kl, n_steps in sequence:
        controller.update(current_kl, n_steps)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "state" / "kl.json"
        controller.save(path)
        restored = make()
        assert restored.load(path)
        assert os.listdir(path.parent) == ["kl.json"]  # no temp file left behind
    assert restored.state_dict() == controller.state_dict()
    assert restored.coef == controller.coef
    # The restored controller continues exactly where the original would.
    assert restored.update(2.0, 7) == controller.update(2.0, 7)


def test_load_missing_file_returns_false(tmp_path):
    controller = ConstantKLController(0.3)
    assert not controller.load(tmp_path / "absent.json")
    assert controller.coef == 0.3


def test_load_refuses_corrupt_or_foreign_state(tmp_path):
    path = tmp_path / "kl.json"
    path.write_text("{not json")
    with pytest.raises(FailedPrecondition, match="not valid JSON"):
        ConstantKLController(0.1).load(path)

    ConstantKLController(0.1).save(path)
    with pytest.raises(FailedPrecondition, match="'constant' controller, not 'adaptive'"):
        AdaptiveKLController(0.1, target=1.0, horizon=10).load(path)

    state = json.loads(path.read_text())
    state["format_version"] = 99
    path.write_text(json.dumps(state))
    with pytest.raises(FailedPrecondition, match="format_version 99"):
        ConstantKLController(0.1).load(path)

    state["format_version"] = controllers.STATE_FORMAT_VERSION
    del state["coef"]
    path.write_text(json.dumps(state))
    controller = ConstantKLController(0.1)
    with pytest.raises(FailedPrecondition, match="malformed"):
        controller.load(path)
    assert controller.coef == 0.1


def test_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "kl.json"
    controller = AdaptiveKLController(0.1, target=1.0, horizon=100)
    controller.save(path)
    before = path.read_text()
    controller.update(5.0, 10)

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(controllers.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        controller.save(path)
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["kl.json"]


def test_state_file_is_readable_json(tmp_path):
    controller = AdaptiveKLController(0.1, target=2.0, horizon=100)
    controller.update(4.0, 5)
    controller.save(tmp_path / "kl.json")
    state = json.loads((tmp_path / "kl.json").read_text())
    assert state["kind"] == "adaptive"
    assert state["settings"] == {"target": 2.0, "horizon": 100.0}
    assert state["steps"] == 5
    assert math.isclose(state["coef"], 0.1 * (1 + 0.2 * 5 / 100))
    assert state["history"] == [{"step": 5, "kl": 4.0, "n_steps": 5, "coef": state["coef"]}]
