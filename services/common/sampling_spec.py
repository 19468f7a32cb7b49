"""What a caller asks of a generation engine: the sampling spec of one prompt, parsed and validated
from ``rlfleet.v1.SamplingParams`` fields by one set of rules.

The generation service applies them to each request; the collector to its configured sampling
and each prompt's overrides, so that a prompt a replica would refuse is refused when submitted.
Pure data: nothing here knows vLLM (``generation/sampling.py`` translates to it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.v1 import sampling_pb2

MIN_TEMPERATURE = 0.01
"""Smallest non-zero temperature: vLLM raises anything lower to 0.01 (or, below
1e-5, samples greedily), so the echoed temperature would not be the one sampled at."""
MAX_TEMPERATURE = 2.0
"""Largest temperature vLLM accepts."""
_FLOAT32_MIN_TEMPERATURE = float(numpy.float32(MIN_TEMPERATURE))
MAX_STOP_STRINGS = 16
"""Most stop strings per request: each one is matched against the text of every new token."""
MAX_STOP_STRING_CHARS = 1024
"""Longest stop string."""
MAX_STOP_TOKEN_IDS = 1024
"""Most stop token ids per request."""


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters of one prompt; ``n`` samples form one GRPO group.

    Behaviour log-probs are those of the distribution actually sampled from
    (temperature applied, top-p/top-k renormalised). A trainer that recomputes
    ``log_softmax(logits / T)`` matches them only with ``top_p=1`` and ``top_k=0``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """Seed of sample 0; sample i uses ``seed + i`` (vLLM's convention)."""
    ignore_eos: bool = False
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        """Temperature 0: every sample is the argmax continuation, so all ``n`` are identical."""
        return self.temperature == 0

    @property
    def computed_samples(self) -> int:
        """Samples vLLM computes: ``n``, or 1 when greedy (vLLM refuses ``n > 1`` at
        temperature 0; the engine hands the one sample back ``n`` times)."""
        return 1 if self.greedy else self.n

    def validate(self) -> None:
        """Raise InvalidArgument naming the first bad field."""
        if self.n < 1:
            raise InvalidArgument(f"sampling.n must be >= 1, got {self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(f"sampling.temperature must be >= 0, got {self.temperature}")
        # Compared at float32 precision: that is how the temperature travels (0.01 arrives as 0.0099999998).
        if not self.greedy and not _FLOAT32_MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidArgument(
                f"sampling.temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"sampling.top_k must be >= 0 (0 disables), got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidArgument(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgument(
                f"sampling.min_tokens must be in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens}"
            )
        check_stop_counts(len(self.stop), len(self.stop_token_ids))
        if any(not s for s in self.stop):
            raise InvalidArgument("sampling.stop must not contain empty strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidArgument(f"sampling.stop: strings may be at most {MAX_STOP_STRING_CHARS} characters long")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("sampling.stop_token_ids must be non-negative")


def sampling_from_proto(params: sampling_pb2.SamplingParams) -> SamplingSpec:
    """Proto defaults (0 = unset) -> the engine's SamplingSpec, validated."""
    check_stop_counts(len(params.stop), len(params.stop_token_ids))
    spec = SamplingSpec(
        n=params.n or 1,
        temperature=params.temperature,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        seed=params.seed if params.HasField("seed") else None,
        ignore_eos=params.ignore_eos,
    )
    spec.validate()
    return spec


def sampling_to_proto(spec: SamplingSpec) -> sampling_pb2.SamplingParams:
    """The effective sampling parameters, echoed with every sample."""
    params = sampling_pb2.SamplingParams(
        n=spec.n, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
        max_tokens=spec.max_tokens, min_tokens=spec.min_tokens, stop=list(spec.stop),
        stop_token_ids=list(spec.stop_token_ids), ignore_eos=spec.ignore_eos,
    )
    if spec.seed is not None:
        params.seed = spec.seed
    return params


def sampling_from_fields(fields: dict[str, Any], where: str = "sampling") -> SamplingSpec:
    """A mapping of SamplingParams fields (a config's ``sampling``, a prompt's overrides) -> the
    validated SamplingSpec, by the rules a replica applies to a request: InvalidArgument naming
    ``where`` and the field for an unknown field, a value of the wrong type or out of bounds."""
    params = sampling_pb2.SamplingParams()
    known = params.DESCRIPTOR.fields_by_name
    for name, value in fields.items():
        if name not in known:
            raise InvalidArgument(f"{where}: no field {name!r} (SamplingParams has {', '.join(known)})")
        try:
            params.MergeFrom(sampling_pb2.SamplingParams(**{name: value}))
        except (ValueError, TypeError) as exc:  # a value of the wrong type, or out of the field's range
            raise InvalidArgument(f"{where}.{name}: {exc}") from None
    try:
        return sampling_from_proto(params)
    except InvalidArgument as exc:
        message = str(exc)
        raise InvalidArgument(f"{where}{message[len('sampling'):]}" if message.startswith("sampling")
                              else f"{where}: {message}") from None


def check_stop_counts(stop_strings: int, stop_token_ids: int) -> None:
    """InvalidArgument if a request carries more stop strings or stop token ids than allowed
    (callers unpacking a message check the counts before listing the entries)."""
    if stop_strings > MAX_STOP_STRINGS:
        raise InvalidArgument(f"sampling.stop has {stop_strings} strings, at most {MAX_STOP_STRINGS} are allowed")
    if stop_token_ids > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"sampling.stop_token_ids has {stop_token_ids} ids, "
                              f"at most {MAX_STOP_TOKEN_IDS} are allowed")
