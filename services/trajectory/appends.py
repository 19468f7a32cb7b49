"""What an Append must carry: the required columns, whole groups; decoded and checked before storing."""

from __future__ import annotations

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.v1 import tensor_pb2
from rlfleet.wire import decode_tensor
from rlfleet.wire.tensordict import check_tensordict

#: Keys every appended TensorDict must carry, each a [B] int64 tensor.
REQUIRED_KEYS = ("group_id", "policy_version_start")
GROUP_SIZE_KEY = "group_size"


def validate_append(msg: tensor_pb2.TensorDict) -> tuple[list[int], list[int], list[list[int]]]:
    """Validate an append (exactly as decoding it would, building nothing: the rows are stored as
    the bytes they came as); returns (group ids, policy versions, row indices per group)."""
    check_tensordict(msg, "trajectories")
    if len(msg.batch_size) != 1:
        raise InvalidArgument(f"trajectories.batch_size: must be 1-D [B], got {list(msg.batch_size)}")
    count = msg.batch_size[0]
    group_ids = int64_column(msg, REQUIRED_KEYS[0], count)
    versions = int64_column(msg, REQUIRED_KEYS[1], count)
    groups: dict[int, list[int]] = {}
    for i, group_id in enumerate(group_ids):
        groups.setdefault(group_id, []).append(i)
    if GROUP_SIZE_KEY in msg.entries:
        sizes = int64_column(msg, GROUP_SIZE_KEY, count)
        for group_id, indices in groups.items():
            for i in indices:
                if sizes[i] != len(indices):
                    raise InvalidArgument(
                        f"trajectories.entries[{GROUP_SIZE_KEY}][{i}]: says {sizes[i]} but this Append "
                        f"carries {len(indices)} rows of group_id {group_id}; append each group whole, "
                        "in one call")
    return group_ids, versions, list(groups.values())


def int64_column(msg: tensor_pb2.TensorDict, key: str, count: int) -> list[int]:
    where = f"trajectories.entries[{key}]"
    if key not in msg.entries:
        raise InvalidArgument(f"{where}: missing; required keys: {', '.join(REQUIRED_KEYS)} "
                              "(each a [B] int64 tensor)")
    value = msg.entries[key]
    if (value.WhichOneof("kind") != "tensor" or value.tensor.dtype != tensor_pb2.DTYPE_INT64
            or list(value.tensor.shape) != [count]):
        got = (f"tensor {tensor_pb2.Dtype.Name(value.tensor.dtype)} {list(value.tensor.shape)}"
               if value.WhichOneof("kind") == "tensor" else value.WhichOneof("kind"))
        raise InvalidArgument(f"{where}: must be a [{count}] int64 tensor, got {got}")
    return decode_tensor(value.tensor, where).tolist()
