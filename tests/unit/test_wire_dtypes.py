"""The one dtype table (rlfleet.wire.dtypes) agrees with the proto enum, torch and safetensors."""

import json
import struct

import pytest
import torch

from rlfleet.v1 import tensor_pb2
from rlfleet.wire import WireError
from rlfleet.wire.dtypes import (
    BY_NAME, BY_SAFETENSORS, BY_TORCH, BY_WIRE, DTYPES, MODEL_DTYPE_NAMES, SUPPORTED_DTYPES, TOKEN_ID_DTYPES,
    dtype_from_name, dtype_from_wire, dtype_name, dtype_to_wire,
)


def test_every_wire_dtype_has_one_row_in_enum_order():
    enum_values = [v for v in tensor_pb2.Dtype.values() if v != tensor_pb2.DTYPE_UNSPECIFIED]
    assert list(BY_WIRE) == enum_values
    assert SUPPORTED_DTYPES == tuple(BY_WIRE[v].torch for v in enum_values)
    for value in enum_values:
        # The enum's own name agrees with the row: DTYPE_BFLOAT16 <-> "bfloat16".
        assert tensor_pb2.Dtype.Name(value) == "DTYPE_" + BY_WIRE[value].name.upper()


def test_names_itemsizes_and_lookups_agree_with_torch():
    assert len(BY_NAME) == len(BY_TORCH) == len(BY_SAFETENSORS) == len(DTYPES)
    for row in DTYPES:
        assert getattr(torch, row.name) is row.torch
        assert row.itemsize == torch.empty((), dtype=row.torch).element_size()
        assert dtype_name(row.torch) == row.name and dtype_from_name(row.name) is row.torch
    for name in MODEL_DTYPE_NAMES:
        assert BY_NAME[name].torch.is_floating_point
    assert all(BY_TORCH[d].wire != tensor_pb2.DTYPE_UNSPECIFIED for d in TOKEN_ID_DTYPES)


@pytest.mark.parametrize("row", DTYPES, ids=lambda row: row.name)
def test_safetensors_tags_are_the_ones_safetensors_writes(row):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    data = safetensors_torch.save({"x": torch.zeros(2, dtype=row.torch)})
    (header_len,) = struct.unpack("<Q", data[:8])
    assert json.loads(data[8:8 + header_len])["x"]["dtype"] == row.safetensors


def test_round_trips_and_refusals():
    for dtype in SUPPORTED_DTYPES:
        assert dtype_from_wire(dtype_to_wire(dtype)) is dtype
    with pytest.raises(WireError, match="unsupported dtype torch.float8_e4m3fn"):
        dtype_to_wire(torch.float8_e4m3fn)  # checkpoint-only: never a Tensor message
    with pytest.raises(WireError, match="unsupported dtype torch.complex64"):
        dtype_to_wire(torch.complex64)
    with pytest.raises(WireError, match=r"^spec\.dtype: unknown dtype 0"):
        dtype_from_wire(tensor_pb2.DTYPE_UNSPECIFIED, "spec.dtype")
    with pytest.raises(ValueError, match="unknown dtype 'complex64'"):
        dtype_from_name("complex64")
