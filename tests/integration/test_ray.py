"""rlfleet on a local Ray cluster of five nodes (``ray.cluster_utils.Cluster``: one raylet per node, all on
this host), every service a Ray actor hosting the real service process, TLS and role tokens on, and the
trajectory store's and the collector's durable state in PostgreSQL (the session's throwaway server,
``tests/postgres.py``): a service restarted on another node resumes from the database, not a local disk.

Nodes: the head (the trainer task; reward), two "GPU" nodes (custom resource ``gpu_node``: generation
replicas, spread, and reference), a collector node (``collector_node``) and a store node (``store_node``:
trajectory). A removed collector or store node is replaced by a fresh one with the same resources, as an
autoscaler or a node group would (a removed GPU node is not: the other one has room).

One fleet for the module (sync mode, the demo's digits task), in order: the GRPO demo as a Ray task
inside the cluster on one replica; a second replica scaled up at run time (on the other GPU node,
re-synced before it serves); then, with an SDK trainer outside the cluster, the node holding a
generation replica, the collector's and the trajectory store's removed mid-run; scaled down. After
each: every submitted prompt delivered as exactly one whole group, no trajectory in two confirmed
batches, nothing left ready or leased, no dead letter. Last, ``down``: nothing of the fleet is left on
the host (``tests/leftovers.py``): no node directory with its credentials and keys, none of the shared
memory segments its processes held (the vLLM engine SIGKILLed with its node included), none of the
engines' temporary files.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
import pytest
import ray

from rlfleet.client import connect, credentials_from
from rlfleet.client.errors import RlfleetClientError
from rlfleet.ray import Fleet, FleetConfig, FleetError, RunSpec
from rlfleet.services.credentials import make_credentials
from rlfleet.services.launch import free_port
from rlfleet.v1 import generation_pb2, generation_pb2_grpc
from tests.hf_reference import load_hf, peft_model, perturbed
from tests.leftovers import Leftovers, alive
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
GROUP = 4
GROUPS_PER_STEP = 4
DEMO_STEPS = 3
START_TIMEOUT = 600.0
"""A fleet's start on a loaded 2-core machine: two vLLM engines at once, then the collector."""
RECOVERY_TIMEOUT = 180.0
"""A restarted collector or trajectory store (no model to load) back and the trainer's next batch."""
RESYNC_TIMEOUT = 420.0
"""A generation replica restarted on another node: a new actor, its vLLM engine's start, one re-sync push."""
NODES = {"gpu_node": {"num_cpus": 2, "resources": {"gpu_node": 3}},
         "collector_node": {"num_cpus": 1, "resources": {"collector_node": 1}},
         "store_node": {"num_cpus": 1, "resources": {"store_node": 1}}}


def fleet_config(model: Path, workdir: Path, credentials: Path, collector_port: int, database_url: str) -> FleetConfig:
    """The durable state of the trajectory store and the collector in PostgreSQL (``database_url``, one
    schema each): what a service restarted on another node resumes from."""
    sampling = {"temperature": 1.0, "max_tokens": 16}
    return FleetConfig.from_dict({"name": "test", "workdir": str(workdir), "credentials": str(credentials),
                                  "services": {
        "trajectory": {"num_cpus": 0.5, "resources": {"store_node": 1},
                       "settings": {"database_url": database_url}},
        "reference": {"num_cpus": 0.5, "resources": {"gpu_node": 1},
                      "settings": {"model_path": str(model), "torch_threads": 1}},
        "reward": {"num_cpus": 0.5, "settings": {"tokenizer_path": str(model)}},
        "generation": {"replicas": 1, "placement": "spread", "num_cpus": 0.5, "resources": {"gpu_node": 1},
                       "settings": {"model": str(model), "kv_cache_memory_bytes": 128 << 20, "max_model_len": 1024,
                                    "max_num_seqs": 32},
                       # vLLM's worker-process layout, a larger host's: its shared-memory queues (psm_*) and
                       # file store (vllm_dist_*) are what a reaper must clean up after a SIGKILLed engine.
                       "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}},
        "collector": {"num_cpus": 0.5, "resources": {"collector_node": 1}, "port": collector_port,
                      "settings": {"database_url": database_url, "mode": "sync",
                                   "group_size": GROUP, "groups_per_step": GROUPS_PER_STEP,
                                   "reward_fn": "char_fraction", "sampling": sampling,
                                   "discovery_refresh_seconds": 0.5, "replica_check_seconds": 0.5,
                                   "replica_startup_seconds": 5, "grace_seconds": 2}},
    }})


class LocalCluster:
    """The Ray cluster and its nodes by role; ``replace`` removes a node and adds a fresh one like it."""

    def __init__(self):
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        self.nodes = {"gpu_node": [self.add("gpu_node"), self.add("gpu_node")],
                      "collector_node": [self.add("collector_node")], "store_node": [self.add("store_node")]}

    def add(self, role: str):
        return self.cluster.add_node(**NODES[role])

    def node(self, node_id: str):
        return next(node for node in self.cluster.list_all_nodes() if node.node_id == node_id)

    def remove(self, node_id: str, replace: bool) -> None:
        node = self.node(node_id)
        role = next(role for role, nodes in self.nodes.items() if node in nodes)
        self.nodes[role].remove(node)
        self.cluster.remove_node(node)
        if replace:
            self.nodes[role].append(self.add(role))

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def cluster():
    local = LocalCluster()
    ray.init(address=local.cluster.address, namespace="rlfleet", logging_level="WARNING")
    yield local
    local.shutdown()


@pytest.fixture(scope="module")
def credentials(cluster, tmp_path_factory):
    # The certificates hold the nodes' IP: the registry's addresses are node IPs.
    return make_credentials(tmp_path_factory.mktemp("ray-credentials"), hosts=[ray.util.get_node_ip_address()])


@pytest.fixture(scope="module")
def leftovers(cluster):
    """The host's /tmp and /dev/shm before the fleet starts."""
    return Leftovers("test")


@pytest.fixture(scope="module")
def fleet(cluster, leftovers, credentials, tiny_model_dir, tmp_path_factory, postgres):
    config = fleet_config(tiny_model_dir, tmp_path_factory.mktemp("ray-fleet"), credentials, free_port(),
                          postgres.create_database())
    for spec in config.services.values():
        spec.start_timeout_seconds = START_TIMEOUT
    fleet = Fleet.up(config)
    yield fleet
    fleet.down()


def test_fleet_places_services_by_their_resources(fleet, cluster):
    status = fleet.status()
    assert {record["starts"] for record in status.values()} == {1}
    gpu_nodes = {node.node_id for node in cluster.nodes["gpu_node"]}
    assert status["generation-0"]["node_id"] in gpu_nodes and status["reference"]["node_id"] in gpu_nodes
    assert status["collector"]["node_id"] == cluster.nodes["collector_node"][0].node_id
    assert status["trajectory"]["node_id"] == cluster.nodes["store_node"][0].node_id


def test_grpo_demo_runs_as_a_ray_task_inside_the_cluster(fleet, cluster, credentials, tiny_model_dir, tmp_path):
    """examples/ray_train_grpo.py: a driver submits train_grpo.py's loop as a Ray task, which finds the
    collector through the registry and connects with TLS, a client certificate and the trainer's token."""
    out = tmp_path / "demo"
    subprocess.run([sys.executable, str(ROOT / "examples" / "ray_train_grpo.py"), "--fleet", "test",
                    "--ray-address", cluster.cluster.address, "--model-dir", str(tiny_model_dir),
                    "--steps", str(DEMO_STEPS), "--groups-per-step", str(GROUPS_PER_STEP),
                    "--group-size", str(GROUP), "--credentials", str(credentials), "--torch-threads", "1",
                    "--out", str(out)], check=True, timeout=900)
    metrics = json.loads((out / "metrics.json").read_text())
    assert [m["policy_version"] for m in metrics] == [m["version_before"] + 1 for m in metrics]
    assert [m["policy_version"] for m in metrics] == list(range(metrics[0]["policy_version"],
                                                                metrics[0]["policy_version"] + DEMO_STEPS))
    for m in metrics:  # sync mode: each batch sampled by exactly the weights pushed last
        assert m["batch_policy_version_min"] == m["batch_policy_version_max"] == m["version_before"]
        assert m["logprob_mismatch_max"] <= 1e-3 and 0 <= m["reward_mean"] <= 1, m


def test_generation_scales_up_at_run_time_spread_to_another_node(fleet, cluster, trainer):
    """The new replica lands on the GPU node that runs none, joins, is re-synced to the committed
    version before it gets work, and takes its share of the next step."""
    committed = trainer.push()  # the new replica starts at the checkpoint: it must be re-synced to this
    assert fleet.scale("generation", 2, timeout=RESYNC_TIMEOUT) == ["generation-0", "generation-1"]
    replicas = fleet.status_of("generation")
    assert {r["node_id"] for r in replicas.values()} == {node.node_id for node in cluster.nodes["gpu_node"]}
    wait_for(lambda: sorted((r.address, r.healthy, r.policy_version) for r in trainer.client.status().replicas)
             == sorted((record["address"], True, committed) for record in replicas.values()),
             RESYNC_TIMEOUT, "both replicas in rotation at the committed version")
    trainer.submit()
    batch = trainer.read()
    assert set(batch["policy_version_start"].tolist()) == {committed}
    trainer.push()
    trainer.finish()


class Trainer:
    """An SDK trainer outside the cluster, in sync mode: a wave of prompts, one step's batch, a push.
    Records what it was delivered to check, at the end, that nothing was lost or delivered twice."""

    def __init__(self, fleet: Fleet, credentials: Path, weights: dict, name: str):
        self.fleet = fleet
        self.client = connect(fleet.address("collector"), timeout=60, **credentials_from(credentials))
        self.weights = weights
        self.name = name
        self.submitted: list[str] = []
        self.batches = []
        self.stream = self.client.batches(GROUP * GROUPS_PER_STEP, whole_groups=True, idle_timeout=RESYNC_TIMEOUT,
                                          reconnect_seconds=RESYNC_TIMEOUT)
        self.iterator = iter(self.stream.__enter__())
        self.drain()

    def drain(self) -> None:
        """Read and push through what an earlier test left queued (the demo keeps prompts a step ahead):
        in sync mode each step's groups wait for the push after the previous step."""
        while self.client.status().pending_prompts or self.client.buffer_stats().ready:
            next(self.iterator)
            self.push()

    def submit(self) -> None:
        wave = len(self.submitted) // GROUPS_PER_STEP
        self.submitted += self.client.submit_prompts(
            [{"prompt": f"answer in digits: {wave} {i}", "prompt_id": f"{self.name}-{wave}-{i}"}
             for i in range(GROUPS_PER_STEP)])

    def submit_until_busy(self, address: str, what: str, waves: int = 5) -> None:
        """Submit waves until the replica at ``address`` shows samples in flight. A wave can end between two
        polls (16 tokens a sample): it is then read and pushed like any step, and ``finish`` accounts for it."""
        def busy_or_done():
            if any(r.address == address and r.in_flight > 0 for r in self.client.status().replicas):
                return "busy"
            return self.client.buffer_stats().ready >= GROUP * GROUPS_PER_STEP and "done"

        for _ in range(waves):
            self.submit()
            if wait_for(busy_or_done, RECOVERY_TIMEOUT, f"{what} busy, or the wave done") == "busy":
                return
            self.read()
            self.push()
        raise AssertionError(f"{what} never seen with samples in flight in {waves} waves")

    def read(self):
        batch = next(self.iterator)
        self.batches.append(batch)
        return batch

    def push(self) -> int:
        return self.client.push_weights(self.weights, progress=False).version

    def status(self):
        """The collector's status once it serves (None while it restarts, or answers still starting: a push
        would be refused then, UNAVAILABLE)."""
        try:
            status = self.client.status()
        except RlfleetClientError as err:  # the collector restarting
            if err.retryable:
                return None
            raise
        return status if status.serving else None

    def finish(self) -> None:
        """Ack the last batch and check the ledger: each prompt one whole group, no trajectory twice."""
        self.stream.__exit__(None, None, None)
        confirmed = collections.Counter(tid for batch in self.batches if batch.confirmed
                                        for tid in batch["trajectory_id"])
        assert [tid for tid, count in confirmed.items() if count > 1] == []
        groups: dict[str, dict[int, set]] = collections.defaultdict(lambda: collections.defaultdict(set))
        for batch in self.batches:
            if batch.confirmed:  # (the ack of the last batch was answered when the stream closed)
                for pid, gid, tid in zip(batch["prompt_id"], batch["group_id"].tolist(),
                                         batch["trajectory_id"]):
                    groups[pid][gid].add(tid)
        assert set(groups) == set(self.submitted)
        assert all(len(g) == 1 and [len(t) for t in g.values()] == [GROUP] for g in groups.values()), groups
        failures, _ = self.client.failures(limit=100)
        assert [f.prompt_id for f in failures] == []
        wait_for(lambda: (stats := self.client.buffer_stats()).ready == 0 and stats.leased == 0, RECOVERY_TIMEOUT,
                 "the buffer to hold nothing ready or leased")
        self.client.close()


@pytest.fixture
def trainer(fleet, credentials, tiny_model_dir, request):
    trainer = Trainer(fleet, credentials, load_hf(tiny_model_dir).state_dict(), request.node.name[-24:])
    yield trainer
    trainer.client.close()


def test_generation_node_removed_mid_run_replica_restarts_elsewhere_resynced(fleet, cluster, trainer, leftovers):
    status = fleet.status()
    # The replica whose node the reference does not share: only generation moves.
    key, victim = next((key, record) for key, record in fleet.status_of("generation").items()
                       if record["node_id"] != status["reference"]["node_id"])
    trainer.submit_until_busy(victim["address"], key)  # mid-run: the replica has samples in flight
    processes = [victim["pid"], *(child.pid for child in psutil.Process(victim["pid"]).children(recursive=True))]
    leftovers.sample({key: victim})  # its vLLM engine's segments: only the reaper can remove them now
    cluster.remove(victim["node_id"], replace=False)
    wait_for(lambda: not any(alive(pid) for pid in processes), RECOVERY_TIMEOUT,
             "the replica's processes (its vLLM engine's too) gone with its node")
    trainer.read()  # its samples failed over to the other replica
    wait_for(lambda: not {r.address: r.healthy for r in trainer.client.status().replicas}.get(victim["address"]),
             RECOVERY_TIMEOUT, "the lost replica out of rotation")
    committed = trainer.push()  # commits on the survivor alone

    def resynced():
        status = trainer.client.status()
        for replica in status.replicas:  # never in rotation at an older version
            assert not replica.healthy or replica.policy_version == status.policy_version, replica
        moved = fleet.status().get(key)
        return (moved and moved["node_id"] != victim["node_id"]
                and any(r.address == moved["address"] and r.healthy for r in status.replicas) and moved)

    moved = wait_for(resynced, RESYNC_TIMEOUT, f"{key} restarted on another node, re-synced, in rotation")
    assert moved["node_id"] in {node.node_id for node in cluster.nodes["gpu_node"]}
    assert moved["starts"] == victim["starts"] + 1  # counted across actors: the restart shows
    status = trainer.client.status()
    assert status.policy_version == committed and sorted(r.policy_version for r in status.replicas) == [committed] * 2
    trainer.submit()  # the next step is generated by both replicas' new weights
    batch = trainer.read()
    assert set(batch["policy_version_start"].tolist()) == {committed}
    assert trainer.push() == committed + 1
    trainer.finish()


@pytest.mark.parametrize("victim", ["collector", "trajectory"])
def test_node_removed_while_a_batch_is_held_loses_and_duplicates_nothing(fleet, cluster, trainer, victim):
    """The trainer holds a leased, un-acked batch and the next wave is queued when the victim's node goes;
    the victim restarts on the replacement node (the collector from its state directory at the committed
    version, on its fixed port; the trajectory store from its database, at a new address that the
    collector's actor reads from the registry, restarting the collector's process with it)."""
    trainer.submit()
    trainer.read()
    committed = trainer.push()
    trainer.submit()
    held = trainer.read()
    trainer.submit()
    before = fleet.status()[victim]
    collector_pid = fleet.status()["collector"]["pid"]
    cluster.remove(before["node_id"], replace=True)
    wait_for(lambda: not alive(before["pid"]), RECOVERY_TIMEOUT, f"{victim}'s process gone with its node")
    wait_for(lambda: (now := fleet.status().get(victim)) and now["node_id"] != before["node_id"], RECOVERY_TIMEOUT,
             f"{victim} restarted on another node")
    # The collector's process is a new one either way: the victim's, or restarted by its actor with the
    # store's new address (until then the old one serves, and goes mid-call).
    wait_for(lambda: (now := fleet.status().get("collector")) and now["pid"] != collector_pid, RECOVERY_TIMEOUT,
             "the collector's process restarted")
    status = wait_for(trainer.status, RECOVERY_TIMEOUT, "the collector answering")
    assert status.policy_version == committed
    assert fleet.status()[victim]["starts"] == before["starts"] + 1
    again = trainer.read()  # the held batch's ack was lost with the stream: delivered again
    assert again.redelivered and set(again["trajectory_id"]) == set(held["trajectory_id"])
    assert trainer.push() == committed + 1
    trainer.read()
    assert trainer.push() == committed + 2
    trainer.finish()


def test_generation_scales_down_at_run_time(fleet, trainer):
    """The replica leaves the registry before its process stops: the collector drops it, the run goes on."""
    assert fleet.scale("generation", 1) == ["generation-0"]
    wait_for(lambda: [r.address for r in trainer.client.status().replicas] == [fleet.address("generation-0")],
             RECOVERY_TIMEOUT, "the collector down to one replica")
    trainer.submit()
    trainer.read()
    trainer.push()
    trainer.finish()


def test_down_leaves_nothing_of_the_fleet_on_the_host(fleet, leftovers):
    """After a node loss (a vLLM engine SIGKILLed with it: the actor's reaper cleaned up), restarts and
    scaling, ``down``: no node directory (credentials, keys, temporary files), none of the segments the
    fleet's processes held, none of its engines' ``vllm_dist_*`` file stores (those were in the node
    directories while the engines ran: ``TMPDIR``)."""
    leftovers.sample(fleet.status())
    assert leftovers.engine_tmp_files and leftovers.node_directories()
    assert [path for path in leftovers.segments if path.name.startswith("psm_")]
    fleet.down()
    leftovers.assert_none_within(RECOVERY_TIMEOUT)


def shared_fleet_config(model: Path, workdir: Path, credentials: Path) -> FleetConfig:
    """A fleet that runs share (``runs``): one replica serving up to two runs' LoRA adapters, each run a
    collector and a trajectory store of its own, their state apart by ``{key}``."""
    sampling = {"temperature": 1.0, "max_tokens": 12}
    return FleetConfig.from_dict({"name": "shared", "workdir": str(workdir), "credentials": str(credentials),
                                  "runs": {"exp-a": {}}, "services": {
        "trajectory": {"num_cpus": 0.25, "settings": {"db_path": "{workdir}/{key}/trajectories.db"}},
        "reference": {"num_cpus": 0.5, "resources": {"gpu_node": 1},
                      "settings": {"model_path": str(model), "torch_threads": 1}},
        "reward": {"num_cpus": 0.25, "settings": {"tokenizer_path": str(model)}},
        "generation": {"num_cpus": 0.5, "resources": {"gpu_node": 1},
                       "settings": {"model": str(model), "kv_cache_memory_bytes": 128 << 20, "max_model_len": 512,
                                    "max_num_seqs": 32, "max_runs": 2, "max_lora_rank": 8}},
        "collector": {"num_cpus": 0.25, "start_timeout_seconds": START_TIMEOUT,
                      "settings": {"state_dir": "{workdir}/{key}/state", "group_size": 2, "groups_per_step": 2,
                                   "max_staleness": 1000, "mismatch_kl_target": None, "reward_fn": "char_fraction",
                                   "sampling": sampling, "discovery_refresh_seconds": 0.5,
                                   "replica_check_seconds": 0.5}},
    }})


def test_runs_are_added_to_and_ended_on_a_shared_fleet_while_it_serves(cluster, tiny_model_dir, tmp_path):
    """``runs``: run exp-a starts with the fleet; exp-b is added while exp-a trains (``rlfleet-ray runs add``,
    refused until the credentials name it), each at its own versions on the one replica, each run's
    credentials refused by the other's collector; exp-a ended (its collector and store stop, its slot on the
    replica is freed) while exp-b trains on; exp-a added again resumes at its committed version, the
    replica re-synced to its adapter from its collector's spool. Run exp-full, added with a replica of its
    own, trains full weights there: its samples are at its own versions, it never reaches the shared
    replica nor exp-b's collector its replica; ended, its replica goes with it."""
    credentials = make_credentials(tmp_path / "credentials", hosts=[ray.util.get_node_ip_address()],
                                   runs=["exp-a", "exp-full"])
    config = shared_fleet_config(tiny_model_dir, tmp_path / "fleet", credentials)
    for spec in config.services.values():
        spec.start_timeout_seconds = START_TIMEOUT
    fleet = Fleet.up(config)
    try:
        a = connect(fleet.address("collector-exp-a"), run="new", timeout=120,
                    **credentials_from(credentials, run="exp-a"))
        assert a.push_adapter(peft_model(tiny_model_dir, 1), progress=False).version == 1
        assert versions_of_a_step(a) == {1}
        with pytest.raises(FleetError, match="credentials .* hold nothing for run exp-b"):
            fleet.add_run("exp-b")
        subprocess.run([sys.executable, "-m", "rlfleet.services.credentials", str(credentials), "--run", "exp-b"],
                       check=True, timeout=120)
        added = subprocess.run([sys.executable, "-m", "rlfleet.ray.cli", "runs", "add", "exp-b", "--share-weight",
                                "2", "--name", "shared", "--ray-address", cluster.cluster.address],
                               check=True, timeout=START_TIMEOUT, capture_output=True, text=True)
        fleet = Fleet.attach("shared")
        assert added.stdout.split() == ["exp-b", fleet.address("collector-exp-b")]
        assert fleet.runs() == ["exp-a", "exp-b"] and fleet.config.runs["exp-b"].share_weight == 2
        b = connect(fleet.address("collector-exp-b"), run="new", timeout=120,
                    **credentials_from(credentials, run="exp-b"))
        assert b.policy_version == 0  # a run of its own, whatever the replica serves exp-a
        assert b.push_adapter(peft_model(tiny_model_dir, 2), progress=False).version == 1
        assert a.push_adapter(peft_model(tiny_model_dir, 3), progress=False).version == 2
        assert versions_of_a_step(a) == {2} and versions_of_a_step(b) == {1}
        with connect(fleet.address("collector-exp-b"), timeout=60,
                     **credentials_from(credentials, run="exp-a")) as intruder:
            with pytest.raises(RlfleetClientError, match="acts for run exp-a; this service serves run exp-b"):
                intruder.status()
        replica = fleet.address("generation-0")
        assert served_names(replica, credentials) == {"exp-a": 2, "exp-b": 1}
        run_a = a.run.run_id
        a.close()

        assert fleet.end_run("exp-a") == {"generation-0": 0}
        assert fleet.runs() == ["exp-b"] and not {"collector-exp-a", "trajectory-exp-a"} & set(fleet.status())
        assert served_names(replica, credentials) == {"exp-b": 1}  # its slot freed
        assert b.push_adapter(peft_model(tiny_model_dir, 4), progress=False).version == 2
        assert versions_of_a_step(b) == {2}

        fleet.add_run("exp-a")  # its state kept: the run resumes
        a = connect(fleet.address("collector-exp-a"), run=f"{run_a}@2", timeout=120,
                    **credentials_from(credentials, run="exp-a"))
        joined = a.join()
        assert (joined.run_id, joined.version, joined.resumed, joined.name) == (run_a, 2, True, "exp-a")
        wait_for(lambda: served_names(replica, credentials).get("exp-a") == 2, RESYNC_TIMEOUT,
                 "exp-a's adapter re-synced to the replica at its committed version")
        assert versions_of_a_step(a) == {2} and versions_of_a_step(b) == {2}

        assert fleet.add_run("exp-full", RunSpec(replicas=1)) == [
            "trajectory-exp-full", "generation-exp-full-0", "collector-exp-full"]
        full = connect(fleet.address("collector-exp-full"), run="new", timeout=120,
                       **credentials_from(credentials, run="exp-full"))
        own = fleet.address("generation-exp-full-0")
        assert fleet.status()["generation-exp-full-0"]["service"] == "generation@exp-full"
        weights = perturbed(load_hf(tiny_model_dir).state_dict(), 5)
        assert full.push_weights(weights, progress=False).version == 1  # full weights: on its own replica
        assert [r.address for r in full.status().replicas] == [own]
        assert own not in [r.address for r in b.status().replicas]
        assert versions_of_a_step(full) == {1}
        assert served_names(replica, credentials) == {"exp-a": 2, "exp-b": 2}  # the shared replica: no slot taken
        full.close()
        fleet.end_run("exp-full")
        assert not {key for key in fleet.status() if "exp-full" in key}
        a.close()
        b.close()
    finally:
        fleet.down()
    assert fleet.status() == {}


def versions_of_a_step(client) -> set[int]:
    """One step's prompts submitted and its batch read: the versions its samples were generated at."""
    client.submit_prompts([{"prompt": "answer in digits: 7"} for _ in range(2)])
    with client.batches(4, whole_groups=True, idle_timeout=RECOVERY_TIMEOUT) as stream:
        batch = next(iter(stream))
    return set(batch["policy_version_start"].tolist()) | set(batch["policy_version_end"].tolist())


def served_names(replica: str, credentials: Path) -> dict[str, int]:
    """The named runs the replica at ``replica`` serves and their versions (asked as an operator)."""
    tls = grpc.ssl_channel_credentials(*((credentials / name).read_bytes()
                                         for name in ("ca.pem", "trainer.key", "trainer.pem")))
    token = (credentials / "token-operator").read_text().strip()
    with grpc.secure_channel(replica, grpc.composite_channel_credentials(
            tls, grpc.access_token_call_credentials(token))) as channel:
        status = generation_pb2_grpc.GenerationServiceStub(channel).GetEngineStatus(
            generation_pb2.GetEngineStatusRequest(), timeout=60)
    return {run.name: run.policy_version for run in status.runs}
