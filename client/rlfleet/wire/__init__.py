"""Wire codec: torch tensors, ragged tensors and TensorDicts <-> protobuf messages.

Every decoder validates what it reads and raises ``WireError`` naming the field.
"""

from rlfleet.wire.errors import WireError
from rlfleet.wire.ragged import Ragged, decode_ragged, encode_ragged
from rlfleet.wire.dtypes import SUPPORTED_DTYPES
from rlfleet.wire.tensor import decode_tensor, encode_tensor, tensor_bytes
from rlfleet.wire.tensordict import decode_tensordict, encode_tensordict, get_ragged, string_list

__all__ = [
    "Ragged", "SUPPORTED_DTYPES", "WireError", "decode_ragged", "decode_tensor",
    "decode_tensordict", "encode_ragged", "encode_tensor", "encode_tensordict",
    "get_ragged", "string_list", "tensor_bytes",
]
