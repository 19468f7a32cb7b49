"""``RlfleetRayLLMCollector``'s method semantics over a stand-in rlfleet client (and, for the actor
path, a stand-in for Ray that runs the actor's object in-process): what is tested is the logic above
the transports. The real actor, the real services and TorchRL's replay buffer are in
tests/integration/test_torchrl.py."""

from __future__ import annotations

import pickle
import queue
import threading
import time
import warnings

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict

from rlfleet.client.torchrl import IgnoredArgumentWarning, RlfleetRayLLMCollector, RlfleetWeightSyncScheme
from rlfleet.client.torchrl import ray_collector
from tests.torchrl_batches import FakeBatch, Pushed, ragged_batch
from tests.waiting import wait_for

BATCH = 6  # 2 groups of 3


@pytest.fixture(scope="module")
def ragged():
    return ragged_batch(groups=2, group_size=3)


class FakeStream:
    """A batch stream whose next batch waits on a queue, as a real one waits on the collector."""

    def __init__(self, source: queue.Queue):
        self.source = source
        self.closed = False
        self._stream = self  # the BatchIterator's inner stream: abandon() is its thread-safe close
        self.acked_on_close = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __iter__(self):
        return self

    def __next__(self):
        while not self.closed:
            try:
                batch = self.source.get(timeout=0.01)
            except queue.Empty:
                continue
            if batch is None:
                break
            return batch
        raise StopIteration

    def close(self):
        if not self.closed:
            self.closed, self.acked_on_close = True, True

    def abandon(self):
        if not self.closed:
            self.closed, self.acked_on_close = True, False


class FakeClient:
    def __init__(self, batches=()):
        self.version = 0
        self.pushes: list[set[str]] = []
        self.source: queue.Queue = queue.Queue()
        for batch in batches:
            self.source.put(batch)
        self.streams: list[FakeStream] = []
        self.closed = False

    def push_weights(self, weights, *, mode, transport, strategy, progress):
        self.pushes.append(set(weights))
        self.version += 1
        return Pushed(self.version)

    @property
    def policy_version(self):
        return self.version

    def status(self):
        return type("Status", (), {"group_size": 3})()

    def submit_prompts(self, specs):
        return [str(i) for i, _ in enumerate(specs)]

    def batches(self, batch_size, **options):
        self.streams.append(FakeStream(self.source))
        return self.streams[-1]

    def close(self):
        self.closed = True


class Buffer:
    def __init__(self):
        self.extended = []

    @property
    def write_count(self):
        return sum(len(data) for data in self.extended)

    def extend(self, data):
        self.extended.append(data)


def local(client, **kwargs):
    return RlfleetRayLLMCollector(client, dialog_turns_per_batch=BATCH, **{"backend": "local", **kwargs})


def test_iteration_yields_torchrl_batches_until_the_total_then_next_gives_none(ragged):
    client = FakeClient([FakeBatch(ragged)] * 3)
    seen = []
    collector = local(client, total_dialog_turns=2 * BATCH, postproc=lambda td: seen.append(len(td)) or td)
    batches = list(collector)
    assert [type(b) for b in batches] == [LazyStackedTensorDict] * 2 and seen == [BATCH, BATCH]
    assert batches[0].get("advantage", as_padded_tensor=True).shape == (BATCH, 1, 1)
    assert collector.next() is None  # TorchRL's Collector.next() at the end
    with pytest.raises(RuntimeError, match="Postproc already set"):
        collector.set_postproc(lambda td: td)
    assert collector.total_dialog_turns == 2 * BATCH and collector.dialog_turns_per_batch == BATCH
    assert collector.rollout() is None and collector.init_random_frames == 0
    collector.shutdown()
    assert client.streams[0].acked_on_close  # ended between batches: the last one acknowledged


def test_next_with_a_replay_buffer_extends_it_and_returns_none(ragged):
    buffer = Buffer()
    collector = local(FakeClient([FakeBatch(ragged)] * 2), replay_buffer=buffer)
    assert collector.next() is None and collector.next() is None
    assert collector.getattr_rb("write_count") == 2 * BATCH
    collector.shutdown()


def test_start_fills_the_buffer_in_the_background_until_the_total(ragged):
    with pytest.raises(RuntimeError, match="Replay buffer must be defined"):
        local(FakeClient()).start()
    buffer = Buffer()
    client = FakeClient([FakeBatch(ragged)] * 5)
    collector = local(client, replay_buffer=buffer, total_dialog_turns=3 * BATCH)
    collector.start()
    collector.start()  # already running: nothing more
    wait_for(lambda: not collector.is_running(), 10, "the filling thread to stop at total_dialog_turns")
    assert buffer.write_count == 3 * BATCH and len(client.streams) == 1
    collector.shutdown()
    collector.shutdown()  # idempotent


def test_shutdown_ends_a_background_wait_for_a_batch_that_does_not_come(ragged):
    buffer = Buffer()
    client = FakeClient([FakeBatch(ragged)])  # then nothing: a sync collector waiting for a push
    collector = local(client, replay_buffer=buffer)
    collector.start()
    wait_for(lambda: buffer.write_count == BATCH, 10, "the first batch in the buffer")
    with pytest.raises(RuntimeError, match="filling the replay buffer"):
        collector.next()
    started = time.monotonic()
    collector.shutdown()
    assert time.monotonic() - started < 5 and not collector._core.is_running()
    assert client.streams[0].acked_on_close is False  # abandoned mid-wait (the batch before was acked)


def test_async_shutdown_lets_the_batch_under_way_land(ragged):
    buffer = Buffer()
    client = FakeClient([FakeBatch(ragged)])
    collector = local(client, replay_buffer=buffer)
    collector.start()
    wait_for(lambda: buffer.write_count == BATCH, 10, "the first batch in the buffer")
    threading.Timer(0.2, client.source.put, [FakeBatch(ragged)]).start()
    collector.async_shutdown(timeout=5)
    assert buffer.write_count == 2 * BATCH and client.streams[0].acked_on_close is True


def test_a_failure_while_filling_is_raised_by_is_running(ragged):
    def broken(td):
        raise KeyError("postproc broke")

    collector = local(FakeClient([FakeBatch(ragged)]), replay_buffer=Buffer(), postproc=broken)
    collector.start()
    with pytest.raises(KeyError, match="postproc broke"):
        wait_for(lambda: not collector.is_running(), 10, "the filling thread to fail")
    assert collector.is_running() is False
    collector.shutdown()


def test_weights_are_pushed_from_this_process_and_versions_count_once():
    client = FakeClient()
    policy = torch.nn.Linear(2, 2)
    collector = local(client, policy=policy)
    assert collector.update_policy_weights_() == 1 == collector.policy_version == collector.get_policy_version()
    assert client.pushes == [{"weight", "bias"}]
    assert collector.update_policy_weights_(policy_weights={"w": torch.zeros(1)}) == 2
    with pytest.raises(ValueError, match="worker_ids"):
        collector.update_policy_weights_(worker_ids=[0])
    sender = RlfleetWeightSyncScheme(collector).create_sender()  # the recipe's sender, wired as it wires it
    sender.register_model(policy)
    sender.register_collector(collector)
    assert sender.update_weights() == 3 == collector.last_push.version
    assert collector.increment_version() == 3  # nothing unacknowledged: the version stays
    assert collector.weight_updater is None
    collector.weight_updater = None
    collector.init_updater("anything", at=1)
    with pytest.raises(ValueError, match="weight_updater"):
        collector.weight_updater = object()
    collector.shutdown()


def test_torchrl_arguments_are_ignored_with_one_warning_or_refused(monkeypatch):
    monkeypatch.setattr(ray_collector, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        local(FakeClient(), yield_only_last_steps=True, yield_completed_trajectories=None, flatten_data=True,
              sync_iter=False, track_policy_version=True).shutdown()  # what rlfleet does anyway: silent
        assert not [w for w in caught if w.category is IgnoredArgumentWarning]
        for _ in range(2):
            local(FakeClient(), env=object(), policy_factory=lambda: None, yield_only_last_steps=False,
                  async_envs=True, reset_at_each_iter=True, verbose=True, num_cpus=2, remote_config={}).shutdown()
    ignored = [str(w.message).split(":")[0].split()[-1] for w in caught if w.category is IgnoredArgumentWarning]
    assert ignored == ["env", "policy_factory", "yield_only_last_steps", "async_envs", "reset_at_each_iter",
                       "verbose", "remote_config", "num_cpus"]  # once each, however many collectors
    with pytest.raises(ValueError, match="weight_updater"):
        local(FakeClient(), weight_updater=object())
    with pytest.raises(ValueError, match="track_policy_version"):
        local(FakeClient(), track_policy_version=object())  # e.g. TorchRL's PolicyVersion transform
    with pytest.raises(ValueError, match="backend"):
        local(FakeClient(), backend="mpi")


class FakeRay:
    """Ray's calls as the collector makes them, run in this process (futures resolved at get)."""

    def __init__(self):
        self.options = None
        self.calls: list[str] = []
        self.killed = False

    def remote(self, **options):
        self.options = options
        fake = self

        def decorate(cls):
            class Handle:
                def __init__(self, obj):
                    self.obj = obj

                def __getattr__(self, name):
                    method = getattr(self.obj, name)

                    class Remote:
                        @staticmethod
                        def remote(*args, **kwargs):
                            fake.calls.append(name)
                            return lambda: method(*args, **kwargs)
                    return Remote

            class Actor:
                @staticmethod
                def remote(*args, **kwargs):  # what reaches the actor is pickled, as with Ray
                    return Handle(cls(*pickle.loads(pickle.dumps(args)), **kwargs))
            return Actor
        return decorate

    def get(self, future):
        return future()

    def is_initialized(self):
        return True

    def kill(self, actor):
        self.killed = True


def test_the_actor_path_keeps_one_batch_requested_ahead_without_sync_iter(monkeypatch, ragged):
    fake = FakeRay()
    client = FakeClient([FakeBatch(ragged)] * 3)
    monkeypatch.setattr(ray_collector, "use_ray", lambda backend, init: fake)
    monkeypatch.setattr(ray_collector, "RlfleetLLMCollector", _sharing(client))
    class Primer:  # as TorchRL's DataLoadingPrimer: holds an iterator over its loader, so it does not pickle
        dataloader = [{"query": [f"q{i}" for i in range(2)]}]
        repeats = 3
        _iterator = (row for row in dataloader)

    collector = RlfleetRayLLMCollector("collector:50050", dialog_turns_per_batch=BATCH, total_dialog_turns=2 * BATCH,
                                       sync_iter=False, num_cpus=2, remote_config={"num_gpus": 0}, prompts=Primer())
    assert fake.options == {"num_cpus": 2, "num_gpus": 0, "max_concurrency": 2}
    assert collector._collector is collector._actor and fake.calls == ["is_initialized"]
    iterator = iter(collector)
    next(iterator)
    assert fake.calls[1:] == ["next_batch", "next_batch"]  # the second requested before the first is used
    assert len(list(iterator)) == 1
    assert collector._actor.obj.collector._repeats == 3  # the primer's loader and repeats reached the actor
    collector.shutdown()
    assert fake.calls[-1] == "shutdown" and fake.killed


def test_the_actor_path_refuses_what_it_cannot_share(monkeypatch):
    monkeypatch.setattr(ray_collector, "use_ray", lambda backend, init: FakeRay())
    monkeypatch.setattr(ray_collector, "RlfleetLLMCollector", _sharing(FakeClient()))
    with pytest.raises(ValueError, match="lives in this process"):
        RlfleetRayLLMCollector("collector:50050", dialog_turns_per_batch=BATCH, replay_buffer=Buffer())
    with pytest.raises(ValueError, match="pass the collector's address"):
        RlfleetRayLLMCollector(FakeClient(), dialog_turns_per_batch=BATCH)

    class RayReplayBuffer:  # TorchRL's does not pickle: its client() goes to the actor
        def client(self):
            return "picklable client"
    RayReplayBuffer.__module__ = "torchrl.data.replay_buffers.ray_buffer"
    assert ray_collector.shared_buffer(RayReplayBuffer()) == "picklable client"


def test_auto_runs_in_process_unless_ray_is_initialized():
    assert ray_collector.use_ray("local", {"num_cpus": 1}) is None
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        assert ray_collector.use_ray("auto", None) is None


def _sharing(client):
    """``RlfleetLLMCollector`` built over ``client`` whatever address it is given."""
    real = ray_collector.RlfleetLLMCollector

    def make(address_or_client, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ray_collector.CONNECT_ARGS}
        return real(client, **kwargs)
    return make
