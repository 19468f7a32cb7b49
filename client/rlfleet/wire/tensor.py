"""torch.Tensor <-> rlfleet.v1.Tensor: dtype, shape, raw little-endian bytes."""

from __future__ import annotations

import sys
import warnings

import numpy
import torch

from rlfleet.v1 import tensor_pb2
# SUPPORTED_DTYPES and the two converters stay importable from here (they lived here before dtypes.py).
from rlfleet.wire.dtypes import SUPPORTED_DTYPES, dtype_from_wire, dtype_to_wire  # noqa: F401
from rlfleet.wire.dtypes import BY_TORCH, BY_WIRE
from rlfleet.wire.errors import WireError

if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in sight
    raise ImportError("rlfleet's wire format assumes a little-endian host")

_INT64_MAX = 2**63 - 1
MAX_NDIM = 64
"""Most dimensions a tensor may have on the wire (numpy's limit; no model tensor comes close)."""


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian C-contiguous bytes of a tensor (the one copy gRPC needs)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def encode_tensor(tensor: torch.Tensor, out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """Encode a dense tensor (any device, any strides) into a Tensor message."""
    if tensor.is_nested or tensor.layout != torch.strided:
        raise WireError("", f"cannot encode a {tensor.layout} tensor densely; use encode_ragged")
    msg = tensor_pb2.Tensor() if out is None else out
    msg.dtype = dtype_to_wire(tensor.dtype)
    msg.shape[:] = list(tensor.shape)
    msg.data = tensor_bytes(tensor)
    return msg


def encode_values(values, dtype: torch.dtype, out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """The message ``encode_tensor(torch.tensor(values, dtype=dtype))`` builds, for numbers (a list,
    nested lists or a numpy array), written with numpy: no tensor built, a fraction of the cost for the
    small columns of a reply or a group."""
    row = BY_TORCH.get(dtype)
    if row is None or row.numpy is None or row.wire == tensor_pb2.DTYPE_UNSPECIFIED:
        raise WireError("dtype", f"cannot encode {dtype} from numbers")
    array = numpy.asarray(values, dtype=row.numpy)
    msg = tensor_pb2.Tensor() if out is None else out
    msg.dtype = row.wire
    msg.shape[:] = array.shape
    msg.data = array.tobytes()
    return msg


def check_shape(shape, field: str = "shape", max_elements: int | None = None) -> int:
    """Validate dims and return the element count (``WireError`` naming ``field`` otherwise).

    Dims must be non-negative, at most ``MAX_NDIM`` of them, and the product of
    the non-zero ones must fit int64: torch computes strides from them even when
    another dim is 0, so ``[0, 2**62, 2**62]`` (no elements, no bytes) would
    overflow there. ``max_elements`` optionally bounds the element count.
    """
    if len(shape) > MAX_NDIM:
        raise WireError(field, f"has {len(shape)} dimensions, at most {MAX_NDIM} are allowed")
    numel = extent = 1
    for i, dim in enumerate(shape):
        if dim < 0:
            raise WireError(f"{field}[{i}]", f"negative dimension {dim}")
        numel *= dim
        extent *= dim or 1
        if extent > _INT64_MAX:
            raise WireError(field, f"{list(shape)} overflows int64 (the product of the non-zero "
                                   f"dimensions must be at most 2**63-1)")
    if max_elements is not None and numel > max_elements:
        raise WireError(field, f"{list(shape)} holds {numel} elements, at most {max_elements} are allowed")
    return numel


def decode_tensor(msg: tensor_pb2.Tensor, field: str = "", *, max_elements: int | None = None) -> torch.Tensor:
    """Decode a Tensor message, viewing the received bytes without a copy.

    The result is read-only memory owned by the message's bytes: clone it
    before writing in place. ``max_elements`` bounds the element count (the
    message size already bounds the bytes; this bounds what a caller builds
    from them, e.g. a Python list of token ids).
    """
    dtype, shape, data = checked_tensor(msg, field, max_elements=max_elements)
    if not data:
        return torch.empty(shape, dtype=dtype)
    if len(data) <= 1:
        # CPython caches one-byte bytes objects: never alias them.
        data = bytearray(data)
    flat = _frombuffer(data, torch.uint8 if dtype == torch.bool else dtype)
    if dtype == torch.bool:
        flat = flat.view(torch.bool)
    return flat.reshape(shape)


_quiet = False
"""Whether torch.frombuffer has said its "buffer is not writable" once, which is all it says
(``TORCH_WARN_ONCE``) unless ``torch.set_warn_always``: from then on no warning filter is needed."""


def _frombuffer(data: bytes | bytearray, dtype: torch.dtype) -> torch.Tensor:
    global _quiet
    if _quiet and not torch.is_warn_always_enabled():
        return torch.frombuffer(data, dtype=dtype)
    with warnings.catch_warnings():  # a filter costs ~3 us a call: it was most of a small tensor's decode
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable"
        flat = torch.frombuffer(data, dtype=dtype)
    _quiet = _quiet or isinstance(data, bytes)
    return flat


def checked_tensor(msg: tensor_pb2.Tensor, field: str = "", *,
                   max_elements: int | None = None) -> tuple[torch.dtype, list[int], bytes]:
    """Validate a Tensor message as ``decode_tensor`` does, building no tensor: (dtype, shape, data)."""

    def where(name: str) -> str:
        return f"{field}.{name}" if field else name

    dtype = dtype_from_wire(msg.dtype, where("dtype"))
    numel = check_shape(msg.shape, where("shape"), max_elements)
    shape = list(msg.shape)
    data = msg.data
    expected = numel * dtype.itemsize
    if len(data) != expected:
        raise WireError(
            where("data"),
            f"has {len(data)} bytes, expected {expected} = prod({shape}) * {dtype.itemsize}",
        )
    if dtype == torch.bool and data.translate(None, b"\x00\x01"):
        raise WireError(where("data"), "bool tensor holds bytes other than 0 and 1")
    return dtype, shape, data


def numpy_view(msg: tensor_pb2.Tensor) -> numpy.ndarray | None:
    """A read-only flat numpy view of the tensor's bytes (no copy, not checked against its shape), or
    None for a dtype numpy has no match for (bfloat16)."""
    info = BY_WIRE.get(msg.dtype)
    if info is None or info.numpy is None:
        return None
    return numpy.frombuffer(msg.data, dtype=info.numpy)
