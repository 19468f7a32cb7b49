"""Delta pushes, trainer side: what changed since the last push the collector committed.

``push_weights(..., delta=True)`` keeps the bytes of each push it saw committed (a host copy of
every tensor, made once per full push and then only of the tensors a delta changes) and sends the
next push as a delta: only the tensors whose bytes differ, naming the version they patch
(``weights.proto``, ``rlfleet.wire.weight_delta``). Bytes are compared exactly (a NaN is the same
NaN, -0.0 differs from 0.0). From a client's first ``delta=True`` push on, every push of full
weights that commits is kept, a plain ``push_weights`` (shm or grpc) included; a client that never
asks for a delta keeps no copy of its weights.

A full push is sent instead of a delta when nothing is kept: the client's first delta push, any push
after a failed one (it may have been committed: what is kept is forgotten), after an adapter push or
an nccl push (the collector takes a delta only on a committed version whose spooled push is full
weights; an adapter's version is not, and an nccl push is not spooled); and when the tensors' names,
dtypes or shapes changed, or the collector refuses the delta (FAILED_PRECONDITION: its committed
version moved on, e.g. another pusher, or its spool lacks the base).
"""

from __future__ import annotations

import torch

from rlfleet.wire.push_messages import host_bytes


class DeltaBase:
    """The tensors of the last committed push, by name, and its version (None: nothing kept)."""

    def __init__(self) -> None:
        self.in_use = False
        """Whether the client pushed with ``delta=True``: only then do its full pushes keep their bytes."""
        self.version: int | None = None
        self._kept: dict[str, torch.Tensor] = {}
        self._specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

    def changed(self, pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]] | None:
        """The pairs whose bytes differ from what is kept, or None when only a full push will do."""
        if self.version is None or len(pairs) != len(self._specs):
            return None
        changed = []
        for name, tensor in pairs:
            if self._specs.get(name) != (tensor.dtype, tuple(tensor.shape)):
                return None
            if not torch.equal(host_bytes(tensor), self._kept[name]):
                changed.append((name, tensor))
        return changed

    def record(self, pairs: list[tuple[str, torch.Tensor]], sent: list[tuple[str, torch.Tensor]] | None,
               version: int) -> None:
        """A push committed as ``version``: ``sent`` are the delta's tensors (None: a full push of ``pairs``)."""
        if sent is None:
            self._kept = {name: host_bytes(tensor).clone() for name, tensor in pairs}
            self._specs = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in pairs}
        else:
            for name, tensor in sent:
                self._kept[name].copy_(host_bytes(tensor))
        self.version = version

    def forget(self) -> None:
        self.version = None
        self._kept, self._specs = {}, {}


__all__ = ["DeltaBase"]
