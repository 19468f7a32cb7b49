"""Wire codec: torch tensors, ragged tensors and TensorDicts <-> protobuf messages.

Every decoder validates what it reads and raises ``WireError`` naming the field.
"""

from rlfleet.wire.errors import WireError
from rlfleet.wire.ragged import Ragged, decode_ragged, encode_ragged
from rlfleet.wire.dtypes import SUPPORTED_DTYPES
from rlfleet.wire.tensor import decode_tensor, encode_tensor, tensor_bytes

_TENSORDICT_NAMES = ("decode_tensordict", "encode_tensordict", "get_ragged", "string_list")
"""Imported from ``rlfleet.wire.tensordict`` on first use: tensordict imports ``torch._dynamo`` (~1.2 s),
which a service that never builds a TensorDict (reward, reference, collector, environment) need not pay at
every start."""


def __getattr__(name: str):
    if name in _TENSORDICT_NAMES:
        from rlfleet.wire import tensordict

        value = globals()[name] = getattr(tensordict, name)  # looked up once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Ragged", "SUPPORTED_DTYPES", "WireError", "decode_ragged", "decode_tensor",
    "decode_tensordict", "encode_ragged", "encode_tensor", "encode_tensordict",
    "get_ragged", "string_list", "tensor_bytes",
]
