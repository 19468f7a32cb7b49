"""The one dtype table: name <-> torch dtype <-> ``rlfleet.v1.Dtype`` <-> itemsize <-> safetensors tag <-> numpy.

Every module that names, sizes or converts a dtype asks this table, so a dtype
is added (or spelt) in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Model dtypes live torch-free (configs list them before torch is imported); the table answers for them too.
from rlfleet.choices import MODEL_DTYPE_NAMES  # noqa: F401
from rlfleet.v1 import tensor_pb2
from rlfleet.wire.errors import WireError


@dataclass(frozen=True)
class DtypeInfo:
    """One dtype under all of its names."""

    name: str
    """torch's spelling without ``torch.`` (``"bfloat16"``): config values, manifests to workers."""
    torch: torch.dtype
    wire: int
    """``rlfleet.v1.Dtype`` value; ``DTYPE_UNSPECIFIED`` for dtypes that only occur in checkpoints."""
    safetensors: str
    """The dtype tag in a safetensors header (``"BF16"``)."""
    itemsize: int
    """Bytes per element."""
    numpy: str | None
    """The little-endian numpy dtype of the same values (the wire's byte order); None where numpy has none."""


def dtype_name(dtype: torch.dtype) -> str:
    """torch's spelling of a dtype without ``torch.`` (``torch.bfloat16`` -> ``"bfloat16"``): the table's names."""
    return str(dtype).removeprefix("torch.")


def _row(dtype: torch.dtype, wire: int, safetensors: str, numpy: str | None = None) -> DtypeInfo:
    return DtypeInfo(dtype_name(dtype), dtype, wire, safetensors, dtype.itemsize, numpy)


DTYPES: tuple[DtypeInfo, ...] = (
    # Wire dtypes in the order of the rlfleet.v1.Dtype enum.
    _row(torch.float32, tensor_pb2.DTYPE_FLOAT32, "F32", "<f4"),
    _row(torch.float16, tensor_pb2.DTYPE_FLOAT16, "F16", "<f2"),
    _row(torch.bfloat16, tensor_pb2.DTYPE_BFLOAT16, "BF16"),
    _row(torch.float64, tensor_pb2.DTYPE_FLOAT64, "F64", "<f8"),
    _row(torch.int64, tensor_pb2.DTYPE_INT64, "I64", "<i8"),
    _row(torch.int32, tensor_pb2.DTYPE_INT32, "I32", "<i4"),
    _row(torch.int16, tensor_pb2.DTYPE_INT16, "I16", "<i2"),
    _row(torch.int8, tensor_pb2.DTYPE_INT8, "I8", "i1"),
    _row(torch.uint8, tensor_pb2.DTYPE_UINT8, "U8", "u1"),
    _row(torch.bool, tensor_pb2.DTYPE_BOOL, "BOOL", "?"),
    # Checkpoint-only: a served model may hold them; no Tensor message carries them.
    _row(torch.float8_e4m3fn, tensor_pb2.DTYPE_UNSPECIFIED, "F8_E4M3"),
    _row(torch.float8_e5m2, tensor_pb2.DTYPE_UNSPECIFIED, "F8_E5M2"),
)

BY_NAME: dict[str, DtypeInfo] = {row.name: row for row in DTYPES}
BY_TORCH: dict[torch.dtype, DtypeInfo] = {row.torch: row for row in DTYPES}
BY_WIRE: dict[int, DtypeInfo] = {row.wire: row for row in DTYPES if row.wire != tensor_pb2.DTYPE_UNSPECIFIED}
BY_SAFETENSORS: dict[str, DtypeInfo] = {row.safetensors: row for row in DTYPES}

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(row.torch for row in BY_WIRE.values())
"""The torch dtypes a Tensor message can carry."""

TOKEN_ID_DTYPES: tuple[torch.dtype, ...] = (torch.int64, torch.int32)
"""Dtypes accepted for token ids (prompts); they travel as int64."""


def dtype_to_wire(dtype: torch.dtype) -> int:
    """The wire enum value of a torch dtype (``WireError`` if unsupported)."""
    row = BY_TORCH.get(dtype)
    if row is None or row.wire == tensor_pb2.DTYPE_UNSPECIFIED:
        raise WireError("dtype", f"unsupported dtype {dtype}")
    return row.wire


def dtype_from_wire(value: int, field: str = "dtype") -> torch.dtype:
    """The torch dtype of a wire enum value (``WireError`` naming ``field`` if unknown)."""
    row = BY_WIRE.get(value)
    if row is None:
        raise WireError(field, f"unknown dtype {value}")
    return row.torch


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype spelt ``name`` (``"bfloat16"``); ValueError if the table has none."""
    row = BY_NAME.get(name)
    if row is None:
        raise ValueError(f"unknown dtype {name!r}")
    return row.torch
