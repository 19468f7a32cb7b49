"""TensorDict <-> rlfleet.v1.TensorDict: nested keys, batch size, string fields.

On decode, ragged entries become jagged nested tensors (``torch.nested``,
layout=torch.jagged) and string lists become ``NonTensorStack`` entries.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from rlfleet.v1 import tensor_pb2
from rlfleet.wire.errors import WireError
from rlfleet.wire.ragged import Ragged, decode_ragged, encode_ragged
from rlfleet.wire.tensor import check_shape, decode_tensor, encode_tensor


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
    prefix = f"{field}." if field else ""
    batch_size = list(msg.batch_size)
    check_shape(batch_size, f"{prefix}batch_size")
    data: dict[str, Any] = {}
    strings: dict[str, list[str]] = {}
    for key in sorted(msg.entries):
        where = f"{prefix}entries[{key}]"
        if not key or "." in key:
            raise WireError(where, "keys must be non-empty and contain no '.'")
        value = msg.entries[key]
        kind = value.WhichOneof("kind")
        if kind is None:
            raise WireError(where, "empty value (set tensor, ragged, strings or nested)")
        if kind == "tensor":
            tensor = decode_tensor(value.tensor, f"{where}.tensor")
            if list(tensor.shape[: len(batch_size)]) != batch_size:
                raise WireError(f"{where}.tensor.shape",
                                f"{list(tensor.shape)} does not start with batch size {batch_size}")
            data[key] = tensor
        elif kind == "nested":
            nested = decode_tensordict(value.nested, f"{where}.nested")
            if list(nested.batch_size[: len(batch_size)]) != batch_size:
                raise WireError(f"{where}.nested.batch_size",
                                f"{list(nested.batch_size)} does not start with batch size {batch_size}")
            data[key] = nested
        else:
            if len(batch_size) != 1:
                raise WireError(where, f"{kind} entries need a 1-D batch size, got {batch_size}")
            if kind == "ragged":
                ragged = decode_ragged(value.ragged, f"{where}.ragged")
                if ragged.batch_size != batch_size[0]:
                    raise WireError(f"{where}.ragged.lengths",
                                    f"has {ragged.batch_size} samples, batch size is {batch_size[0]}")
                data[key] = _to_nested(ragged)
            else:
                items = list(value.strings.values)
                if len(items) != batch_size[0]:
                    raise WireError(f"{where}.strings",
                                    f"has {len(items)} strings, batch size is {batch_size[0]}")
                strings[key] = items
    td = TensorDict(data, batch_size=batch_size)
    for key, items in strings.items():
        # Set after construction: the constructor would turn a stack into a sub-TensorDict.
        td[key] = NonTensorStack.from_list(items) if items else NonTensorStack(batch_size=[0])
    return td


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


def parse_tensordict(raw: bytes) -> tensor_pb2.TensorDict:
    """Parse serialized bytes into a TensorDict message (``WireError`` if they don't parse)."""
    from google.protobuf.message import DecodeError

    msg = tensor_pb2.TensorDict()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise WireError("", f"not a valid TensorDict message: {exc}") from None
    return msg
