"""rlfleet.ray's logic without a cluster: the config file, settings substitution, credentials delivery,
the autoscaling policy (a fake wait counter and a fake autoscaler: the decision is what is tested; the
fleet itself runs on a real local cluster in tests/integration/test_ray.py)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlfleet.ray import node_dir, reaper, runs
from rlfleet.ray.actor import substitute
from rlfleet.ray.autoscale import GenerationAutoscaler, WaitPolicy
from rlfleet.ray.config import FleetConfig, load_config
from rlfleet.ray.fleet import FleetError, read_credentials
from rlfleet.ray.node_dir import NodeDirectory
from rlfleet.registry import Registry
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"services": {name: {} for name in ("trajectory", "reference", "reward", "generation", "collector")}}


def test_importing_rlfleet_ray_imports_no_ray():
    code = "import sys, rlfleet.ray, rlfleet.client; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_guides_fleet_configs_parse():
    """docs/guides/ray.md's config files are real ones (tests/integration/test_ray_guide.py runs the first;
    the second is a shared fleet's, each of its runs checked)."""
    text = (ROOT / "docs" / "guides" / "ray.md").read_text()
    first, shared = (FleetConfig.from_dict(yaml.safe_load(block)) for block in re.findall(r"```yaml\n(.*?)```", text, re.S))
    assert first.services["generation"].placement == "spread" and not first.shared
    assert shared.runs["exp-b"].share_weight == 2 and shared.run_settings("collector", "exp-b")["state_dir"] == \
        "./rlfleet-runs/collector-exp-b/state"


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
    node = NodeDirectory.claim("f", "collector", base=str(tmp_path))
    directory = node.write_credentials(files)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700 == stat.S_IMODE(node.path.parent.stat().st_mode)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 and p.read_bytes() == files[p.name] for p in directory.iterdir())
    with pytest.raises(FleetError, match="tokens"):
        (tmp_path / "credentials" / "tokens").unlink()
        read_credentials(tmp_path / "credentials")
    with pytest.raises(FleetError, match="not a directory here"):
        read_credentials(tmp_path / "elsewhere")


def test_an_actors_node_directory_replaces_its_predecessors_and_goes_with_it(tmp_path):
    """A replacement on the same host (its predecessor SIGKILLed: nothing removed) removes what it left;
    the last one's removal leaves nothing of the instance."""
    (tmp_path / "node").mkdir()
    first = NodeDirectory.claim("f", "generation-0", base=str(tmp_path / "node"))
    first.write_credentials({"generation.key": b"secret"})
    first.fresh_tmp().joinpath("vllm_dist_0123").write_bytes(b"")
    other = NodeDirectory.claim("f", "generation-1", base=str(tmp_path / "node"))  # another instance: untouched
    second = NodeDirectory.claim("f", "generation-0", base=str(tmp_path / "node"))
    assert not first.path.exists() and second.path.parent == first.path.parent and other.path.exists()
    second.remove()
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == ["rlfleet-f-generation-1"]
    node_dir.remove(first.path)  # the predecessor's reaper, late: nothing to do, the successor's kept
    other.remove()
    assert list((tmp_path / "node").iterdir()) == []


def test_a_node_directory_never_lands_in_a_path_it_does_not_own(tmp_path):
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "rlfleet-f-collector").symlink_to(tmp_path)  # someone's trap in a shared /tmp
    with pytest.raises(PermissionError, match="refusing"):
        NodeDirectory.claim("f", "collector", base=str(tmp_path / "node"))


class FakeGcs:
    """The GCS key-value calls the registry makes, on a dict (one GCS: every Registry shares it)."""

    def __init__(self):
        self.kv: dict[bytes, bytes] = {}

    def internal_kv_put(self, key, value, overwrite, namespace):
        self.kv[key] = value

    def internal_kv_get(self, key, namespace):
        return self.kv.get(key)

    def internal_kv_del(self, key, by_prefix, namespace):
        for name in [k for k in self.kv if (k.startswith(key) if by_prefix else k == key)]:
            del self.kv[name]

    def internal_kv_keys(self, prefix, namespace):
        return [k for k in self.kv if k.startswith(prefix)]

    def internal_kv_multi_get(self, keys, namespace):
        return {k: self.kv[k] for k in keys if k in self.kv}


def registry(gcs: FakeGcs) -> Registry:
    return Registry("gcs:1", "f", gcs=gcs)


def test_up_fresh_starts_the_stateful_services_fresh_once_and_restarts_resume():
    """The marker ``up --fresh`` leaves: ``--fresh`` for the collector's and the store's starts until one
    serves; never for a restart after that (the actor's own, or Ray's on another node: another actor)."""
    gcs = FakeGcs()
    driver, first_actor, restarted_actor = registry(gcs), registry(gcs), registry(gcs)
    assert runs.request_fresh(driver, ["trajectory", "reference", "generation", "collector"]) == [
        "trajectory", "collector"]  # (and reward, where the fleet has one: its KL controller's state)
    assert runs.start_args(first_actor, "generation-0") == []
    assert runs.start_args(first_actor, "trajectory") == ["--fresh", "true"]
    # The first fresh process died before it served: its successor starts fresh (nothing of the new run yet).
    assert runs.start_args(restarted_actor, "trajectory") == ["--fresh", "true"]
    runs.started(restarted_actor, "trajectory")
    assert runs.start_args(restarted_actor, "trajectory") == [] == runs.start_args(registry(gcs), "trajectory")
    assert runs.start_args(first_actor, "collector") == ["--fresh", "true"]  # each instance consumes its own
    runs.started(first_actor, "collector")
    assert runs.start_args(first_actor, "collector") == []


SHARED = {"workdir": "/w", "runs": {"exp-a": {}, "exp-b": {"share_weight": 2, "port": 50061,
                                                           "settings": {"players": {"opponent": "exp-a"}}}},
          "services": {**MINIMAL["services"],
                       "generation": {"settings": {"max_runs": 4, "max_lora_rank": 8}},
                       "trajectory": {"settings": {"db_path": "{workdir}/{key}/trajectories.db"}},
                       "collector": {"port": 50050, "settings": {"state_dir": "{workdir}/{run}/collector",
                                                                  "mode": "sync"}}}}


def test_a_shared_fleets_runs_each_get_a_collector_and_store_of_their_own():
    config = FleetConfig.from_dict(SHARED)
    assert config.shared and FleetConfig.from_dict(config.to_dict()) == config
    assert not FleetConfig.from_dict(MINIMAL).shared  # no `runs`: one run, keys collector and trajectory
    assert FleetConfig.from_dict({**SHARED, "runs": {}}).shared  # runs added later
    b = config.run_settings("collector", "exp-b")
    assert b == {"state_dir": "/w/exp-b/collector", "mode": "sync", "run_name": "exp-b", "shared_replicas": True,
                 "share_weight": 2, "players": {"opponent": "exp-a"}}
    assert config.run_settings("trajectory", "exp-a") == {"db_path": "/w/trajectory-exp-a/trajectories.db",
                                                          "run_name": "exp-a"}
    assert runs.request_fresh(registry(FakeGcs()), ["trajectory-exp-a", "collector-exp-a", "generation-0"]) == [
        "trajectory-exp-a", "collector-exp-a"]
    text = runs.describe_start({"collector-exp-a": b, "generation-0": {}}, fresh=False)
    assert "collector-exp-a: state_dir /w/exp-b/collector" in text and "generation" not in text


def test_a_run_that_trains_full_weights_holds_replicas_alone_and_takes_no_shared_slot():
    config = FleetConfig.from_dict({**SHARED, "runs": {**SHARED["runs"], **{f"full-{i}": {"replicas": 1}
                                                                          for i in range(3)}}})
    assert [name for name, run in config.runs.items() if run.shared] == ["exp-a", "exp-b"]  # max_runs 4 holds them
    settings = config.run_settings("collector", "full-0")
    assert "shared_replicas" not in settings and "share_weight" not in settings and settings["run_name"] == "full-0"
    with pytest.raises(ValueError, match="replicas: -1 is negative"):
        FleetConfig.from_dict({**SHARED, "runs": {"a": {"replicas": -1}}})


@pytest.mark.parametrize("change, match", [
    ({"runs": {"exp/a": {}}}, "not a run name"),
    ({"runs": {"a": {"share_weight": 0}}}, "share_weight"),
    ({"runs": {"a": {"weight": 1}}}, r"runs.a: unknown \['weight'\]"),
    ({"runs": {str(i): {} for i in range(5)}}, "max_runs is 4"),
    ({"services": {**SHARED["services"], "collector": {"settings": {"state_dir": "{workdir}/collector"}}}},
     "runs exp-a and exp-b would share their durable state"),
    ({"services": {**SHARED["services"], "trajectory": {"settings": {"database_url": "postgresql://db/x"}}}},
     "PostgreSQL schema rlfleet_trajectory"),
])
def test_a_shared_fleet_refuses_runs_that_cannot_share_it(change, match):
    with pytest.raises(ValueError, match=match):
        FleetConfig.from_dict({**SHARED, **change})


def test_adding_a_run_to_a_fleet_of_one_run_says_how_to_share_it():
    with pytest.raises(ValueError, match="this fleet holds one run"):
        FleetConfig.from_dict(MINIMAL).check_run("exp-a")


def test_a_plain_up_resumes_and_says_where_from():
    gcs = FakeGcs()
    assert all(runs.start_args(registry(gcs), key) == [] for key in runs.STATEFUL)
    text = runs.describe_start({"collector": {"state_dir": "/w/collector/state"},
                                "trajectory": {"database_url": "postgresql://db/x"}}, fresh=False)
    assert "resuming" in text and "state_dir /w/collector/state" in text and "PostgreSQL" in text
    assert "fresh run" in runs.describe_start({}, fresh=True)


def test_starts_count_across_actors_until_the_instance_is_forgotten():
    gcs = FakeGcs()
    assert [registry(gcs).count_start("collector") for _ in range(3)] == [1, 2, 3]  # each a new actor
    driver = registry(gcs)
    driver.put("fresh", "collector", "requested")
    driver.put("error", "collector", "refused")
    driver.forget("collector")
    assert gcs.kv == {} and registry(gcs).count_start("collector") == 1


def test_config_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    """``scale`` or ``down`` run from another directory read the same credentials (the spec holds them absolute)."""
    (tmp_path / "deploy").mkdir()
    path = tmp_path / "deploy" / "fleet.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "credentials": "./credentials", "workdir": "state"}))
    monkeypatch.chdir(tmp_path)
    config = load_config("deploy/fleet.yaml")
    assert config.credentials == str(tmp_path / "deploy" / "credentials")
    assert config.workdir == str(tmp_path / "deploy" / "state")
    path.write_text(yaml.safe_dump({**MINIMAL, "workdir": "/abs/w"}))
    assert load_config(path).workdir == "/abs/w" and load_config(path).credentials is None


def test_cli_reports_a_missing_config_or_credentials_in_one_line(tmp_path, capsys):
    from rlfleet.ray.cli import main

    assert main(["up", str(tmp_path / "missing.yaml")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rlfleet-ray up: error: [Errno 2] No such file or directory: '{tmp_path / 'missing.yaml'}'"]


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
    for command in ("up", "status", "address", "scale", "down"):
        assert command in text


HOLD_A_SEGMENT = ("import sys, time; from multiprocessing import shared_memory, resource_tracker; "
                  "segment = shared_memory.SharedMemory(create=True, size=4096); "
                  # as vLLM's engine SIGKILLed with its tracker: nobody unlinks it
                  "resource_tracker.unregister(segment._name, 'shared_memory'); "
                  "print(segment.name, flush=True); time.sleep(600)")


def test_the_reaper_kills_the_group_once_its_actor_is_gone_and_removes_what_the_group_left(tmp_path):
    """The group (a leader and a child, each holding a shared-memory segment, as a vLLM engine core and
    its worker do) SIGKILLed when the pipe's write end closes; its segments and the actor's node directory
    removed; a segment of a process outside the group kept."""
    group = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                              f"{HOLD_A_SEGMENT!r}]); exec({HOLD_A_SEGMENT!r})"],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    outsider = subprocess.Popen([sys.executable, "-c", HOLD_A_SEGMENT], stdout=subprocess.PIPE, text=True)
    segments: list[Path] = []
    try:
        ours = {Path("/dev/shm") / group.stdout.readline().strip() for _ in range(2)}
        theirs = Path("/dev/shm") / outsider.stdout.readline().strip()
        segments += [*ours, theirs]
        assert reaper.held_segments(reaper.members(group.pid)) == ours
        node = NodeDirectory.claim("f", "generation-0", base=str(tmp_path))
        node.write_credentials({"generation.key": b"secret"})
        read_end, write_end = os.pipe()
        subprocess.run([sys.executable, "-m", "rlfleet.ray.reaper", str(read_end), str(group.pid), str(node.path)],
                       pass_fds=(read_end,), check=True, timeout=60)
        os.close(read_end)
        assert group.poll() is None and node.path.exists()
        os.close(write_end)  # the actor's process ends
        wait_for(lambda: group.poll() is not None, 60, "the group SIGKILLed")
        wait_for(lambda: not any(path.exists() for path in ours) and not list(tmp_path.iterdir()), 60,
                 "the group's segments and the node directory removed")
        assert group.returncode == -signal.SIGKILL and theirs.exists() and outsider.poll() is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group.pid, signal.SIGKILL)
        outsider.kill()
        group.wait()
        outsider.wait()
        for path in segments:
            path.unlink(missing_ok=True)


def test_a_failed_starts_log_tail_holds_that_start_only(tmp_path):
    """The service log is appended across starts (an actor restarts its process in the same directory):
    what a failed start reports is its own lines, never a previous start's."""
    from rlfleet.services.launch import ServiceProcess

    for _ in range(2):  # json.tool refuses the --port flags every service takes: a start that fails
        process = ServiceProcess("refuser", module="json.tool").start(tmp_path)
        assert process.process.wait(60) == 2
        assert process.log_tail().count("usage:") == 1
    assert (tmp_path / "refuser.log").read_text().count("usage:") == 2


MAKE_A_SEMAPHORE = ("import multiprocessing, time; lock = multiprocessing.get_context('spawn').Lock(); "
                    "print(lock._semlock.name.lstrip('/'), flush=True); time.sleep(600)")


def test_the_reaper_removes_the_named_semaphores_a_killed_group_made_between_its_scans(tmp_path):
    """A group that makes a multiprocessing lock (a named semaphore, unlinked by its resource tracker,
    a child in the same group) and is SIGKILLed whole before the reaper's next scan: nobody holds the
    semaphore, nobody would unlink it. The reaper removes it once the group is gone; an outsider's
    semaphore, made meanwhile and held only by its maker (who maps it under the temporary name
    ``sem_open`` linked it from), stays."""
    read_end, write_end = os.pipe()
    group = subprocess.Popen([sys.executable, "-c", "input(); " + MAKE_A_SEMAPHORE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    outsider = subprocess.Popen([sys.executable, "-c", "input(); " + MAKE_A_SEMAPHORE], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    made: list[Path] = []
    try:
        subprocess.run([sys.executable, "-m", "rlfleet.ray.reaper", str(read_end), str(group.pid)],
                       pass_fds=(read_end,), check=True, timeout=60)
        os.close(read_end)
        for process in (group, outsider):
            process.stdin.write("go\n")  # after the reaper's first scan
            process.stdin.flush()
        ours = Path("/dev/shm") / ("sem." + group.stdout.readline().strip())
        theirs = Path("/dev/shm") / ("sem." + outsider.stdout.readline().strip())
        made += [ours, theirs]
        assert ours.exists() and theirs.exists()
        assert reaper.held_segments([outsider.pid]) == {theirs}
        os.killpg(group.pid, signal.SIGKILL)  # the maker and its resource tracker with it
        group.wait()
        time.sleep(reaper.ORPHAN_MIN_AGE_SECONDS)  # noqa: the age the reaper waits for, not a race
        os.close(write_end)  # the actor's process ends
        wait_for(lambda: not ours.exists(), 60, "the orphaned semaphore removed")
        assert theirs.exists() and outsider.poll() is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group.pid, signal.SIGKILL)
        outsider.kill()
        outsider.wait()
        for path in made:
            path.unlink(missing_ok=True)
