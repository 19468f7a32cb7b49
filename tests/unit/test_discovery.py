"""Replica discovery (services/collector/discovery.py) and the pool's membership and load (replicas.py).

A fake resolver stands in for DNS here (the logic above it is what is tested); the real replicas
joining and leaving a run are in tests/integration/test_collector.py."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest

from rlfleet.client.channel import ChannelSettings
from rlfleet.services.collector.discovery import AddressFile, Dns, Endpoint, StaticList, make_discovery
from rlfleet.services.collector.replicas import ReplicaPool


def run(coroutine):
    return asyncio.run(coroutine)


def test_static_list_is_the_addresses_once_each():
    assert run(StaticList(["a:1", "b:2", "a:1"]).endpoints()) == [Endpoint("a:1"), Endpoint("b:2")]


def test_address_file_is_reread_and_a_bad_one_keeps_the_last_list(tmp_path, caplog):
    path = tmp_path / "replicas.json"
    source = AddressFile(path)
    caplog.set_level(logging.WARNING, "rlfleet.collector.discovery")
    assert run(source.endpoints()) == []  # missing: nothing known yet
    path.write_text(json.dumps(["10.0.0.1:50051", "10.0.0.2:50051"]))
    assert [e.address for e in run(source.endpoints())] == ["10.0.0.1:50051", "10.0.0.2:50051"]
    path.write_text(json.dumps(["10.0.0.2:50051"]))
    assert [e.address for e in run(source.endpoints())] == ["10.0.0.2:50051"]
    caplog.clear()
    for bad in ('{"not": "a list"}', "[1, 2]", "not json", '["no-port"]'):
        path.write_text(bad)
        assert [e.address for e in run(source.endpoints())] == ["10.0.0.2:50051"], bad
    # The first two share a problem: logged once; each change of problem is logged.
    assert len(caplog.records) == 3 and "keeping the last 1 replicas" in caplog.records[0].getMessage()
    run(source.endpoints())  # the same problem again: not logged again
    assert len(caplog.records) == 3


class FakeResolver:
    def __init__(self, answers):
        self.answers = answers

    async def getaddrinfo(self, host, port, type=0):
        answer = self.answers[host]
        if isinstance(answer, Exception):
            raise answer
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, type, 6, "", (ip, port)) for ip in answer]


def resolve(monkeypatch, answers, source):
    async def scenario():
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(loop, "getaddrinfo", FakeResolver(answers).getaddrinfo)
        return await source.endpoints()
    return run(scenario())


def test_dns_makes_one_replica_per_ip_checked_against_the_name(monkeypatch):
    source = Dns(StaticList(["generation:50051", "127.0.0.1:7", "localhost:8", "[::1]:9"]))
    got = resolve(monkeypatch, {"generation": ["10.0.0.2", "10.0.0.1", "fd00::5"]}, source)
    assert got == [Endpoint("10.0.0.1:50051", "generation"), Endpoint("10.0.0.2:50051", "generation"),
                   Endpoint("[fd00::5]:50051", "generation"), Endpoint("127.0.0.1:7"), Endpoint("localhost:8"),
                   Endpoint("[::1]:9")]


def test_dns_keeps_a_names_last_answer_when_a_lookup_fails(monkeypatch):
    source = Dns(StaticList(["generation:50051", "never:1"]))
    first = resolve(monkeypatch, {"generation": ["10.0.0.1"], "never": socket.gaierror("no such name")}, source)
    assert first == [Endpoint("10.0.0.1:50051", "generation"), Endpoint("never:1")]  # gRPC may resolve it later
    again = resolve(monkeypatch, {"generation": socket.gaierror("blip"), "never": socket.gaierror("x")}, source)
    assert again == first
    scaled = resolve(monkeypatch, {"generation": ["10.0.0.1", "10.0.0.3"], "never": socket.gaierror("x")}, source)
    assert [e.address for e in scaled] == ["10.0.0.1:50051", "10.0.0.3:50051", "never:1"]


def test_make_discovery_picks_the_file_over_the_list_and_resolves_unless_told_not_to(tmp_path):
    assert isinstance(make_discovery(["a:1"], None, False), StaticList)
    assert isinstance(make_discovery(["a:1"], str(tmp_path / "f"), False), AddressFile)
    dns = make_discovery(["a:1"], str(tmp_path / "f"), True)
    assert isinstance(dns, Dns) and isinstance(dns.names, AddressFile)


def test_pool_membership_new_replicas_wait_out_of_rotation_and_gone_ones_close_when_idle():
    async def scenario():
        pool = ReplicaPool(ChannelSettings(tls=True))
        added, removed = await pool.update([Endpoint("127.0.0.1:1"), Endpoint("10.0.0.9:2", "generation")])
        assert [r.address for r in added] == ["127.0.0.1:1", "10.0.0.9:2"] and removed == []
        assert not any(r.healthy for r in pool.replicas)  # the replica monitor re-syncs them first
        first, second = pool.replicas
        for replica in pool.replicas:
            await pool.mark_healthy(replica, 3)
        busy = await pool.acquire(prefer=second, samples=4)
        assert busy is second and second.in_flight == 4
        added, removed = await pool.update([Endpoint("127.0.0.1:1")])
        assert added == [] and removed == [second] and second.gone and not second.healthy
        assert pool.replicas == [first] and pool.healthy() == [first]
        assert second.channel.get_state() is not None  # still open: 4 samples in flight there
        pool.release(second, 4)
        await pool.settled()
        assert second.in_flight == 0
        # Back again later: a new member (new channel), re-synced like any other.
        added, _ = await pool.update([Endpoint("127.0.0.1:1"), Endpoint("10.0.0.9:2", "generation")])
        assert added[0] is not second and not added[0].healthy
        await pool.close()
    run(scenario())


def test_a_resolved_replicas_channel_checks_the_certificate_against_the_name():
    async def scenario():
        pool = ReplicaPool(ChannelSettings(tls=True))
        options = []
        import rlfleet.services.collector.replicas as replicas_module

        real = replicas_module.aio_channel

        def spy(address, settings):
            options.append((address, settings.server_name))
            return real(address, settings)
        replicas_module.aio_channel = spy
        try:
            await pool.update([Endpoint("10.0.0.9:2", "generation"), Endpoint("reference:3")])
        finally:
            replicas_module.aio_channel = real
        assert options == [("10.0.0.9:2", "generation"), ("reference:3", None)]
        await pool.close()
    run(scenario())


@pytest.mark.parametrize("loads, samples, expected", [
    ({"a": 16, "b": 3}, 4, "b"),  # one group of 16 outweighs three single samples
    ({"a": 2, "b": 3}, 16, "a"),
])
def test_work_goes_to_the_replica_with_the_fewest_samples_outstanding(loads, samples, expected):
    async def scenario():
        pool = ReplicaPool(ChannelSettings())
        await pool.update([Endpoint(f"{name}:1") for name in loads])
        for replica in pool.replicas:
            await pool.mark_healthy(replica, 0)
            replica.in_flight = loads[replica.address[0]]
        chosen = await pool.acquire(samples=samples)
        assert chosen.address == f"{expected}:1" and chosen.in_flight == loads[expected] + samples
        pool.release(chosen, samples)
        assert chosen.in_flight == loads[expected]
        await pool.close()
    run(scenario())


def test_trainer_wait_counts_only_the_time_a_stream_holds_no_unsettled_batch(monkeypatch):
    """The autoscaling signal: a trainer training on a batch is not waiting; one that settled all it got is."""
    from rlfleet.services.collector import metrics, servicer

    clock = [100.0]
    monkeypatch.setattr(servicer.time, "monotonic", lambda: clock[0])
    total = lambda: metrics.TRAINER_WAIT_SECONDS._value.get()  # noqa: E731
    before = total()
    wait = servicer.TrainerWait()  # opened at t=100: waits for its first batch
    clock[0] = 103.0
    wait.deliver()  # 3 s waited
    clock[0] = 104.0
    wait.deliver()  # prefetched while the first is being trained on: no wait
    clock[0] = 110.0
    wait.settle()  # the first acked, the second still held: training, not waiting
    clock[0] = 115.0
    wait.settle()  # everything settled: from now it waits
    clock[0] = 117.5
    wait.deliver()  # 2.5 s
    wait.settle()
    clock[0] = 118.0
    wait.end()  # stream closed while waiting: 0.5 s
    assert total() - before == pytest.approx(3.0 + 2.5 + 0.5)


def test_idle_replicas_take_work_in_turn():
    """Ties are taken in turn: with fast replicas most are idle at any instant, and the first of the
    list would otherwise get all the work."""
    async def scenario():
        pool = ReplicaPool(ChannelSettings())
        await pool.update([Endpoint(f"10.0.0.{i}:1") for i in range(4)])
        for replica in pool.replicas:
            await pool.mark_healthy(replica, 0)
        chosen = []
        for _ in range(8):
            replica = await pool.acquire(samples=4)
            chosen.append(replica.address)
            pool.release(replica, 4)  # done at once: every replica idle again
        assert sorted(chosen) == sorted(f"10.0.0.{i}:1" for i in range(4) for _ in range(2))
        await pool.close()
    run(scenario())


class FakeGcs:
    """Ray's GCS client as the registry uses it: a key-value store and the nodes' states (a fake: the
    registry's reading above it is what is tested; tests/integration/test_ray.py runs the real one)."""

    def __init__(self):
        self.kv: dict[bytes, bytes] = {}
        self.nodes: dict[str, int] = {}
        self.fail = False

    def internal_kv_put(self, key, value, overwrite, namespace):
        self.kv[key] = value

    def internal_kv_del(self, key, by_prefix, namespace):
        for stored in [k for k in self.kv if (k.startswith(key) if by_prefix else k == key)]:
            del self.kv[stored]

    def internal_kv_keys(self, prefix, namespace):
        if self.fail:
            raise ConnectionError("GCS unreachable")
        return [k for k in self.kv if k.startswith(prefix)]

    def internal_kv_multi_get(self, keys, namespace):
        return {k: self.kv[k] for k in keys if k in self.kv}

    def get_all_node_info(self):
        return {bytes.fromhex(node): type("Info", (), {"state": state}) for node, state in self.nodes.items()}


def fake_registry(fleet="f", gcs=None):
    from rlfleet.registry import Registry

    return Registry("10.0.0.9:6379", fleet, gcs=gcs or FakeGcs())


def test_ray_discovery_lists_the_fleets_replicas_until_they_republish_and_keeps_the_last_answer(caplog):
    from rlfleet.services.collector.discovery import RayDiscovery

    gcs = FakeGcs()
    registry = fake_registry(gcs=gcs)
    gcs.nodes = {"aa": 0, "bb": 0}
    for key, address, node in [("generation-10", "10.0.0.3:1", "bb"), ("generation-9", "10.0.0.2:1", "aa"),
                               ("reference", "10.0.0.4:1", "aa")]:
        registry.publish(key, {"service": key.split("-")[0], "address": address, "node_id": node})
    fake_registry("other").publish("generation-0", {"service": "generation", "address": "x:1", "node_id": "aa"})
    source = RayDiscovery("10.0.0.9:6379", "f", registry=registry)
    assert [e.address for e in run(source.endpoints())] == ["10.0.0.2:1", "10.0.0.3:1"]  # 9 before 10
    gcs.nodes["bb"] = 1  # DEAD: its replica stays listed (out of rotation) until it restarts elsewhere
    assert [e.address for e in run(source.endpoints())] == ["10.0.0.2:1", "10.0.0.3:1"]
    assert list(registry.services("generation")) == ["generation-9"]  # what Fleet.status shows: live nodes
    registry.publish("generation-10", {"service": "generation", "address": "10.0.0.2:2", "node_id": "aa"})
    assert [e.address for e in run(source.endpoints())] == ["10.0.0.2:1", "10.0.0.2:2"]  # restarted on aa
    caplog.set_level(logging.WARNING, "rlfleet.collector.discovery")
    gcs.fail = True
    assert [e.address for e in run(source.endpoints())] == ["10.0.0.2:1", "10.0.0.2:2"]
    assert "unreadable" in caplog.text and "keeping the last 2 replicas" in caplog.text
    gcs.fail = False
    registry.withdraw("generation-9")  # scaled down
    assert [e.address for e in run(source.endpoints())] == ["10.0.0.2:2"]


def test_a_run_that_holds_replicas_alone_finds_those_and_the_shared_ones_stay_apart():
    """A run that trains full weights on a fleet that runs share: its replicas are registered as
    ``generation@RUN``; its collector (``ray+gcs://.../FLEET/RUN``) finds them alone, the others none of them."""
    from rlfleet.services.collector.discovery import RayDiscovery

    gcs = FakeGcs()
    registry = fake_registry(gcs=gcs)
    gcs.nodes = {"aa": 0}
    registry.publish("generation-0", {"service": "generation", "address": "10.0.0.2:1", "node_id": "aa"})
    registry.publish("generation-exp-c-0", {"service": "generation@exp-c", "address": "10.0.0.3:1", "node_id": "aa"})
    own = RayDiscovery.from_url("ray+gcs://10.0.0.9:6379/f/exp-c")
    own.registry = registry
    shared = RayDiscovery.from_url("ray+gcs://10.0.0.9:6379/f")
    shared.registry = registry
    assert [e.address for e in run(own.endpoints())] == ["10.0.0.3:1"] and "generation@exp-c" in own.describe()
    assert [e.address for e in run(shared.endpoints())] == ["10.0.0.2:1"]


def test_a_ray_registry_url_is_the_only_source_and_is_checked_at_start():
    from rlfleet.services.collector.config import CollectorConfig
    from rlfleet.services.collector.discovery import RayDiscovery, parse_ray_url

    assert parse_ray_url("ray+gcs://10.0.0.9:6379/fleet") == ("10.0.0.9:6379", "fleet", None)
    assert parse_ray_url("ray+gcs://10.0.0.9:6379/fleet/exp-c") == ("10.0.0.9:6379", "fleet", "exp-c")
    for bad in ("ray+gcs://10.0.0.9/fleet", "ray+gcs://10.0.0.9:6379", "ray+gcs://h:1/a/b/c", "ray+gcs://h:1/a/",
                "ray://h:1/f"):
        with pytest.raises(ValueError):
            parse_ray_url(bad)
    source = make_discovery(["ray+gcs://10.0.0.9:6379/fleet"], None, True)
    assert isinstance(source, RayDiscovery) and "fleet 'fleet'" in source.describe()
    assert CollectorConfig(generation_addresses=["ray+gcs://h:1/f"]).generation_addresses == ["ray+gcs://h:1/f"]
    for addresses in (["ray+gcs://h:1/f", "a:1"], ["ray+gcs://h/f"]):
        with pytest.raises(ValueError, match="generation_addresses|GCS_HOST"):
            CollectorConfig(generation_addresses=addresses)
