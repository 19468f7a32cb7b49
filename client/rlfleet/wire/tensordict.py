"""TensorDict <-> rlfleet.v1.TensorDict: nested keys, batch size, string fields.

On decode, ragged entries become jagged nested tensors (``torch.nested``,
layout=torch.jagged) and string lists become ``NonTensorStack`` entries;
``string_list`` gives such an entry back as a plain ``list[str]`` (what the SDK's
``Batch[key]`` returns).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from rlfleet.v1 import tensor_pb2
from rlfleet.wire.errors import WireError
from rlfleet.wire.ragged import Ragged, check_ragged, decode_ragged, encode_ragged
from rlfleet.wire.tensor import check_shape, checked_tensor, decode_tensor, encode_tensor


def encode_tensordict(td: TensorDictBase | Mapping[str, Any], batch_size: Sequence[int] | None = None,
                      out: tensor_pb2.TensorDict | None = None) -> tensor_pb2.TensorDict:
    """Encode a TensorDict (or a mapping plus ``batch_size``) into a message."""
    if isinstance(td, TensorDictBase):
        batch_size = list(td.batch_size)
        items = td.items(include_nested=False)
    else:
        if batch_size is None:
            raise ValueError("batch_size is required when encoding a plain mapping")
        items = td.items()
    msg = tensor_pb2.TensorDict() if out is None else out
    msg.batch_size[:] = list(batch_size)
    for key, value in items:
        if not isinstance(key, str) or not key or "." in key:
            raise WireError(f"entries[{key}]", "keys must be non-empty strings without '.'")
        entry = msg.entries[key]
        try:
            _encode_value(value, batch_size, entry)
        except WireError as err:
            raise err.prefixed(f"entries[{key}]") from None
    return msg


def _encode_value(value: Any, batch_size: Sequence[int], entry: tensor_pb2.TensorDictValue) -> None:
    # Non-tensor stacks are TensorDictBase subclasses: test them first.
    if isinstance(value, NonTensorStack):
        entry.strings.values[:] = [str(v) for v in value.tolist()]
    elif isinstance(value, NonTensorData):
        entry.strings.values[:] = [str(value.data)] * (batch_size[0] if batch_size else 1)
    elif isinstance(value, (TensorDictBase, Mapping)):
        encode_tensordict(value, batch_size=None if isinstance(value, TensorDictBase) else batch_size,
                          out=entry.nested)
    elif isinstance(value, Ragged):
        encode_ragged(value, out=entry.ragged)
    elif isinstance(value, torch.Tensor) and value.is_nested:
        encode_ragged(value, out=entry.ragged)
    elif isinstance(value, torch.Tensor):
        encode_tensor(value, out=entry.tensor)
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        entry.strings.values[:] = list(value)
    else:
        raise WireError("", f"cannot encode a value of type {type(value).__name__}")


def decode_tensordict(msg: tensor_pb2.TensorDict, field: str = "") -> TensorDict:
    """Decode and validate a TensorDict message."""
    td, _ = _walk(msg, field, build=True)
    return td


def check_tensordict(msg: tensor_pb2.TensorDict, field: str = "") -> int:
    """Validate a TensorDict message exactly as ``decode_tensordict`` does, building nothing.

    Returns the number of tensor bytes it holds (dense and ragged values). No
    tensor is built and strings are only counted (decoding builds an object per
    string), so memory stays near the message's own size whatever it holds."""
    _, nbytes = _walk(msg, field, build=False)
    return nbytes


def _walk(msg: tensor_pb2.TensorDict, field: str, build: bool) -> tuple[TensorDict | None, int]:
    """The one validation of a TensorDict message; with ``build`` it also assembles the TensorDict."""
    prefix = f"{field}." if field else ""
    check_shape(msg.batch_size, f"{prefix}batch_size")
    batch_size = list(msg.batch_size)
    data: dict[str, Any] = {}
    strings: dict[str, list[str]] = {}
    nbytes = 0
    for key in sorted(msg.entries):
        where = f"{prefix}entries[{key}]"
        if not key or "." in key:
            raise WireError(where, "keys must be non-empty and contain no '.'")
        value = msg.entries[key]
        kind = value.WhichOneof("kind")
        if kind is None:
            raise WireError(where, "empty value (set tensor, ragged, strings or nested)")
        if kind == "tensor":
            tensor, size = _entry_tensor(value.tensor, f"{where}.tensor", batch_size, build)
            if build:
                data[key] = tensor
            nbytes += size
        elif kind == "nested":
            nested, nested_bytes = _walk(value.nested, f"{where}.nested", build)
            nested_batch = list(value.nested.batch_size)
            if nested_batch[: len(batch_size)] != batch_size:
                raise WireError(f"{where}.nested.batch_size",
                                f"{nested_batch} does not start with batch size {batch_size}")
            nbytes += nested_bytes
            if build:
                data[key] = nested
        else:
            if len(batch_size) != 1:
                raise WireError(where, f"{kind} entries need a 1-D batch size, got {batch_size}")
            if kind == "ragged":
                samples = len(value.ragged.lengths)
                if build:
                    ragged = decode_ragged(value.ragged, f"{where}.ragged")
                    nbytes += ragged.values.numel() * ragged.values.element_size()
                    data[key] = _to_nested(ragged)
                else:
                    nbytes += check_ragged(value.ragged, f"{where}.ragged")
                if samples != batch_size[0]:
                    raise WireError(f"{where}.ragged.lengths", f"has {samples} samples, batch size is {batch_size[0]}")
            else:
                count = len(value.strings.values)
                if count != batch_size[0]:
                    raise WireError(f"{where}.strings", f"has {count} strings, batch size is {batch_size[0]}")
                if build:
                    strings[key] = list(value.strings.values)
    if not build:
        return None, nbytes
    td = TensorDict(data, batch_size=batch_size)
    for key, items in strings.items():
        # Set after construction: the constructor would turn a stack into a sub-TensorDict.
        td[key] = NonTensorStack.from_list(items) if items else NonTensorStack(batch_size=[0])
    return td, nbytes


def _entry_tensor(message: tensor_pb2.Tensor, where: str, batch_size: list[int], build: bool
                  ) -> tuple[torch.Tensor | None, int]:
    """A tensor entry checked against the batch size (decoded with ``build``) and its size in bytes."""
    if build:
        tensor = decode_tensor(message, where)
        shape, size = list(tensor.shape), tensor.numel() * tensor.element_size()
    else:
        tensor, (_, shape, raw) = None, checked_tensor(message, where)
        size = len(raw)
    if shape[: len(batch_size)] != batch_size:
        raise WireError(f"{where}.shape", f"{shape} does not start with batch size {batch_size}")
    return tensor, size


def _to_nested(ragged: Ragged) -> torch.Tensor | Ragged:
    if ragged.batch_size == 0:
        # torch.nested cannot represent an empty batch.
        return torch.empty((0, 0, *ragged.values.shape[1:]), dtype=ragged.values.dtype)
    return ragged.to_nested()


def get_ragged(td: TensorDictBase, key) -> Ragged:
    """A ragged entry of a decoded TensorDict as a ``Ragged``."""
    value = td.get(key)
    if isinstance(value, torch.Tensor) and value.is_nested:
        return Ragged.from_nested(value)
    if isinstance(value, torch.Tensor) and value.shape[0] == 0:
        return Ragged(value.reshape(0, *value.shape[2:]), torch.zeros(0, dtype=torch.int64))
    raise TypeError(f"entry {key!r} is not ragged")


def string_list(value: Any) -> list[str] | None:
    """A string entry of a decoded TensorDict (a ``NonTensorStack``, or the ``NonTensorData`` tensordict
    may make of equal strings) as a plain ``list[str]``, one per sample; None for any other value."""
    if not isinstance(value, (NonTensorStack, NonTensorData)):
        return None
    if value.batch_size.numel() == 0:
        return []  # an empty stack's tolist() fails
    # .tolist(): a LinkedList on tensordict 0.14, a list on 0.15; either iterates.
    items = value.tolist()
    return [str(item) for item in items] if isinstance(items, list) else [str(items)]


def parse_tensordict(raw: bytes) -> tensor_pb2.TensorDict:
    """Parse serialized bytes into a TensorDict message (``WireError`` if they don't parse)."""
    from google.protobuf.message import DecodeError

    msg = tensor_pb2.TensorDict()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise WireError("", f"not a valid TensorDict message: {exc}") from None
    return msg


def entry_at(msg: tensor_pb2.TensorDict, key: str) -> tensor_pb2.TensorDictValue | None:
    """The entry at ``key`` ("tokens/response": nested TensorDicts walked by "/"), or None; reads the
    message as it is, without decoding anything."""
    *parents, name = key.split("/")
    for parent in parents:
        if parent not in msg.entries or msg.entries[parent].WhichOneof("kind") != "nested":
            return None
        msg = msg.entries[parent].nested
    return msg.entries[name] if name in msg.entries else None
