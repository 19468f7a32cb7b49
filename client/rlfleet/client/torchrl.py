"""A drop-in for TorchRL's ``LLMCollector`` backed by an rlfleet deployment.

    from rlfleet.client.torchrl import RlfleetLLMCollector

    collector = RlfleetLLMCollector("collector:50050", dialog_turns_per_batch=32, policy=model)
    for data in collector:                      # TensorDicts with TorchRL's LLM keys
        loss = loss_fn(data); ...
        collector.update_policy_weights_()      # pushes `policy`'s weights; version += 1
        print(collector.policy_version)

TorchRL itself is not imported: the adapter speaks TensorDict, which both share.
Versions are owned by the rlfleet collector and move only with a weight push
(a version increment means the engines now compute with the new weights), so
``increment_version()`` pushes the current weights rather than bumping a
counter that would lie.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from tensordict import TensorDictBase

from rlfleet.client.sync import Client, connect


class RlfleetLLMCollector:
    """Iterate batches of ``dialog_turns_per_batch`` trajectories; push weights back."""

    def __init__(self, address_or_client: str | Client, *, dialog_turns_per_batch: int,
                 total_dialog_turns: int = -1, policy: torch.nn.Module | None = None,
                 track_policy_version: bool = True, whole_groups: bool = True, push_mode: str = "keep",
                 **connect_kwargs: Any):
        self._owns_client = isinstance(address_or_client, str)
        self.client = connect(address_or_client, **connect_kwargs) if self._owns_client else address_or_client
        self.dialog_turns_per_batch = dialog_turns_per_batch
        self.total_dialog_turns = total_dialog_turns
        self.policy = policy
        self.track_policy_version = track_policy_version
        self.whole_groups = whole_groups
        self.push_mode = push_mode
        self._batches = None

    def __iter__(self) -> Iterator[TensorDictBase]:
        collected = 0
        self._batches = self.client.batches(self.dialog_turns_per_batch, whole_groups=self.whole_groups)
        with self._batches as batches:
            for batch in batches:
                data = batch.td
                if self.track_policy_version:
                    # TorchRL's PolicyVersion transform writes this key.
                    data["policy_version"] = data["policy_version_start"].clone()
                yield data
                collected += len(batch)
                if 0 < self.total_dialog_turns <= collected:
                    return

    def update_policy_weights_(self, policy_or_weights: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
                               **_: Any) -> int:
        """Push new weights (the given module/state dict, else ``policy``); returns the new version."""
        weights = policy_or_weights if policy_or_weights is not None else self.policy
        if weights is None:
            raise ValueError("update_policy_weights_ needs weights, or a policy given to the constructor")
        return self.client.push_weights(weights, mode=self.push_mode, progress=False).version

    def increment_version(self) -> int:
        """Advance the version by pushing the current policy's weights (see the module docstring)."""
        return self.update_policy_weights_()

    @property
    def policy_version(self) -> int:
        return self.client.policy_version

    def get_policy_version(self) -> int:
        return self.policy_version

    def shutdown(self) -> None:
        if self._batches is not None:
            self._batches.close()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> "RlfleetLLMCollector":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
