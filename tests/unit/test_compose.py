"""The compose files: health, exposure, the environment service's sandbox settings, and every
RLFLEET_* env var checked against the configs.

compose.yaml is the suite; compose.override.yaml (read by default) adds the GPU
reservation; compose.cpu.yaml is the CPU override (tiny model, one-shot init); compose.runs.yaml
turns either into a fleet two runs share.
Merging here is the simple per-key kind compose does for these files.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from rlfleet.services.collector.config import CollectorConfig
from rlfleet.services.common.config import ServiceConfig
from rlfleet.services.environment.config import EnvironmentServiceConfig
from rlfleet.services.generation.config import GenerationConfig
from rlfleet.services.reference.config import ReferenceServiceConfig
from rlfleet.services.reward.config import RewardServiceConfig
from rlfleet.services.trajectory.config import TrajectoryConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS: dict[str, type[ServiceConfig]] = {
    cls.service_name: cls
    for cls in (GenerationConfig, ReferenceServiceConfig, RewardServiceConfig, TrajectoryConfig, CollectorConfig,
                EnvironmentServiceConfig)
}
ONE_SHOT = {"model-init", "credentials"}
OBSERVABILITY = "prometheus"
"""The one service of the optional `observability` profile (not an rlfleet image)."""
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def merged(*names: str) -> dict[str, dict]:
    """Services of the given files, later files overriding earlier ones key by key."""
    services: dict[str, dict] = {}
    for name in names:
        for service, body in load(name)["services"].items():
            target = services.setdefault(service, {})
            for key, value in copy.deepcopy(body).items():
                if isinstance(value, dict) and isinstance(target.get(key), dict):
                    target[key] = {**target[key], **value}
                else:
                    target[key] = value
    return services


VARIANTS = {
    "gpu": merged("compose.yaml", "compose.override.yaml"),
    "cpu": merged("compose.yaml", "compose.cpu.yaml"),
}


def interpolate(value) -> str:
    """Fill ``${VAR:-default}`` with its default, as compose does with VAR unset."""
    return INTERPOLATION.sub(lambda m: m.group(2) or "", str(value))


def service_kind(body: dict) -> str | None:
    command = body.get("command") or []
    return command[0] if command and command[0] in CONFIGS else None


def rlfleet_env(body: dict) -> dict[str, str]:
    environment = body.get("environment") or {}
    assert isinstance(environment, dict), "write environment as a mapping"
    return {key: interpolate(value) for key, value in environment.items() if key.startswith("RLFLEET_")}


def all_services():
    for variant, services in VARIANTS.items():
        for name, body in services.items():
            yield pytest.param(variant, name, body, id=f"{variant}-{name}")


def test_all_files_parse_and_every_suite_service_runs():
    for variant, services in VARIANTS.items():
        kinds = {service_kind(body) for body in services.values()} - {None}
        assert kinds == set(CONFIGS), variant


@pytest.mark.parametrize("variant,name,body", list(all_services()))
def test_every_service_has_a_healthcheck_or_is_the_one_shot_init(variant, name, body):
    if name in ONE_SHOT:
        assert body.get("healthcheck") == {"disable": True} and body.get("restart") == "no"
        return
    test = body["healthcheck"]["test"]
    if name == OBSERVABILITY:  # prom/prometheus has busybox's wget; make-base-image's has Debian's
        assert test == ["CMD", "wget", "-q", "-O", "/dev/null", "http://127.0.0.1:9090/-/ready"], test
    else:
        assert test[:4] == ["CMD", "python", "-m", "rlfleet.services.healthcheck"], test
    assert body.get("restart") in ("unless-stopped", "always", "on-failure")


@pytest.mark.parametrize("variant", VARIANTS)
def test_only_the_collector_publishes_a_port(variant):
    """And the observability profile's Prometheus, on the host's loopback only."""
    publishing = {name for name, body in VARIANTS[variant].items() if body.get("ports")}
    assert publishing == {"collector", OBSERVABILITY}
    assert all(interpolate(mapping).startswith("127.0.0.1:") for mapping in VARIANTS[variant][OBSERVABILITY]["ports"])
    assert all("network_mode" not in body for body in VARIANTS[variant].values())


@pytest.mark.parametrize("variant,name,body", list(all_services()))
def test_env_vars_are_fields_of_that_services_config(variant, name, body):
    kind = service_kind(body)
    env = rlfleet_env(body)
    if kind is None:
        assert not env, f"{name}: RLFLEET_* env on a container that runs no service"
        return
    config_cls = CONFIGS[kind]
    prefix = config_cls.env_prefix()
    for key in env:
        assert key.startswith(prefix), f"{name}: {key} does not configure {kind}"
        assert key[len(prefix):].lower() in config_cls.model_fields, f"{name}: {key} is no field of {config_cls.__name__}"
    # The values must validate too: build the config exactly as the container will.
    config_cls.load([], environ=env)


@pytest.mark.parametrize("variant", VARIANTS)
def test_ports_in_env_match_container_ports_and_addresses(variant):
    services = VARIANTS[variant]
    ports = {}
    for name, body in services.items():
        kind = service_kind(body)
        if kind is None:
            continue
        config = CONFIGS[kind].load([], environ=rlfleet_env(body))
        ports[name] = config.port
        address = body["healthcheck"]["test"][4]
        assert address == f"127.0.0.1:{config.port}", f"{name}: healthcheck probes {address}"
        for mapping in body.get("ports") or []:
            assert int(interpolate(mapping).rsplit(":", 1)[1]) == config.port, f"{name}: publishes {mapping}"
    collector = CollectorConfig.load([], environ=rlfleet_env(services["collector"]))
    upstreams = [*collector.generation_addresses, collector.reference_address,
                 collector.reward_address, collector.trajectory_address, collector.environment_address]
    for upstream in upstreams:
        host, port = upstream.rsplit(":", 1)
        assert host in ports and ports[host] == int(port), f"collector upstream {upstream} matches no service"


@pytest.mark.parametrize("variant", VARIANTS)
def test_collector_waits_for_healthy_upstreams(variant):
    services = VARIANTS[variant]
    depends = services["collector"]["depends_on"]
    assert {name: dep["condition"] for name, dep in depends.items()} == {
        "generation": "service_healthy", "reference": "service_healthy",
        "reward": "service_healthy", "trajectory": "service_healthy", "environment": "service_healthy",
        "credentials": "service_completed_successfully"}
    for name, body in services.items():
        for dep in (body.get("depends_on") or {}).values():
            assert dep["condition"] in ("service_healthy", "service_completed_successfully"), name


@pytest.mark.parametrize("variant,name,body", list(all_services()))
def test_every_service_serves_mtls_with_role_tokens_from_the_credentials_volume(variant, name, body):
    kind = service_kind(body)
    if kind is None:
        return
    config = CONFIGS[kind].load([], environ=rlfleet_env(body))
    assert (config.tls_cert_file, config.tls_key_file) == (f"/credentials/{name}.pem", f"/credentials/{name}.key")
    assert config.tls_client_ca_file == "/credentials/ca.pem" and config.auth_tokens_file == "/credentials/tokens"
    assert config.auth_token is None and config.host == "0.0.0.0"
    assert "credentials:/credentials:ro" in body["volumes"]
    assert body["depends_on"]["credentials"] == {"condition": "service_completed_successfully"}
    test = body["healthcheck"]["test"]
    assert test[5:] == ["--tls-ca", "/credentials/ca.pem", "--tls-cert", f"/credentials/{name}.pem",
                        "--tls-key", f"/credentials/{name}.key"]
    if kind == "collector":
        assert (config.upstream_tls_ca_file, config.upstream_tls_cert_file, config.upstream_tls_key_file) == (
            "/credentials/ca.pem", f"/credentials/{name}.pem", f"/credentials/{name}.key")
        assert config.upstream_auth_token_file == "/credentials/token-service" and config.upstream_auth_token is None


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_credentials_init_makes_a_certificate_for_every_service_and_the_trainer(variant):
    from rlfleet.services.credentials import DEFAULT_NAMES

    body = VARIANTS[variant]["credentials"]
    assert body["command"][:4] == ["python", "-m", "rlfleet.services.credentials", "/credentials"]
    assert "--name" not in body["command"]  # the defaults: every service plus the trainer
    served = {name for name, service in VARIANTS[variant].items() if service_kind(service)}
    assert served | {"trainer"} == set(DEFAULT_NAMES)
    assert body["volumes"] == ["credentials:/credentials", "credentials-ca:/ca"]
    assert body["command"][body["command"].index("--ca-key-dir") + 1] == "/ca"
    for name, other in VARIANTS[variant].items():  # the CA's key stays in the init's own volume
        assert name == "credentials" or all("credentials-ca" not in volume for volume in other.get("volumes", ())), name


def test_gpu_reservation_only_by_default_and_cpu_variant_uses_the_tiny_model():
    gpu, cpu = VARIANTS["gpu"], VARIANTS["cpu"]
    devices = gpu["generation"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert all("deploy" not in body for body in cpu.values())
    assert all(body["build"]["args"]["TARGET"] == "cpu" for name, body in cpu.items() if name != OBSERVABILITY)
    init = cpu["model-init"]
    assert init["command"][0] == "tiny-model"
    model_dir = init["command"][1]
    for name in ("generation", "reference", "reward"):
        assert cpu[name]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert rlfleet_env(cpu["generation"])["RLFLEET_GENERATION_MODEL"] == model_dir
    assert rlfleet_env(cpu["reference"])["RLFLEET_REFERENCE_MODEL_PATH"] == model_dir
    assert rlfleet_env(cpu["reward"])["RLFLEET_REWARD_TOKENIZER_PATH"] == model_dir
    assert rlfleet_env(cpu["environment"])["RLFLEET_ENVIRONMENT_TOKENIZER_PATH"] == model_dir
    assert cpu["environment"]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"


def test_trajectory_log_is_on_a_named_volume():
    compose = load("compose.yaml")
    body = VARIANTS["cpu"]["trajectory"]
    db_path = Path(rlfleet_env(body)["RLFLEET_TRAJECTORY_DB_PATH"])
    mounts = dict(volume.split(":", 1) for volume in body["volumes"])
    volume = next(source for source, target in mounts.items() if db_path.is_relative_to(target))
    assert volume in compose["volumes"]


BWRAP_EXCEPTIONS = {"seccomp=unconfined", "apparmor=unconfined"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_environment_sandbox_gets_bwrap_and_nothing_more(variant):
    """bwrap needs two exceptions to Docker's defaults (see compose.yaml); they stay on this one
    service, which keeps only the capabilities the uid drop needs and refuses to run unsandboxed.
    /proc stays masked: the sandbox mounts no /proc of its own (the kernel would refuse it)."""
    services = VARIANTS[variant]
    body = services["environment"]
    assert set(body["security_opt"]) == BWRAP_EXCEPTIONS | {"no-new-privileges=true"}
    assert body["cap_drop"] == ["ALL"]
    assert set(body["cap_add"]) == {"DAC_OVERRIDE", "SETUID", "SETGID", "KILL"}
    assert body["user"] == "0:0"  # the sandbox drops each snippet to uid 65534 from root
    assert "privileged" not in body and not body.get("ports")
    config = EnvironmentServiceConfig.load([], environ=rlfleet_env(body))
    assert config.allow_rlimits_only is False and config.sandbox.proc is False
    # Root must not write the cache the uid-10001 services share: the models volume is read-only.
    assert "models:/models:ro" in body["volumes"] and body["environment"]["HF_HUB_OFFLINE"] == "1"
    for name, other in services.items():
        if name == "environment":
            continue
        assert not other.get("security_opt") and not other.get("cap_add") and not other.get("privileged"), name
        # The credentials init is root only to hand the keys to uid 10001 and keep the CA key to itself.
        allowed = {"credentials": (None, "rlfleet", "0:0"), OBSERVABILITY: ("65534:65534",)}  # nobody
        assert other.get("user") in allowed.get(name, (None, "rlfleet")), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_environment_tokenizer_is_the_policys_cached_by_reward(variant):
    """Observation tokens must be the sampling model's own; offline and read-only, the environment
    service reads the tokenizer the reward service (started first) put in the shared cache."""
    services = VARIANTS[variant]
    environment = EnvironmentServiceConfig.load([], environ=rlfleet_env(services["environment"]))
    reward = RewardServiceConfig.load([], environ=rlfleet_env(services["reward"]))
    policy = rlfleet_env(services["generation"])["RLFLEET_GENERATION_MODEL"]
    assert environment.tokenizer_path == reward.tokenizer_path == policy
    assert services["environment"]["depends_on"]["reward"]["condition"] == "service_healthy"


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_observability_profile_scrapes_every_service_on_its_metrics_port(variant):
    """`--profile observability` adds a Prometheus (and nothing else) whose configuration lists every
    rlfleet service at the metrics port that service serves on the compose network, with the service's
    name as ``job``, the label the Grafana dashboard's Job drop-down lists."""
    services = VARIANTS[variant]
    assert {name: body.get("profiles") for name, body in services.items() if body.get("profiles")} == {
        OBSERVABILITY: ["observability"]}
    body = services[OBSERVABILITY]
    mounts = dict(volume.split(":")[:2] for volume in body["volumes"])
    config_file = next(source for source, target in mounts.items() if source.startswith("./"))
    assert f"--config.file={mounts[config_file]}" in body["command"] and body["volumes"][0].endswith(":ro")
    config = yaml.safe_load((ROOT / config_file).read_text())
    (job,) = config["scrape_configs"]
    targets = {target for group in job["static_configs"] for target in group["targets"]}
    expected = set()
    for name, service in services.items():
        if kind := service_kind(service):
            settings = CONFIGS[kind].load([], environ=rlfleet_env(service))
            assert settings.metrics_host == "0.0.0.0" and settings.metrics_port not in (0, settings.port), name
            expected.add(f"{name}:{settings.metrics_port}")
    assert targets == expected
    relabel = job["relabel_configs"][0]
    assert relabel["source_labels"] == ["__address__"] and relabel["target_label"] == "job"
    assert {re.sub(relabel["regex"], "\\1", target) for target in targets} == {
        name for name, service in services.items() if service_kind(service)}


RUNS = merged("compose.yaml", "compose.cpu.yaml", "compose.runs.yaml")
"""Two runs on one fleet (compose.runs.yaml over the CPU variant)."""


@pytest.mark.parametrize("name,body", list(RUNS.items()), ids=list(RUNS))
def test_the_two_run_fleets_services_are_set_up_as_every_other(name, body):
    test_every_service_has_a_healthcheck_or_is_the_one_shot_init("runs", name, body)
    test_env_vars_are_fields_of_that_services_config("runs", name, body)
    test_every_service_serves_mtls_with_role_tokens_from_the_credentials_volume("runs", name, body)


def test_two_runs_share_the_replica_each_with_its_own_collector_store_state_and_credentials():
    def config(name):
        return CONFIGS[service_kind(RUNS[name])].load([], environ=rlfleet_env(RUNS[name]))

    generation = config("generation")
    assert generation.max_runs >= 2 and generation.max_lora_rank
    stores = {}
    for collector, store, run in (("collector", "trajectory", "r0"), ("collector-1", "trajectory-1", "r1")):
        settings = config(collector)
        assert settings.shared_replicas and settings.run_name == config(store).run_name == run
        assert settings.trajectory_address == f"{store}:{config(store).port}"
        assert settings.generation_addresses == ["generation:50051"]
        assert RUNS[collector]["depends_on"][store] == {"condition": "service_healthy"}
        stores[run] = ([v for v in RUNS[store]["volumes"] if v.endswith(":/data")],
                       [v for v in RUNS[collector]["volumes"] if v.endswith(":/data")])
    assert stores["r0"] != stores["r1"] and all(len(a) == len(b) == 1 for a, b in stores.values())
    published = {name: interpolate(body["ports"][0]).split(":")[0] for name, body in RUNS.items()
                 if body.get("ports") and name != OBSERVABILITY}
    assert set(published) == {"collector", "collector-1"} and published["collector"] != published["collector-1"]
    command = RUNS["credentials"]["command"]
    names = {command[i + 1] for i, arg in enumerate(command) if arg == "--name"}
    assert names == {name for name, body in RUNS.items() if service_kind(body)} | {"trainer"}
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--run"] == ["r0", "r1"]
