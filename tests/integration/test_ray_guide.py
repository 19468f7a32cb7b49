"""docs/guides/ray.md as written: its config file (the yaml block) and its commands (the first bash block)
run, in order, on a two-node Ray cluster on this host (``ray start --head`` and ``ray start --address``,
CPU only), with only the substitutions of ``SUBSTITUTIONS`` and ``LINE_RULES``, each one the guide names.
The guide cannot drift from the code: a command that fails, a setting a service refuses, or a line a
substitution no longer finds fails this test.

The commands run from a directory of this test holding the config file as ``fleet.yaml`` and a copy of
``examples/`` (the guide's commands run from a checkout); ``RAY_ADDRESS`` (the guide exports it) keeps
every command on this cluster, whatever else runs on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import ray

from rlfleet.services.launch import free_port
from tests.leftovers import Leftovers, alive
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "ray.md"
COMMAND_TIMEOUT = 900.0
"""One command: `up` starts a vLLM engine and four more services on a loaded 2-core host."""

SUBSTITUTIONS = [  # (as the guide writes it, what runs here): the guide names each one
    ("/models/policy", "{model}"),                      # the model: the tests' tiny one
    ("/shared/rlfleet", "{workdir}"),                   # the shared volume: this test's directory
    ("10.0.0.11:6379", "{host_ip}:{gcs_port}"),         # the head: this host, a free port
    ("--port 6379", "--port {gcs_port}"),
    ("10.0.0.11", "{host_ip}"),                         # the nodes' IPs: this host's, as Ray gives it
    ("10.0.0.12", "{host_ip}"),
    ("port: 50050", "port: {collector_port}"),          # a fixed port: a free one
    ("num_gpus: 1", "num_gpus: 0"),                     # CPU only ...
    ("--num-gpus 1", "--num-gpus 0"),
    ("engine_kwargs: {gpu_memory_utilization: 0.85}", "kv_cache_memory_bytes: 268435456"),  # ... its KV cache
]
ONE_HOST = "--num-cpus 4 --temp-dir {ray_dir}/{node}"
"""The flags the guide gives for several nodes on one host (its `--dashboard-agent-listen-port` is for
ray[default] only; the head also gets a free `--ray-client-server-port`)."""
LINE_RULES = [  # (a command starting so, what runs instead)
    ("pip install", None),                              # this environment is every node's
    ("ray start --head", "{line} " + ONE_HOST.replace("{node}", "head") + " --ray-client-server-port {client_port}"),
    ("ray start --address", "{line} " + ONE_HOST.replace("{node}", "node1")),
    ("ray stop", "STOP"),                               # it stops every Ray process of the host: ours only
]


def guide_blocks() -> tuple[str, list[str]]:
    """The guide's config file and its first bash block's commands (continuations joined, comments dropped)."""
    text = GUIDE.read_text()
    config = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    script = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        command = re.sub(r"\s+#.*$", "", line).strip()
        if command:
            commands.append(re.sub(r"\s+", " ", command))
    return config, commands


def substitute(text: str, values: dict[str, str], used: set[str]) -> str:
    for written, here in SUBSTITUTIONS:
        if written in text:
            used.add(written)
            text = text.replace(written, here.format(**values))
    return text


def local_command(command: str, values: dict[str, str]) -> str | None:
    for start, replacement in LINE_RULES:
        if command.startswith(start):
            return replacement and replacement.format(line=command, **values)
    return command


class LocalRayCluster:
    """Stops the Ray processes of the cluster whose nodes use ``ray_dir`` (never another's: `ray stop`
    would stop every Ray process of the host)."""

    def __init__(self, ray_dir: Path, gcs_port: str):
        self.marks = (str(ray_dir), f":{gcs_port} ")  # its nodes' directories, its GCS address

    def processes(self) -> list[psutil.Process]:
        """Its live processes (``alive``: zombies aside)."""
        found = {}
        for process in psutil.process_iter(["cmdline"]):
            command = " ".join(process.info["cmdline"] or ()) + " "
            if process.pid != os.getpid() and any(mark in command for mark in self.marks):
                with contextlib.suppress(psutil.NoSuchProcess):
                    for member in (process, *process.children(recursive=True)):
                        found[member.pid] = member
        return [process for process in found.values() if alive(process.pid)]

    def stop(self) -> None:
        processes = self.processes()
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.terminate()
        with contextlib.suppress(TimeoutError):  # (psutil.wait_procs waits out a zombie that is not ours)
            wait_for(lambda: not any(alive(p.pid) for p in processes), timeout=30,
                     what="the cluster's processes to exit")
        for process in [p for p in processes if alive(p.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def run(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=COMMAND_TIMEOUT)
    assert result.returncode == 0, f"`{command}` failed ({result.returncode}):\n{(result.stdout + result.stderr)[-6000:]}"
    return result


@pytest.fixture
def place(tiny_model_dir):
    """The directory the commands run in, the values the substitutions fill in, the cluster to stop."""
    directory = Path(tempfile.mkdtemp(prefix="ray-guide-"))  # short: Ray's socket paths live in it
    shutil.copytree(ROOT / "examples", directory / "examples")
    values = {"model": str(tiny_model_dir), "workdir": str(directory / "shared"), "ray_dir": str(directory / "ray"),
              "host_ip": ray.util.get_node_ip_address(),
              "gcs_port": str(free_port()), "client_port": str(free_port()), "collector_port": str(free_port())}
    cluster = LocalRayCluster(directory / "ray", values["gcs_port"])
    yield directory, values, cluster
    cluster.stop()
    shutil.rmtree(directory, ignore_errors=True)


def test_the_ray_guide_runs_as_written_on_a_two_node_cpu_cluster(place):
    directory, values, cluster = place
    config, commands = guide_blocks()
    used: set[str] = set()
    (directory / "fleet.yaml").write_text(substitute(config, values, used))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_MODE", None)  # the guide sets it
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # Ray's token for every node: read before ~/.ray/auth_token
    leftovers = Leftovers("rlfleet")  # the guide's fleet name
    results, timings = {}, {}
    for written in commands:
        command = local_command(substitute(written, values, used), values)
        if command is None:
            continue
        if command == "STOP":
            check_a_plain_up_resumes_the_run(directory, env, results, values["model"])
            cluster.stop()
        elif command.startswith("export "):
            name, _, value = command[len("export "):].partition("=")
            env[name] = value
        else:
            if command.startswith("rlfleet-ray up"):
                check_a_refused_setting_is_reported_once(directory, env)
            if command.startswith("rlfleet-ray down"):  # the last moment the fleet's processes can be seen
                leftovers.sample(json.loads(run("rlfleet-ray status", directory, env).stdout))
            started = time.monotonic()
            results[written] = run(command, directory, env)
            timings[written[:50]] = round(time.monotonic() - started)
    print("the guide's commands, seconds each:", json.dumps(timings, indent=1))
    assert used == {written for written, _ in SUBSTITUTIONS}, "a substitution the guide no longer needs"
    check_what_the_commands_did(directory, results)
    with contextlib.suppress(TimeoutError):  # `ray stop` returns once it has signalled; exits follow
        wait_for(lambda: not cluster.processes(), timeout=60, what="the cluster's processes to exit")
    assert not cluster.processes(), "the cluster's processes outlived its `ray stop`"
    leftovers.assert_none_within(60)


def check_a_refused_setting_is_reported_once(directory: Path, env: dict[str, str]) -> None:
    """The mistake the guide once made (a vLLM argument as a generation setting): `up` fails with the
    service's own refusal, once, and no traceback (that a start's report holds its own log lines only, not
    a previous start's, tests/unit/test_ray.py checks)."""
    config = (directory / "fleet.yaml").read_text()
    bad = config.replace("settings: {model: ", "settings: {gpu_memory_utilization: 0.85, model: ", 1)
    assert bad != config
    (directory / "bad.yaml").write_text(bad)
    result = subprocess.run(["rlfleet-ray", "up", "bad.yaml"], cwd=directory, env=env, capture_output=True,
                            text=True, timeout=COMMAND_TIMEOUT)
    print(result.stderr)
    assert result.returncode == 1, result.stderr
    assert "rlfleet-ray up: error: generation-0 did not start: generation exited with code 2" in result.stderr
    assert result.stderr.count("gpu_memory_utilization\n  Extra inputs are not permitted") == 1, result.stderr
    assert "Traceback" not in result.stderr and "ActorDiedError" not in result.stderr, result.stderr


def check_a_plain_up_resumes_the_run(directory: Path, env: dict[str, str], results: dict, model: str) -> None:
    """After the guide's `down`: `up` without --fresh says it resumes, and the collector is back in the
    guide's run at the version its trainer reached (the fresh start was the first start's only). A freshly
    initialised trainer (the guide's outside-the-cluster command) is refused, naming that run."""
    fresh_up = next(result for command, result in results.items() if command.startswith("rlfleet-ray up"))
    run_id = re.search(r"collector: run (\S+): new", fresh_up.stderr).group(1)
    resumed = run("rlfleet-ray up fleet.yaml", directory, env).stderr
    assert "resuming the durable state" in resumed and f"collector: run {run_id}: resumed at version 3" in resumed, resumed
    trainer = subprocess.run(["bash", "-c", f'python examples/train_grpo.py --collector "$(rlfleet-ray address collector)" '
                              f'--model-dir {model} --credentials ./credentials --steps 1 --out fresh-trainer'],
                             cwd=directory, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    assert trainer.returncode != 0 and "this trainer starts a new run" in trainer.stderr, trainer.stderr[-3000:]
    assert f"the collector holds run {run_id} " in trainer.stderr and not (directory / "fresh-trainer" / "metrics.json").exists()
    run("rlfleet-ray down", directory, env)


def check_what_the_commands_did(directory: Path, results: dict[str, subprocess.CompletedProcess]) -> None:
    def result(start: str) -> subprocess.CompletedProcess:
        return next(result for command, result in results.items() if command.startswith(start))

    up = result("rlfleet-ray up").stderr
    assert "starting a fresh run" in up and re.search(r"collector: run \S+: new", up), up
    status = json.loads(result("rlfleet-ray status").stdout)
    assert {"collector", "trajectory", "reference", "reward", "generation-0"} <= set(status)
    assert all(record["starts"] == 1 for record in status.values()), status
    assert result("rlfleet-ray scale").stdout.split() == ["generation-0", "generation-1"]
    metrics = json.loads((directory / "runs" / "ray-demo" / "metrics.json").read_text())
    assert [m["policy_version"] for m in metrics] == [1, 2, 3]
