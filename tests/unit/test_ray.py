"""rlfleet.ray's logic without a cluster: the config file, settings substitution, credentials delivery,
the autoscaling policy (a fake wait counter and a fake autoscaler: the decision is what is tested; the
fleet itself runs on a real local cluster in tests/integration/test_ray.py)."""

from __future__ import annotations

import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlfleet.ray.actor import substitute, write_credentials
from rlfleet.ray.autoscale import GenerationAutoscaler, WaitPolicy
from rlfleet.ray.config import FleetConfig, load_config
from rlfleet.ray.fleet import read_credentials

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"services": {name: {} for name in ("trajectory", "reference", "reward", "generation", "collector")}}


def test_importing_rlfleet_ray_imports_no_ray():
    code = "import sys, rlfleet.ray, rlfleet.client; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_guides_fleet_config_parses():
    """docs/guides/ray.md's config file is a real one."""
    text = (ROOT / "docs" / "guides" / "ray.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    config = FleetConfig.from_dict(yaml.safe_load(block))
    assert config.services["generation"].replicas >= 2 and config.services["generation"].placement == "spread"


def test_config_file_round_trips_and_refuses_what_it_does_not_know(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "name": "f", "services": {
        **MINIMAL["services"], "generation": {"replicas": 3, "num_gpus": 1, "resources": {"gpu_node": 1}}}}))
    config = load_config(path)
    assert config.name == "f" and config.services["generation"].replicas == 3
    assert FleetConfig.from_dict(config.to_dict()) == config  # what the registry stores reads back
    for bad, match in [({**MINIMAL, "nmae": "x"}, "unknown fleet settings"),
                       ({"services": {**MINIMAL["services"], "collector": {"replica": 2}}}, "services.collector"),
                       ({"services": {k: v for k, v in MINIMAL["services"].items() if k != "reward"}}, "reward"),
                       ({"services": {**MINIMAL["services"], "viewer": {}}}, "unknown"),
                       ({"services": {**MINIMAL["services"], "reward": {"replicas": 2}}}, "only generation"),
                       ({"services": {**MINIMAL["services"], "generation": {"placement": "pack"}}}, "placement")]:
        with pytest.raises((ValueError, TypeError), match=match):
            FleetConfig.from_dict(bad)


def test_settings_substitute_the_workdir_and_key_in_strings_only():
    settings = {"db_path": "{workdir}/{key}/t.db", "sampling": {"stop": ["{key}"], "max_tokens": 8}, "on": True}
    assert substitute(settings, {"workdir": "/w", "key": "trajectory"}) == {
        "db_path": "/w/trajectory/t.db", "sampling": {"stop": ["trajectory"], "max_tokens": 8}, "on": True}


def test_credentials_travel_without_the_ca_key_and_land_private(tmp_path):
    from rlfleet.services.credentials import make_credentials

    files = read_credentials(make_credentials(tmp_path / "credentials", names=("collector", "trainer")))
    assert "ca.key" not in files and {"ca.pem", "tokens", "token-service", "collector.pem", "collector.key"} <= set(files)
    directory = write_credentials(files)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 and p.read_bytes() == files[p.name] for p in directory.iterdir())
    with pytest.raises(FileNotFoundError, match="tokens"):
        (tmp_path / "credentials" / "tokens").unlink()
        read_credentials(tmp_path / "credentials")


@pytest.mark.parametrize("waited, replicas, expected", [
    (0.0, 3, 2),      # nobody waited: one fewer
    (0.5, 3, 3),      # waited 5 % of the time: keep
    (3.0, 2, 3),      # 30 %: generation delivers 70 % of the demand -> ceil(2 / 0.7) = 3
    (8.0, 2, 8),      # 80 %: ceil(2 / 0.2) = 10, capped at max_replicas
    (0.0, 1, 1),      # never below min_replicas
])
def test_wait_policy_scales_with_the_fraction_of_time_trainers_waited(waited, replicas, expected):
    assert WaitPolicy(min_replicas=1, max_replicas=8).decide(waited, 10.0, replicas) == expected


def test_autoscaler_asks_ray_for_one_bundle_per_replica_and_scales_when_the_target_moves():
    clock, waited, replicas = [0.0], [0.0], [2]
    requests, scaled = [], []

    def scale(n):
        scaled.append(n)
        replicas[0] = n

    autoscaler = GenerationAutoscaler(WaitPolicy(max_replicas=4), lambda: waited[0], lambda: replicas[0], scale,
                                      {"GPU": 1.0}, request_resources=lambda bundles: requests.append(bundles),
                                      clock=lambda: clock[0])
    assert autoscaler.step() == 2 and requests == []  # the first reading only sets the baseline
    clock[0], waited[0] = 10.0, 5.0  # trainers waited half the time
    assert autoscaler.step() == 4 and requests == [[{"GPU": 1.0}] * 4] and scaled == [4]
    clock[0], waited[0] = 20.0, 6.0  # 10 %: enough
    assert autoscaler.step() == 4 and len(requests) == 1
    clock[0] = 30.0  # no wait at all: one fewer
    assert autoscaler.step() == 3 and requests[-1] == [{"GPU": 1.0}] * 3 and scaled == [4, 3]


def test_cli_help_names_every_command():
    from rlfleet.ray.cli import _parser

    text = _parser().format_help()
    for command in ("up", "status", "scale", "down"):
        assert command in text
