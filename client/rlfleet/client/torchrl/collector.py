"""``RlfleetLLMCollector``: TorchRL's ``LLMCollector`` interface over an rlfleet deployment.

Versions. rlfleet's collector owns the version and moves it only with a weight push: a version
names the weights the engines compute with. TorchRL code pushes through
``update_policy_weights_()`` or a sender's ``update_weights()`` and then calls
``increment_version()`` (``Collector.update_policy_weights_`` and every sender post-hook do). Here
the push has already advanced the version, so ``increment_version()`` only counts: it
acknowledges the last push and never pushes again. Called with no push since the last one, it
moves nothing (a version without new weights would lie) and warns once.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterator, Mapping

from tensordict import TensorDictBase

from rlfleet.rpc.records import PushResult
from rlfleet.client.sync import Client, connect
from rlfleet.client.torchrl.layout import to_torchrl
from rlfleet.client.torchrl.prompts import prompt_items, to_spec
from rlfleet.client.torchrl.policy_weights import peft_adapter, policy_state_dict

log = logging.getLogger("rlfleet.client.torchrl")
LAYOUTS = ("torchrl", "ragged")


class RlfleetLLMCollector:
    """Iterate batches of ``dialog_turns_per_batch`` scored samples; push weights back.

    Args:
        address_or_client: the collector's ``host:port`` (a client is made and owned) or a ``Client``.
        dialog_turns_per_batch: samples per batch (a multiple of the group size keeps groups whole).
        total_dialog_turns: stop after this many samples (-1: never).
        policy: what ``update_policy_weights_()`` pushes by default: a TorchRL wrapper, a module,
            a state dict or a TensorDict (see ``rlfleet.client.torchrl.policy_weights``); a
            ``peft.PeftModel`` (or a wrapper of one) pushes only its LoRA adapter.
        replay_buffer: as TorchRL's: each batch is ``extend``-ed into it and ``None`` is yielded.
        postproc: as TorchRL's: applied to each batch (in the chosen layout) before it is yielded or
            extended into the replay buffer.
        prompts: a ``DataLoadingPrimer``, DataLoader or iterable feeding ``submit_prompts``
            (``rlfleet.client.torchrl.prompts``); None: submit through ``collector.client``.
        prompts_ahead: batches' worth of prompts kept submitted ahead of what was delivered.
        reward_fn, reward_args, system_prompt: defaults for prompts from ``prompts``.
        layout: "torchrl" (lazy stack, ``rlfleet.client.torchrl.layout``) or "ragged" (``Batch.td``).
        min_policy_version, lease_seconds, prefetch, whole_groups: the batch stream's options
            (``Client.batches``).
        push_mode, push_transport, push_strategy: ``Client.push_weights``'s (and ``push_adapter``'s) ``mode``,
            ``transport`` and ``strategy`` ("rolling": the replicas switch one at a time while the others serve).
        connect_kwargs: for ``connect`` when an address is given.
    """

    init_random_frames = 0  # read by TorchRL's Trainer

    def __init__(self, address_or_client: str | Client, *, dialog_turns_per_batch: int,
                 total_dialog_turns: int = -1, policy: Any = None, replay_buffer: Any = None,
                 postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
                 prompts: Any = None, prompts_ahead: int = 2, reward_fn: str | None = None,
                 reward_args: Mapping[str, Any] | None = None, system_prompt: str | None = None,
                 layout: str = "torchrl", track_policy_version: bool = True, whole_groups: bool = True,
                 min_policy_version: int = 0, lease_seconds: float = 0.0, prefetch: int = 1,
                 push_mode: str = "keep", push_transport: str = "auto", push_strategy: str = "",
                 **connect_kwargs: Any):
        if dialog_turns_per_batch < 1:
            raise ValueError(f"dialog_turns_per_batch must be >= 1, got {dialog_turns_per_batch}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if prompts_ahead < 1:
            raise ValueError(f"prompts_ahead must be >= 1, got {prompts_ahead}")
        self._owns_client = isinstance(address_or_client, str)
        self.client = connect(address_or_client, **connect_kwargs) if self._owns_client else address_or_client
        self.dialog_turns_per_batch = dialog_turns_per_batch
        self.total_dialog_turns = total_dialog_turns
        self.policy = policy
        self.replay_buffer = replay_buffer
        self.postproc = postproc
        self.layout = layout
        self.track_policy_version = track_policy_version
        self.stream_options = dict(whole_groups=whole_groups, min_policy_version=min_policy_version,
                                   lease_seconds=lease_seconds, prefetch=prefetch)
        self.push_mode = push_mode
        self.push_transport = push_transport
        self.push_strategy = push_strategy
        self.last_push: PushResult | None = None
        """The result of the last weight push (version, bytes, seconds, transport)."""
        self._prompt_defaults = dict(reward_fn=reward_fn, reward_args=reward_args, system_prompt=system_prompt)
        self._prompts = prompt_items(prompts) if prompts is not None else None
        self._repeats = getattr(prompts, "repeats", None)  # a DataLoadingPrimer's samples per prompt
        self._prompts_ahead = prompts_ahead
        self._submitted = 0
        self._delivered_samples = 0
        self._group_size: int | None = None
        self._unacknowledged_pushes = 0
        self._warned_increment = False
        self._batches = None

    # --- collection -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[TensorDictBase | None]:
        collected = 0
        self._feed()
        self._batches = self.client.batches(self.dialog_turns_per_batch, **self.stream_options)
        with self._batches as batches:
            for batch in batches:
                if not batch.redelivered:
                    self._delivered_samples += len(batch)
                self._feed()
                data = to_torchrl(batch.td) if self.layout == "torchrl" else batch.td
                if self.layout == "ragged" and self.track_policy_version:
                    data["policy_version"] = data["policy_version_start"].clone()
                if self.postproc is not None:
                    data = self.postproc(data)
                if self.replay_buffer is not None:
                    self.replay_buffer.extend(data)
                    yield None
                else:
                    yield data
                collected += len(batch)
                if 0 < self.total_dialog_turns <= collected:
                    return

    def set_postproc(self, postproc: Callable[[TensorDictBase], TensorDictBase]) -> None:
        """Set the post-processing transform once (TorchRL's rule: a second call raises)."""
        if self.postproc is not None:
            raise RuntimeError("Postproc already set")
        self.postproc = postproc

    def interrupt(self) -> None:
        """End a batch wait under way in another thread (the iteration ends); safe from any thread.

        Nothing delivered is lost: the batch before the wait was acknowledged when the wait began,
        and one arriving as the stream ends goes back to the buffer.
        """
        if self._batches is not None:
            self._batches._stream.abandon()  # the stream's thread-safe close (close() runs on its loop)

    def submit_prompts(self, prompts: Any) -> list[str]:
        """Submit prompts in any form ``prompts=`` accepts (one pass over them); returns their ids."""
        specs = [to_spec(item, **self._prompt_defaults) for item in prompt_items(prompts, cycle=False)]
        return self.client.submit_prompts(specs) if specs else []

    def _feed(self) -> None:
        # Keep `prompts_ahead` batches' worth of prompts submitted beyond what was delivered.
        if self._prompts is None:
            return
        group_size = self._group_size or self._learn_group_size()
        wanted = (self._prompts_ahead * math.ceil(self.dialog_turns_per_batch / group_size)
                  + self._delivered_samples // group_size - self._submitted)
        specs = []
        for item in self._prompts:
            specs.append(to_spec(item, **self._prompt_defaults))
            if len(specs) >= wanted:
                break
        if specs:
            self.client.submit_prompts(specs)
            self._submitted += len(specs)

    def _learn_group_size(self) -> int:
        group_size = max(1, self.client.status().group_size)
        if self._repeats is not None and self._repeats != group_size:
            raise ValueError(f"the prompt source repeats each prompt {self._repeats} times, but the collector "
                             f"generates {group_size} samples per prompt (its group_size): make them equal")
        self._group_size = group_size
        return group_size

    # --- weights and versions ---------------------------------------------------------------
    def update_policy_weights_(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None,
                               weights_dict: Mapping[str, Any] | None = None, model_id: str | None = None,
                               worker_ids: Any = None, policy_weights: Any = None) -> int:
        """Push new weights (TorchRL's keyword forms); returns the new version.

        The weights are the first given of ``policy_or_weights``, ``weights``, ``policy``,
        ``policy_weights`` (deprecated in TorchRL), ``weights_dict[model_id]`` (or its only entry),
        else the constructor's ``policy``. ``worker_ids`` must be None: a push reaches every replica.
        """
        if worker_ids is not None:
            raise ValueError("worker_ids: rlfleet pushes to every generation replica; pass None")
        if weights_dict is not None:
            if model_id is None and len(weights_dict) != 1:
                raise ValueError(f"weights_dict has {len(weights_dict)} entries: name one with model_id")
            weights = weights_dict[model_id] if model_id is not None else next(iter(weights_dict.values()))
        chosen = next((w for w in (policy_or_weights, weights, policy, policy_weights, self.policy)
                       if w is not None), None)
        if chosen is None:
            raise ValueError("update_policy_weights_ needs weights, or a policy given to the constructor")
        version = self.push(chosen)
        self.increment_version()  # as TorchRL's Collector.update_policy_weights_ does: counts, no second push
        return version

    def push(self, weights: Any) -> int:
        """Push ``weights`` (any form ``policy`` accepts) without counting an increment; the new version.

        A ``peft.PeftModel`` (or a wrapper holding one) pushes only its LoRA adapter
        (``Client.push_adapter``): the replicas serve their weights plus the adapter."""
        adapter = peft_adapter(weights)
        if adapter is not None:
            self.last_push = self.client.push_adapter(adapter, mode=self.push_mode, transport=self.push_transport,
                                                      strategy=self.push_strategy, progress=False)
        else:
            self.last_push = self.client.push_weights(policy_state_dict(weights), mode=self.push_mode,
                                                      transport=self.push_transport, strategy=self.push_strategy,
                                                      progress=False)
        self._unacknowledged_pushes += 1
        return self.last_push.version

    @property
    def unacknowledged_pushes(self) -> int:
        """Weight pushes not yet matched by an ``increment_version`` (see the module doc)."""
        return self._unacknowledged_pushes

    def increment_version(self) -> int:
        """Acknowledge the last push (see the module doc); returns the current version."""
        if self._unacknowledged_pushes:
            self._unacknowledged_pushes -= 1
            return self.last_push.version
        if not self._warned_increment:
            self._warned_increment = True
            log.warning("increment_version() without a weight push: rlfleet versions move only with pushes, "
                        "so the version stays %d", self.policy_version)
        return self.policy_version

    @property
    def policy_version(self) -> int:
        """The committed version (one GetPolicyVersion call)."""
        return self.client.policy_version

    def get_policy_version(self) -> int:
        return self.policy_version

    # --- lifecycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._batches is not None:
            self._batches.close()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> "RlfleetLLMCollector":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class RlfleetWeightSyncScheme:
    """A TorchRL weight-sync scheme whose sender pushes through an rlfleet collector.

    Wired as TorchRL 0.14's ``VLLMWeightSyncScheme`` is in its GRPO recipe::

        scheme = RlfleetWeightSyncScheme(collector)
        sender = scheme.create_sender()
        sender.register_model(train_policy.model)   # or the wrapper itself: names are mapped
        sender.register_collector(collector)        # post-hook: collector.increment_version()
        sender.update_weights()                     # or GRPOTrainer(weight_sync_sender=sender)
    """

    def __init__(self, collector: RlfleetLLMCollector):
        self.collector = collector

    def create_sender(self) -> "RlfleetWeightSender":
        return RlfleetWeightSender(self.collector)


class RlfleetWeightSender:
    """``update_weights()`` pushes the registered model, then runs the post-hooks (TorchRL's order)."""

    def __init__(self, collector: RlfleetLLMCollector):
        self.collector = collector
        self.model: Any = None
        self._post_hooks: list = []

    def register_model(self, model: Any) -> None:
        self.model = model

    def register_collector(self, collector: Any) -> None:
        self._post_hooks.append(collector.increment_version)

    def register_post_hook(self, hook) -> None:
        self._post_hooks.append(hook)

    def init_all_workers_group(self, model_metadata: Any = None, vllm_engine: Any = None) -> None:
        """Nothing to set up: the rlfleet collector brokers every transfer (kept for TorchRL's call)."""

    def update_weights(self, weights: Any = None) -> int:
        chosen = weights if weights is not None else self.model
        if chosen is None:
            raise ValueError("update_weights needs weights, or a model given to register_model")
        version = self.collector.push(chosen)
        for hook in self._post_hooks:
            hook()
        return version
