"""What an Append must carry: the required columns, whole groups, valid deduplication keys; decoded and
checked before storing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.v1 import tensor_pb2
from rlfleet.wire import decode_tensor
from rlfleet.wire.tensordict import check_tensordict

#: Keys every appended TensorDict must carry, each a [B] int64 tensor.
REQUIRED_KEYS = ("group_id", "policy_version_start")
GROUP_SIZE_KEY = "group_size"
MAX_KEY_BYTES = 512
"""Longest deduplication key (``idempotency_key`` or one of ``group_keys``), UTF-8: room for the collector's
"<prompt_id>#<ledger seq>" with a prompt_id of its 256-byte maximum."""


@dataclass
class AppendedGroup:
    """One group of an Append (its rows under one group_id), and what the store finds and makes of it."""

    rows: list[int]
    """Its rows' indices in the request."""
    group_id: int
    versions: list[int]
    """Each row's policy_version_start."""
    key: str
    """Its deduplication key ("": the Append has none)."""
    filtered: bool
    """For the filtered log (dynamic sampling), not the buffer."""
    stored_before: bool | None = None
    """None: new; else the key's group was stored before, and this says whether as filtered."""
    payload: bytes = field(default=b"", repr=False)
    """Its rows as one serialized message, as stored (made for a new group only)."""

    @property
    def version(self) -> int:
        """The group's policy version: its oldest row's."""
        return min(self.versions)

    @property
    def stored_as_filtered(self) -> bool:
        """Whether the group is (or, stored before, was) stored as filtered."""
        return self.filtered if self.stored_before is None else self.stored_before


def groups_of(msg: tensor_pb2.TensorDict, idempotency_key: str = "", group_keys: Sequence[str] = (),
              filtered_groups: Sequence[bool] = ()) -> list[AppendedGroup]:
    """The Append's groups in order (each group's first row's), every part of it checked: ``msg``
    (``validate_append``), the keys (``dedup_keys``) and the filtered flags (``filtered_flags``)."""
    group_ids, versions, units = validate_append(msg)
    keys = dedup_keys(idempotency_key, group_keys, len(units)) or [""] * len(units)
    flags = filtered_flags(filtered_groups, group_keys, len(units))
    return [AppendedGroup(rows, group_ids[rows[0]], [versions[i] for i in rows], key, flag)
            for rows, key, flag in zip(units, keys, flags)]


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


def dedup_keys(idempotency_key: str, group_keys: Sequence[str], group_count: int) -> list[str]:
    """The deduplication key of each of the ``group_count`` groups, in order, or [] without dedup.

    ``idempotency_key`` covers the whole call (every group gets it: all are stored or all skipped),
    ``group_keys`` one group each; both set, a count that is not ``group_count``, or an empty, repeated or
    too long key is an error.
    """
    if idempotency_key and group_keys:
        raise InvalidArgument("group_keys: set either idempotency_key or group_keys, not both")
    if idempotency_key:
        _check_key_length(idempotency_key, "idempotency_key")
        return [idempotency_key] * group_count
    if group_keys and len(group_keys) != group_count:
        raise InvalidArgument(f"group_keys: {len(group_keys)} keys for the {group_count} groups in trajectories; "
                              "give one key per group, in the order of each group's first row")
    first_index: dict[str, int] = {}
    for i, key in enumerate(group_keys):
        if not key:
            raise InvalidArgument(f"group_keys[{i}]: empty; every group needs a key")
        _check_key_length(key, f"group_keys[{i}]")
        if key in first_index:
            raise InvalidArgument(f"group_keys[{i}]: {key!r} repeats group_keys[{first_index[key]}]; "
                                  "each group needs its own key")
        first_index[key] = i
    return list(group_keys)


def filtered_flags(filtered_groups: Sequence[bool], group_keys: Sequence[str], group_count: int) -> list[bool]:
    """Whether each of the ``group_count`` groups is to be stored as filtered (dynamic sampling)."""
    if not filtered_groups:
        return [False] * group_count
    if not group_keys:
        raise InvalidArgument("filtered_groups: needs group_keys (one flag per keyed group)")
    if len(filtered_groups) != group_count:
        raise InvalidArgument(f"filtered_groups: {len(filtered_groups)} flags for the {group_count} groups in "
                              "trajectories; give one per group, in the order of group_keys")
    return list(filtered_groups)


def _check_key_length(key: str, where: str) -> None:
    size = len(key.encode())
    if size > MAX_KEY_BYTES:
        raise InvalidArgument(f"{where}: {size} bytes, longer than the {MAX_KEY_BYTES} bytes (UTF-8) "
                              "a deduplication key may have")
