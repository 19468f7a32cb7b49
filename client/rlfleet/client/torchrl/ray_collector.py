"""``RlfleetRayLLMCollector``: TorchRL 0.14's ``RayLLMCollector`` surface over an rlfleet deployment.

A TorchRL recipe written for Ray (``sota-implementations/grpo/grpo-async.py``) switches to rlfleet
by swapping the collector (and the weight-sync scheme for ``RlfleetWeightSyncScheme``).

Two sides, each an ``RlfleetLLMCollector`` (no batching code of its own here):

- the batch side streams batches, feeds prompts and fills the replay buffer. With Ray importable and
  initialized it runs in a Ray actor, as TorchRL's does (the trainer calls it through Ray; the actor
  talks gRPC to the rlfleet collector service); otherwise in this process, with the same methods.
- the weight side pushes weights and reads versions, always in the trainer's process: the weights
  are there, and a push from there can take shared memory or NCCL instead of a trip through Ray's
  object store to an actor that only forwards them.

TorchRL's arguments that describe what rlfleet's services do (env, policy factory, ...) are
accepted and ignored with a one-time ``IgnoredArgumentWarning``, given a value other than
TorchRL's default; the two whose effect rlfleet cannot give (a TorchRL weight updater, a
``PolicyVersion`` tracker) are refused with a ``ValueError``. docs/guides/torchrl.md has the table.
"""

from __future__ import annotations

import inspect
import logging
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping

from tensordict import TensorDictBase

from rlfleet.rpc.records import PushResult
from rlfleet.client.sync import Client, connect
from rlfleet.client.torchrl.collector import RlfleetLLMCollector

log = logging.getLogger("rlfleet.client.torchrl")
BACKENDS = ("auto", "ray", "local")
STOP_GRACE_SECONDS = 1.0
"""How long ``shutdown()`` lets a batch under way land (and be acknowledged) before it ends the stream."""
JOIN_SECONDS = 10.0
"""How long ``shutdown()`` waits for the filling thread once its stream is ended."""
DEFAULT_REMOTE_CONFIG = {"num_cpus": 1}
"""The actor's Ray options before ``num_cpus``/``num_gpus``/``remote_config`` (it only speaks gRPC)."""

IGNORED = {
    "env": ((None,), "rlfleet's services generate and score: prompts come from prompts=, rewards from "
                     "reward_fn= or the collector's configuration"),
    "policy_factory": ((None,), "generation runs on rlfleet's engines"),
    "yield_only_last_steps": ((None, True), "every sample is one whole episode (its last step holding the "
                                            "whole dialog): the same as TorchRL's for single-turn tasks"),
    "yield_completed_trajectories": ((None, True), "batches are always whole episodes"),
    "async_envs": ((None,), "rlfleet's engines batch requests continuously"),
    "reset_at_each_iter": ((False,), "there is no environment to reset: episodes start from prompts"),
    "flatten_data": ((None, True), "batches are always flat (a lazy stack of samples)"),
    "verbose": ((False,), "progress is in the collector's status and metrics"),
}
"""TorchRL's arguments with no effect here: (values that mean what rlfleet does anyway, why)."""
RAY_ONLY = ("ray_init_config", "remote_config", "num_cpus", "num_gpus")
CONNECT_ARGS = frozenset(inspect.signature(connect).parameters) - {"address"}
_warned: set[str] = set()


class IgnoredArgumentWarning(UserWarning):
    """A TorchRL argument with no effect on rlfleet (warned once per process and argument)."""


def warn_ignored(name: str, reason: str) -> None:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"RlfleetRayLLMCollector ignores {name}: {reason}", IgnoredArgumentWarning, stacklevel=3)


class CollectorCore:
    """The batch side: ``next_batch()`` on demand, or ``start()`` filling the replay buffer in a thread.

    The object a Ray actor hosts (or the collector holds in-process); its methods are what the
    trainer calls through Ray.
    """

    def __init__(self, address_or_client: str | Client, options: Mapping[str, Any]):
        self.collector = RlfleetLLMCollector(address_or_client, **options)
        self._iterator: Iterator | None = None
        self._next_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._closed = False

    def is_initialized(self) -> bool:
        return True

    def set_postproc(self, postproc: Callable[[TensorDictBase], TensorDictBase]) -> None:
        self.collector.set_postproc(postproc)

    def next_batch(self) -> tuple[TensorDictBase | None, bool]:
        """(the next batch, or None when a replay buffer took it; whether the collection has ended)."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("the collector is filling the replay buffer (start()): sample the buffer, "
                               "or shutdown() first")
        with self._next_lock:
            if self._closed:
                return None, True
            if self._iterator is None:
                self._iterator = iter(self.collector)
            try:
                return next(self._iterator), False
            except StopIteration:
                return None, True

    def start(self) -> None:
        """Fill the replay buffer in a thread until ``total_dialog_turns`` or ``shutdown()`` (TorchRL's ``start``)."""
        if self.collector.replay_buffer is None:
            raise RuntimeError("Replay buffer must be defined for execution.")  # TorchRL's words
        if self._closed:
            raise RuntimeError("the collector was shut down")
        if not self.is_running():
            self._stop.clear()
            self._thread = threading.Thread(target=self._fill, name="rlfleet-collector-fill", daemon=True)
            self._thread.start()

    def _fill(self) -> None:
        with self._next_lock:
            if self._iterator is None:
                self._iterator = iter(self.collector)
            try:
                for _ in self._iterator:
                    if self._stop.is_set():
                        break
            except Exception as error:  # surfaced by is_running(); the thread must not die silently
                if not self._stop.is_set():
                    log.exception("RlfleetRayLLMCollector: filling the replay buffer failed")
                    self._error = error
            finally:
                self._iterator.close()  # ends the stream cleanly: the last batch is acknowledged

    def is_running(self) -> bool:
        """Whether the filling thread runs; raises what ended it, if it failed (once)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float | None = STOP_GRACE_SECONDS) -> None:
        """Stop after the batch under way (waiting up to ``timeout``; None: until it lands), then close."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(timeout)
            if thread.is_alive():  # waiting for a batch that may not come (a sync collector wants a push)
                self.collector.interrupt()
                thread.join(JOIN_SECONDS)
        idle = self._next_lock.acquire(blocking=False)
        if not idle:  # a next_batch() waits (in the actor's other slot, or another thread): end its wait
            self.collector.interrupt()
            idle = self._next_lock.acquire(timeout=JOIN_SECONDS)
        try:
            if idle and self._iterator is not None:
                self._iterator.close()  # between batches: the last one is acknowledged
            if not self._closed:
                self._closed = True
                self.collector.shutdown()
        finally:
            if idle:
                self._next_lock.release()


class RlfleetRayLLMCollector:
    """TorchRL's ``RayLLMCollector`` interface over an rlfleet deployment (see the module doc).

    Args:
        address_or_client: the collector's ``host:port`` (a Ray actor needs the address; in-process a
            ``Client`` may be given).
        dialog_turns_per_batch, total_dialog_turns, policy, replay_buffer, postproc,
            track_policy_version: as TorchRL's. ``policy`` is what ``update_policy_weights_()`` pushes
            by default. With a Ray actor, ``replay_buffer`` must be shared: a TorchRL
            ``RayReplayBuffer`` (its ``client()`` goes to the actor) or such a client.
        prompts: as ``RlfleetLLMCollector``'s; with a Ray actor it must pickle (a ``DataLoadingPrimer``
            sends its ``dataloader``; a generator does not: ``submit_prompts`` from the trainer instead).
        sync_iter: as TorchRL's: False keeps the actor's next batch requested while the trainer works.
        ray_init_config, remote_config, num_cpus, num_gpus: as TorchRL's, for the actor (ignored
            in-process). The actor's default is ``num_cpus=1``, ``max_concurrency=2``.
        env, policy_factory, yield_only_last_steps, yield_completed_trajectories, async_envs,
            reset_at_each_iter, flatten_data, verbose: accepted, no effect (``IGNORED``).
        weight_updater: None only (rlfleet pushes through its collector service).
        backend: "auto" (a Ray actor if Ray is importable and initialized, or ``ray_init_config`` is
            given; else in-process), "ray" (an actor, calling ``ray.init`` if needed) or "local".
        push_mode, push_transport, push_strategy: the weight side's (``RlfleetLLMCollector``).
        options: ``RlfleetLLMCollector``'s other keywords (``prompts``, ``reward_fn``, ``layout``, the
            stream's options, ``connect`` arguments).
    """

    init_random_frames = 0  # read by TorchRL's Trainer

    def __init__(self, address_or_client: str | Client, *, env: Any = None, policy: Any = None,
                 policy_factory: Callable | None = None, dialog_turns_per_batch: int, total_dialog_turns: int = -1,
                 yield_only_last_steps: bool | None = None, yield_completed_trajectories: bool | None = None,
                 postproc: Callable[[TensorDictBase], TensorDictBase] | None = None, async_envs: bool | None = None,
                 replay_buffer: Any = None, reset_at_each_iter: bool = False, flatten_data: bool | None = None,
                 weight_updater: Any = None, ray_init_config: dict[str, Any] | None = None,
                 remote_config: dict[str, Any] | None = None, track_policy_version: bool = True,
                 sync_iter: bool = True, verbose: bool = False, num_cpus: float | None = None,
                 num_gpus: float | None = None, backend: Literal["auto", "ray", "local"] = "auto",
                 push_mode: str = "keep", push_transport: str = "auto", push_strategy: str = "", **options: Any):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        _refuse_foreign_versioning(weight_updater, track_policy_version)
        given = dict(env=env, policy_factory=policy_factory, yield_only_last_steps=yield_only_last_steps,
                     yield_completed_trajectories=yield_completed_trajectories, async_envs=async_envs,
                     reset_at_each_iter=reset_at_each_iter, flatten_data=flatten_data, verbose=verbose)
        for name, (same, reason) in IGNORED.items():
            if not any(given[name] is value for value in same):
                warn_ignored(name, reason)
        self._dialog_turns_per_batch = dialog_turns_per_batch
        self._total_dialog_turns = total_dialog_turns
        self.sync_iter = sync_iter
        self.replay_buffer = replay_buffer
        connect_args = {name: value for name, value in options.items() if name in CONNECT_ARGS}
        self._weights = RlfleetLLMCollector(address_or_client, dialog_turns_per_batch=dialog_turns_per_batch,
                                            policy=policy, push_mode=push_mode, push_transport=push_transport,
                                            push_strategy=push_strategy, **connect_args)
        batch_options = dict(options, dialog_turns_per_batch=dialog_turns_per_batch,
                             total_dialog_turns=total_dialog_turns, postproc=postproc,
                             track_policy_version=track_policy_version)
        try:
            ray = use_ray(backend, ray_init_config)
            if ray is None:
                for name, value in zip(RAY_ONLY, (ray_init_config, remote_config, num_cpus, num_gpus)):
                    if value is not None:
                        warn_ignored(name, "the collector runs in this process, not in a Ray actor")
                self._actor = None
                self._core = CollectorCore(address_or_client, dict(batch_options, replay_buffer=replay_buffer))
                self._collector = self._core
            else:
                if not isinstance(address_or_client, str):
                    raise ValueError("a Ray actor makes its own client: pass the collector's address, not a Client")
                batch_options["replay_buffer"] = shared_buffer(replay_buffer)
                if getattr(options.get("prompts"), "dataloader", None) is not None:
                    batch_options["prompts"] = PrimerSource(options["prompts"].dataloader,
                                                            getattr(options["prompts"], "repeats", None))
                self._core = None
                self._actor = ray.remote(**_actor_options(remote_config, num_cpus, num_gpus))(CollectorCore).remote(
                    address_or_client, batch_options)
                self._collector = self._actor  # TorchRL's recipe calls collector._collector.is_initialized.remote()
                ray.get(self._actor.is_initialized.remote())  # constructor errors surface here, not later
        except BaseException:
            self._weights.shutdown()
            raise
        self._ray = ray
        self._shut = False

    # --- calls to the batch side --------------------------------------------------------------
    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._actor is None:
            return getattr(self._core, method)(*args, **kwargs)
        return self._ray.get(getattr(self._actor, method).remote(*args, **kwargs))

    def set_postproc(self, postproc: Callable[[TensorDictBase], TensorDictBase]) -> None:
        """Set the post-processing transform (once), where batches are made."""
        return self._call("set_postproc", postproc)

    def next(self) -> TensorDictBase | None:
        """The next batch; None when a replay buffer took it, or once the collection has ended."""
        return self._call("next_batch")[0]

    def __iter__(self) -> Iterator[TensorDictBase | None]:
        """Batches (None each when a replay buffer takes them) until ``total_dialog_turns``."""
        if self._actor is None or self.sync_iter:
            while True:
                data, ended = self._call("next_batch")
                if ended:
                    return
                yield data
        future = self._actor.next_batch.remote()
        while True:
            data, ended = self._ray.get(future)
            if ended:
                return
            future = self._actor.next_batch.remote()  # the actor collects while the caller works
            yield data

    @property
    def rollout(self) -> Callable[[], TensorDictBase | None]:
        """Collects one batch (``next``)."""
        return self.next

    def start(self) -> None:
        """Fill the replay buffer in the background until ``total_dialog_turns`` or ``shutdown()``."""
        return self._call("start")

    def is_running(self) -> bool:
        """Whether the background filling runs (raises the error that ended it, if one did)."""
        return self._call("is_running")

    def shutdown(self) -> None:
        """Stop collecting (a batch under way lands within a second, else the stream ends) and close; idempotent."""
        self._close(STOP_GRACE_SECONDS)

    def async_shutdown(self, timeout: float | None = None) -> None:
        """Stop after the batch under way, waiting up to ``timeout`` seconds for it (None: as long as it takes)."""
        self._close(timeout)

    def _close(self, timeout: float | None) -> None:
        if self._shut:
            return
        self._shut = True
        try:
            if self._actor is None:
                self._core.shutdown(timeout)
            elif self._ray.is_initialized():  # else the actor went with the cluster
                try:
                    self._ray.get(self._actor.shutdown.remote(timeout))
                finally:
                    self._ray.kill(self._actor)
        finally:
            self._weights.shutdown()

    def getattr_rb(self, attr: str) -> Any:
        """An attribute of the replay buffer (TorchRL's trainer reads ``write_count`` so)."""
        return getattr(self.replay_buffer, attr)

    @property
    def total_dialog_turns(self) -> int:
        return self._total_dialog_turns

    @property
    def dialog_turns_per_batch(self) -> int:
        return self._dialog_turns_per_batch

    # --- the weight side (this process) -------------------------------------------------------
    @property
    def client(self) -> Client:
        """The weight side's rlfleet client (``wait_ready``, ``status``, ...)."""
        return self._weights.client

    @property
    def last_push(self) -> PushResult | None:
        return self._weights.last_push

    def submit_prompts(self, prompts: Any) -> list[str]:
        """See ``RlfleetLLMCollector.submit_prompts``."""
        return self._weights.submit_prompts(prompts)

    def update_policy_weights_(self, policy_or_weights: Any = None, *, worker_ids: Any = None, **kwargs: Any) -> int:
        """Push weights from this process (TorchRL's forms, see ``RlfleetLLMCollector``); the new version."""
        return self._weights.update_policy_weights_(policy_or_weights, worker_ids=worker_ids, **kwargs)

    def push(self, weights: Any) -> int:
        """Push without counting an increment (``RlfleetWeightSender`` does); the new version."""
        return self._weights.push(weights)

    def increment_version(self) -> int:
        """Acknowledge the last push (see ``rlfleet.client.torchrl.collector``); the current version."""
        return self._weights.increment_version()

    @property
    def policy_version(self) -> int:
        """The committed version (one GetPolicyVersion call, from this process)."""
        return self._weights.policy_version

    def get_policy_version(self) -> int:
        return self.policy_version

    @property
    def weight_updater(self) -> None:
        """Always None: rlfleet pushes through its collector service."""
        return None

    @weight_updater.setter
    def weight_updater(self, weight_updater: Any) -> None:
        if weight_updater is not None:
            raise ValueError("weight_updater: rlfleet pushes through its collector service; pass None")

    def init_updater(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to initialise (TorchRL's call is a no-op without a weight updater)."""

    def __enter__(self) -> "RlfleetRayLLMCollector":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def use_ray(backend: str, ray_init_config: dict[str, Any] | None):
    """The ``ray`` module if the batch side runs in an actor, else None (see ``backend``)."""
    if backend == "local":
        return None
    try:
        import ray
    except ImportError:
        if backend == "ray":
            raise ImportError('backend="ray" needs Ray: pip install "rlfleet[ray]"') from None
        return None
    if not ray.is_initialized():
        if backend == "auto" and ray_init_config is None:
            return None
        ray.init(**(ray_init_config or {}))
    return ray


@dataclass(frozen=True)
class PrimerSource:
    """What the actor reads of a ``DataLoadingPrimer`` (``prompts.py``), which does not pickle itself."""

    dataloader: Any
    repeats: int | None


def shared_buffer(replay_buffer: Any) -> Any:
    """What the actor writes to: a ``RayReplayBuffer``'s picklable client (the buffer itself does not pickle)."""
    if replay_buffer is None:
        return None
    if type(replay_buffer).__module__ == "torchrl.data.replay_buffers.ray_buffer":
        client = getattr(replay_buffer, "client", None)
        return client() if callable(client) else replay_buffer
    raise ValueError(f"replay_buffer: a {type(replay_buffer).__name__} lives in this process, so the Ray actor "
                     f"would fill a copy the trainer never reads. Pass a torchrl RayReplayBuffer (as TorchRL's "
                     f"Ray recipes do), or backend=\"local\"")


def _actor_options(remote_config: dict[str, Any] | None, num_cpus: float | None, num_gpus: float | None
                   ) -> dict[str, Any]:
    """The batch actor's Ray options: the defaults, the CPUs and GPUs asked for, then ``remote_config``."""
    options = dict(DEFAULT_REMOTE_CONFIG)
    options.update({k: v for k, v in (("num_cpus", num_cpus), ("num_gpus", num_gpus)) if v is not None})
    options.update(remote_config or {})
    options.setdefault("max_concurrency", 2)  # shutdown() reaches a next() that waits
    return options


def _refuse_foreign_versioning(weight_updater: Any, track_policy_version: Any) -> None:
    """ValueError for a TorchRL weight updater or policy-version tracker: rlfleet's collector owns both."""
    if weight_updater is not None:
        raise ValueError("weight_updater: rlfleet's collector service brokers every weight push to its engines; "
                         "a TorchRL weight updater targets an engine rlfleet does not expose. Pass None and push "
                         "with update_policy_weights_() or RlfleetWeightSyncScheme")
    if not isinstance(track_policy_version, bool):
        raise ValueError(f"track_policy_version: rlfleet's versions are its collector's integers (one per weight "
                         f"push); a {type(track_policy_version).__name__} would count its own. Pass True")
