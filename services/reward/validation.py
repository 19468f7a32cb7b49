"""Input checks shared by the reward math. Every failure names the field and the sample.

The reward service receives log-probs from two other services (generation and
reference); a length mismatch or a NaN there is a bug upstream that must surface
as ``InvalidArgument`` with enough detail to find the sample, never as a
silently wrong reward.

Size bounds come first (:func:`check_ragged_size`, :func:`check_texts`,
:func:`check_task`): they read only counts and lengths of the message, so a request
too large for this service is refused before anything is decoded or allocated.
Over a bound is ``ResourceExhausted`` (the request is well-formed, just larger than
the configured limit) naming the field, the sample and the config field.
:func:`check_environment_rewards` runs with them (plain numbers of the message): a count or
value no batch could take is ``InvalidArgument``.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rlfleet.services.common.errors import InvalidArgument, ResourceExhausted

if TYPE_CHECKING:
    from rlfleet.services.reward.config import RewardServiceConfig

FLOAT32_MAX = float(torch.finfo(torch.float32).max)

MAX_ECHO_CHARS = 200
"""Caller-supplied text quoted in an error message is cut to this: a status message travels in
gRPC trailers, which are size-limited."""


def shorten(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters (never raises)."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"<int of {value.bit_length()} bits>"  # repr of a huge int is slow, or refused past 4300 digits
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a user object's broken __repr__ must not replace the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit - 15]}... ({len(text)} chars)"


def describe_exception(exc: BaseException) -> str:
    """``"ValueError: message"``, the message cut like :func:`shorten`."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - same reason as in shorten
        message = ""
    if len(message) > MAX_ECHO_CHARS:
        message = f"{message[:MAX_ECHO_CHARS - 15]}... ({len(message)} chars)"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


# ------------------------------------------------------------- request size


def check_count(name: str, count: int, config: RewardServiceConfig) -> None:
    """A per-sample list (samples, tasks, texts, group ids) holds at most ``max_samples_per_request``."""
    if count > config.max_samples_per_request:
        raise ResourceExhausted(
            f"{name} has {count} entries, over max_samples_per_request={config.max_samples_per_request}")


def check_ragged_size(
    name: str, lengths: Sequence[int], value_dims: int | None, config: RewardServiceConfig
) -> None:
    """Bounds of one ragged field, from its lengths alone: samples, tokens per sample, tokens in all.

    ``value_dims`` is the number of dims of the flat values tensor (one entry per token: 1-D);
    ``None`` when it is absent, which the wire decoder reports.
    """
    check_count(f"{name}.lengths", len(lengths), config)
    if value_dims is not None and value_dims != 1:
        raise InvalidArgument(f"{name}.values must be 1-D (one entry per token), got {value_dims} dims")
    total = 0
    for index, length in enumerate(lengths):
        if length > config.max_tokens_per_sample:
            raise ResourceExhausted(f"sample {index}: {name} has {length} tokens, over "
                                    f"max_tokens_per_sample={config.max_tokens_per_sample}")
        total += max(length, 0)  # a negative length is refused by the wire decoder, naming it
    if total > config.max_tokens_per_request:
        raise ResourceExhausted(f"{name} holds {total} tokens, over "
                                f"max_tokens_per_request={config.max_tokens_per_request}")


def check_texts(name: str, texts: Sequence[str], config: RewardServiceConfig) -> None:
    """Prompt or response texts: at most one per sample, each at most ``max_text_chars``."""
    check_count(name, len(texts), config)
    for index, text in enumerate(texts):
        if len(text) > config.max_text_chars:
            raise ResourceExhausted(f"sample {index}: {name} has {len(text)} characters, over "
                                    f"max_text_chars={config.max_text_chars}")


def check_task(index: int, ground_truth: str, args: Mapping[str, str], config: RewardServiceConfig) -> None:
    """One ``Task``: ground truth length, number of args, length of each arg name and value."""
    if len(ground_truth) > config.max_ground_truth_chars:
        raise ResourceExhausted(f"tasks[{index}].ground_truth has {len(ground_truth)} characters, over "
                                f"max_ground_truth_chars={config.max_ground_truth_chars}")
    if len(args) > config.max_args_per_task:
        raise ResourceExhausted(f"tasks[{index}].args has {len(args)} entries, over "
                                f"max_args_per_task={config.max_args_per_task}")
    for key, value in args.items():
        longest = max(len(key), len(value))
        if longest > config.max_arg_chars:
            raise ResourceExhausted(f"tasks[{index}].args[{shorten(key, 40)}] has {longest} characters, over "
                                    f"max_arg_chars={config.max_arg_chars}")


def check_environment_rewards(values: Sequence[float], batch_size: int) -> None:
    """``environment_rewards``: one per sample or none (0 for each); each finite and within float32's
    range, since the score it is added to is float32 (a larger value would become inf there).

    Reads the plain numbers of the message: checked with the size bounds, before anything is decoded.
    """
    if values and len(values) != batch_size:
        raise InvalidArgument(f"environment_rewards has {len(values)} entries for {batch_size} samples: "
                              "send one per sample or none")
    for index, value in enumerate(values):
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            raise InvalidArgument(f"sample {index}: environment_rewards is {value}, expected a finite number "
                                  f"within float32's range (|x| <= {FLOAT32_MAX:.4g})")


# ------------------------------------------------------------- tensors


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


def check_finite_tokens(name: str, values: Tensor, lengths: Sequence[int], mask: Tensor | None = None) -> None:
    """Flat twin of :func:`check_finite`: ``values`` is ``[N]``, the samples' tokens back to back
    (``lengths`` tokens each); the first NaN/inf where ``mask`` is set names its sample and token."""
    bad = ~torch.isfinite(values)
    if mask is not None:
        bad &= mask
    if not bool(bad.any()):
        return
    position = int(bad.nonzero()[0, 0])
    sample, token = locate(position, lengths)
    raise InvalidArgument(f"sample {sample}, token {token}: {name} is {values[position].item()}")


def locate(position: int, lengths: Sequence[int]) -> tuple[int, int]:
    """``(sample, token)`` of flat ``position`` when samples of ``lengths`` tokens lie back to back."""
    ends = list(itertools.accumulate(lengths))
    sample = bisect.bisect_right(ends, position)
    return sample, position - (ends[sample - 1] if sample else 0)
