"""The ``resume`` swap's rules: which samples can be continued after a swap, and with what.

A ``resume`` swap aborts every in-flight vLLM request (``pause_generation(mode="abort")``),
loads the new weights, and the engine continues each unfinished sample as a new vLLM request:
prompt = the original prompt token ids + the tokens that sample sampled so far (no
re-tokenization), ``n=1``, under the new weights, which re-prefill the whole prefix. What carries
over exactly and what does not (SamplingSpec's fields, vLLM 0.32):

- per-token rules (temperature, top-p, top-k, stop token ids, EOS, ``ignore_eos``): exact;
- ``max_tokens`` and ``min_tokens``: the budget left, ``max_tokens - sampled`` and
  ``max(0, min_tokens - sampled)``, exact;
- ``seed``: not the stream an unswapped run draws (vLLM's per-request generator starts afresh
  with the new request). A sample that sampled nothing yet keeps vLLM's own ``seed + index``; one
  with ``k`` tokens continues with ``continuation_seed``, a hash of ``(seed, index, k)``:
  reproducible for the same swap point, and not the stream of a sibling sample;
- stop strings: vLLM matches them in the text of a request's own output, so a stop string that
  starts before the boundary and ends after it would be missed. A request with stop strings is
  not resumed: its unfinished samples finish with "abort", as under an ``abort`` swap (the
  collector regenerates them).

SamplingSpec carries no presence/frequency/repetition penalties, logit biases, logits processors
or structured outputs; any added later must be judged here (penalties on output tokens would count
only the continuation's).
"""

from __future__ import annotations

import dataclasses
import hashlib

from rlfleet.services.common.sampling_spec import SamplingSpec

_SEED_BITS = 63


def resume_blocker(spec: SamplingSpec) -> str | None:
    """Why a request with ``spec`` cannot be resumed exactly (its samples then finish with
    "abort" at a ``resume`` swap), or None."""
    if spec.stop:
        return "stop strings are matched in one vLLM request's own output text"
    return None


def continuation_spec(spec: SamplingSpec, index: int, sampled: int) -> SamplingSpec:
    """Sampling of the request that continues sample ``index`` of a ``spec`` request after
    ``sampled`` tokens: one sample, the token budget left."""
    if not 0 <= sampled < spec.max_tokens:
        raise ValueError(f"a sample with {sampled} of max_tokens={spec.max_tokens} tokens cannot be continued")
    return dataclasses.replace(
        spec, n=1, max_tokens=spec.max_tokens - sampled, min_tokens=max(0, spec.min_tokens - sampled),
        seed=continuation_seed(spec.seed, index, sampled))


def continuation_seed(seed: int | None, index: int, sampled: int) -> int | None:
    """Seed of the continuation of sample ``index`` after ``sampled`` tokens: None stays None,
    nothing sampled yet keeps vLLM's ``seed + index``, otherwise 63 bits of a hash of all three."""
    if seed is None:
        return None
    if sampled == 0:
        return seed + index
    digest = hashlib.blake2b(f"{seed}:{index}:{sampled}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)
