"""What the engine gets back (SampleResult), and a SamplingSpec in vLLM's terms.

The spec itself and its rules live in ``services/common/sampling_spec.py`` (the collector checks
prompts by them too); this module holds what only an engine running vLLM needs. Nothing here
starts an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rlfleet.services.common.sampling_spec import SamplingSpec

if TYPE_CHECKING:
    from vllm import SamplingParams

FinishReason = Literal["stop", "length", "abort"]
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}


def to_vllm(spec: SamplingSpec) -> SamplingParams:
    """vLLM SamplingParams streaming deltas with the sampled token's log-prob,
    for ``spec.computed_samples`` samples."""
    # From the defining module: ``from vllm import`` goes through vLLM's lazy __getattr__ on every call.
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        n=spec.computed_samples,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        max_tokens=spec.max_tokens,
        min_tokens=spec.min_tokens,
        stop=list(spec.stop) or None,
        stop_token_ids=list(spec.stop_token_ids) or None,
        seed=spec.seed,
        ignore_eos=spec.ignore_eos,
        # logprobs=0: only the sampled token's log-prob, no top-k alternatives.
        logprobs=0,
        flat_logprobs=True,
        # Text is never needed here (work stays on token ids) except to
        # match stop strings.
        detokenize=bool(spec.stop),
        # DELTA lets each of the n samples be reported as soon as it
        # finishes; FINAL_ONLY would hold the group until the slowest one.
        output_kind=RequestOutputKind.DELTA,
    )


@dataclass(frozen=True)
class SampleTiming:
    """Wall-clock seconds, all measured from the ``generate`` call."""

    queue_seconds: float
    """Until the request was handed to vLLM (waits out a weight swap)."""
    first_token_seconds: float | None
    """Until this sample's first token (None if it produced none)."""
    total_seconds: float
    """Until this sample finished."""


@dataclass(frozen=True)
class SampleResult:
    """One finished sample of a group."""

    request_id: str
    index: int
    """Index of the sample within its group, in ``[0, n)``."""
    prompt_length: int
    response_token_ids: list[int]
    behavior_log_probs: list[float]
    """Log-prob of each sampled token under the sampling distribution (float32
    precision), one per response token."""
    finish_reason: FinishReason
    stop_reason: int | str | None
    """The stop string or stop token id that ended the sample, if any."""
    policy_version_start: int
    """Policy version that sampled the first response token."""
    policy_version_end: int
    """Policy version that sampled the last response token."""
    policy_version_spans: list[tuple[int, int, int]]
    """``(policy_version, start, end)``: response tokens ``[start, end)`` were
    sampled by that version. More than one span when weights changed in flight."""
    timing: SampleTiming
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV came from vLLM's prefix cache (a turn's history computed before)."""


@dataclass
class SampleAccumulator:
    """Collects the streamed deltas of one sample until it finishes."""

    index: int
    response_token_ids: list[int] = field(default_factory=list)
    behavior_log_probs: list[float] = field(default_factory=list)
    first_token_at: float | None = None
    earlier_spans: list[tuple[int, int, int]] = field(default_factory=list)
    """Versions of the tokens sampled by earlier vLLM requests of this sample (``resume`` swaps)."""
    request_start: int = 0
    """Tokens sampled before the current vLLM request of this sample."""

    def add(self, token_ids: Sequence[int], flat_log_probs, now: float) -> None:
        """Append one delta: new token ids and vLLM's FlatLogprobs for them."""
        if not token_ids:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        self.response_token_ids.extend(token_ids)
        self.behavior_log_probs.extend(sampled_log_probs(token_ids, flat_log_probs))

    def spans(self, weight_versions) -> list[tuple[int, int, int]]:
        """``(version, start, end)`` over every token so far: the earlier requests' spans, then the
        current request's (vLLM's ``weight_versions``, counted from that request's first token)
        shifted by the tokens before it; adjacent spans of one version merge."""
        spans = list(self.earlier_spans)
        for span in weight_versions or []:
            version, start, end = int(span.version), span.start + self.request_start, span.end + self.request_start
            if spans and spans[-1][0] == version and spans[-1][2] == start:
                spans[-1] = (version, spans[-1][1], end)
            else:
                spans.append((version, start, end))
        return spans

    def continue_after(self, weight_versions) -> int:
        """The current request ended unfinished (``weight_versions``: its spans); a new request
        continues the sample. Returns the tokens sampled so far, the continuation's prompt suffix."""
        self.earlier_spans = self.spans(weight_versions)
        self.request_start = len(self.response_token_ids)
        return self.request_start


def finished_sample(request_id: str, prompt_length: int, sample: SampleAccumulator, completion: Any,
                    versions: tuple[int, int], times: tuple[float, float, float],
                    cached_prompt_tokens: int | None = None, weight_versions: Any = None) -> SampleResult:
    """The result of a sample vLLM reports finished (``completion``: its last CompletionOutput; the
    version spans of a resumed sample are stitched across its requests, ``SampleAccumulator.spans``).

    ``weight_versions``: the request's version spans when not vLLM's (a request pinned to a LoRA
    adapter). ``versions``: the policy version at submission and now; ``times``: monotonic
    clock at the call, at submission to vLLM, and now; ``cached_prompt_tokens``:
    the request's prefix-cache hit (vLLM's ``num_cached_tokens``)."""
    finish_reason = _FINISH_REASONS.get(completion.finish_reason)
    if finish_reason is None:
        # vLLM's "error": an internal, request-level failure.
        raise RuntimeError(f"vLLM finished request {request_id} sample {sample.index} with {completion.finish_reason!r}")
    version_at_submit, version_now = versions
    called_at, submitted_at, now = times
    # vLLM labels output tokens with the engine's weight version; a sample
    # without tokens (aborted while queued) falls back to our own clock.
    spans = sample.spans(weight_versions if weight_versions is not None else completion.weight_versions)
    return SampleResult(
        request_id=request_id,
        index=sample.index,
        prompt_length=prompt_length,
        response_token_ids=sample.response_token_ids,
        behavior_log_probs=sample.behavior_log_probs,
        finish_reason=finish_reason,
        stop_reason=completion.stop_reason,
        policy_version_start=spans[0][0] if spans else version_at_submit,
        policy_version_end=spans[-1][0] if spans else version_now,
        policy_version_spans=spans,
        timing=SampleTiming(
            queue_seconds=submitted_at - called_at,
            first_token_seconds=None if sample.first_token_at is None else sample.first_token_at - called_at,
            total_seconds=now - called_at,
        ),
        cached_prompt_tokens=cached_prompt_tokens or 0,
    )


def sampled_log_probs(token_ids: Sequence[int], flat_log_probs) -> list[float]:
    """The sampled token's log-prob at each position of a FlatLogprobs.

    With ``logprobs=0`` vLLM returns exactly one entry per position — the
    sampled token — at ``start_indices[i]``; anything else means the request
    was built wrongly, so it fails loudly rather than misaligning.
    """
    if flat_log_probs is None or len(flat_log_probs) != len(token_ids):
        got = None if flat_log_probs is None else len(flat_log_probs)
        raise RuntimeError(f"vLLM returned {got} log-prob positions for {len(token_ids)} tokens")
    # Runs for every delta of every sample: whole-list operations, no per-position Python loop.
    starts = flat_log_probs.start_indices
    entry_token_ids = flat_log_probs.token_ids
    sampled = [entry_token_ids[entry] for entry in starts]
    if sampled != list(token_ids):
        position = next(i for i, (got, want) in enumerate(zip(sampled, token_ids)) if got != want)
        raise RuntimeError(f"vLLM log-prob entry {position} is for token {sampled[position]}, "
                           f"sampled {token_ids[position]}")
    log_probs = flat_log_probs.logprobs
    return [log_probs[entry] for entry in starts]
