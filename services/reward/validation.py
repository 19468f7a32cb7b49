"""Input checks shared by the reward math. Every failure names the field and the sample.

The reward service receives log-probs from two other services (generation and
reference); a length mismatch or a NaN there is a bug upstream that must surface
as ``InvalidArgument`` with enough detail to find the sample, never as a
silently wrong reward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlfleet.services.common.errors import InvalidArgument


def as_ragged(name: str, values: Sequence[Tensor]) -> list[Tensor]:
    """Check that ``values`` is a list of 1-D float tensors and return it as a list."""
    out = list(values)
    for index, row in enumerate(out):
        if not isinstance(row, Tensor) or row.ndim != 1:
            raise InvalidArgument(f"{name}: sample {index} must be a 1-D tensor")
        if not row.is_floating_point():
            raise InvalidArgument(f"{name}: sample {index} must be floating point, got {row.dtype}")
    return out


def check_same_lengths(
    name_a: str, rows_a: Sequence[Tensor], name_b: str, rows_b: Sequence[Tensor]
) -> None:
    """Two ragged sets must have the same number of samples and tokens per sample."""
    if len(rows_a) != len(rows_b):
        raise InvalidArgument(
            f"{name_a} has {len(rows_a)} samples but {name_b} has {len(rows_b)}"
        )
    for index, (row_a, row_b) in enumerate(zip(rows_a, rows_b)):
        if row_a.numel() != row_b.numel():
            raise InvalidArgument(
                f"sample {index}: {name_a} has {row_a.numel()} tokens "
                f"but {name_b} has {row_b.numel()}"
            )


def check_padded(
    log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor, *, log_probs_name: str = "log_probs"
) -> None:
    """Padded ``[B, T]`` log-prob sets and their mask must share one shape; the mask is bool."""
    if log_probs.ndim != 2:
        raise InvalidArgument(f"{log_probs_name} must be [batch, time], got shape {tuple(log_probs.shape)}")
    for name, tensor in (("ref_log_probs", ref_log_probs), ("mask", mask)):
        if tensor.shape != log_probs.shape:
            raise InvalidArgument(
                f"{name} has shape {tuple(tensor.shape)} but {log_probs_name} has "
                f"{tuple(log_probs.shape)}"
            )
    if mask.dtype != torch.bool:
        raise InvalidArgument(f"mask must be bool, got {mask.dtype}")
    if not log_probs.is_floating_point() or not ref_log_probs.is_floating_point():
        raise InvalidArgument("log-probs must be floating point")


def check_finite(name: str, values: Tensor, mask: Tensor | None = None) -> None:
    """Raise on the first NaN/inf in ``values`` (only where ``mask`` is set), naming its sample.

    ``values`` is ``[B, T]`` (or ``[B]``); padding outside the mask may hold anything.
    """
    bad = ~torch.isfinite(values)
    if mask is not None:
        bad &= mask
    if not bool(bad.any()):
        return
    where = bad.nonzero()[0].tolist()
    value = values[tuple(where)].item()
    if values.ndim == 1:
        raise InvalidArgument(f"sample {where[0]}: {name} is {value}")
    raise InvalidArgument(f"sample {where[0]}, token {where[1]}: {name} is {value}")


def check_finite_ragged(name: str, rows: Sequence[Tensor]) -> None:
    """Ragged twin of :func:`check_finite`."""
    for index, row in enumerate(rows):
        bad = (~torch.isfinite(row)).nonzero()
        if bad.numel():
            token = int(bad[0, 0])
            raise InvalidArgument(f"sample {index}, token {token}: {name} is {row[token].item()}")
