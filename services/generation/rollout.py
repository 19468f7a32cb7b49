"""One ``generate`` call inside vLLM: its request and, after ``resume`` swaps, the continuations
of its unfinished samples, read back as one stream of finished samples.

Without a ``resume`` swap this is one vLLM request read directly, as before. A ``resume`` swap
aborts it; each unfinished sample then goes on as its own request (``resume.continuation_spec``)
and its tokens, behaviour log-probs and version spans are appended to what it had, so the caller
sees one sample finish normally. Knows nothing of gRPC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Protocol

from rlfleet.services.common.errors import Unavailable
from rlfleet.services.common.sampling_spec import SamplingSpec
from rlfleet.services.generation.resume import continuation_spec, resume_blocker
from rlfleet.services.generation.sampling import SampleAccumulator, SampleResult, finished_sample, to_vllm


class RolloutHost(Protocol):
    """What a Rollout needs of its engine (GenerationEngine)."""

    @property
    def policy_version(self) -> int: ...

    async def open_stream(self, prompt_token_ids: list[int], params: Any, request_id: str,
                          required_version: int | None = None) -> tuple[AsyncGenerator[Any, None], int, int | None]: ...

    def resumes(self, swap_serial: int) -> bool: ...

    def count_tokens(self, num_tokens: int, now: float, first: bool) -> None: ...

    def count_resume(self, carried_tokens: int) -> None: ...


class Rollout:
    """The vLLM requests of one ``generate`` call, read as finished samples."""

    def __init__(self, host: RolloutHost, prompt_token_ids: Sequence[int], sampling: SamplingSpec,
                 request_id: str, called_at: float, required_version: int | None = None) -> None:
        self._host = host
        self._prompt = list(prompt_token_ids)
        self._sampling = sampling
        self._request_id = request_id
        self._called_at = called_at
        self._submitted_at = called_at
        self._version_at_submit = host.policy_version
        self._cached_prompt_tokens: int | None = 0
        self._required_version = required_version
        """The version every sample must run on (None: any): a rolling update's pin. Such a call is never
        continued on other weights, so a swap ends its samples with "abort"."""
        self._resumable = resume_blocker(sampling) is None and required_version is None
        self._samples: dict[int, SampleAccumulator] = {}
        # vLLM request id -> (the sample it continues, None for the call's own request; swap serial at
        # submission; the version of the LoRA adapter it is pinned to, None without one)
        self._requests: dict[str, tuple[int | None, int, int | None]] = {}
        self._streams = StreamSet()
        self._continuations = 0
        self.running = False
        """A token has arrived."""

    async def samples(self) -> AsyncIterator[SampleResult]:
        """Each finished sample as soon as it finishes (``n`` copies of the one sample when greedy).
        Closing this iterator aborts every vLLM request of the call still running."""
        # Greedy: vLLM computes one sample, and it is every one of the n.
        copies = self._sampling.n // self._sampling.computed_samples
        try:
            await self._submit(self._request_id, self._prompt, self._sampling, None)
            self._submitted_at = time.monotonic()
            self._version_at_submit = self._host.policy_version
            while self._streams:
                request_id, output = await self._streams.next()
                if output is None:
                    del self._requests[request_id]
                    continue
                finished, aborted = self._absorb(request_id, output)
                for result in finished:
                    for copy in _copies(result, copies):
                        yield copy
                for sample, completion, versions in aborted:
                    if (result := await self._continue(sample, completion, versions)) is not None:
                        for copy in _copies(result, copies):
                            yield copy
        finally:
            await self._streams.aclose()

    async def _submit(self, request_id: str, prompt: list[int], sampling: SamplingSpec, sample: int | None) -> None:
        stream, serial, pinned = await self._host.open_stream(prompt, to_vllm(sampling), request_id,
                                                              self._required_version)
        self._requests[request_id] = (sample, serial, pinned)
        self._streams.add(request_id, stream)

    def _absorb(self, request_id: str, output: Any) -> tuple[list[SampleResult],
                                                             list[tuple[SampleAccumulator, Any, Any]]]:
        """One output of one request (once per engine step: keep it small): the samples it finished,
        and those a ``resume`` swap aborted, to continue."""
        continued, serial, pinned = self._requests[request_id]
        if continued is None:
            # A continuation's prompt includes sampled tokens: report the call's own prefix-cache hit.
            self._cached_prompt_tokens = output.num_cached_tokens
        now = time.monotonic()
        new_tokens = 0
        finished, aborted = [], []
        for completion in output.outputs:
            index = completion.index if continued is None else continued
            sample = self._samples.get(index)
            if sample is None:
                sample = self._samples[index] = SampleAccumulator(index=index)
            if completion.token_ids:
                sample.add(completion.token_ids, completion.logprobs, now)
                new_tokens += len(completion.token_ids)
            if completion.finish_reason is None:
                continue
            versions = _pinned_spans(sample, pinned) if pinned is not None else completion.weight_versions
            if completion.finish_reason == "abort" and self._resumable and self._host.resumes(serial):
                aborted.append((sample, completion, versions))
            else:
                finished.append(self._result(sample, completion, now, versions))
        if new_tokens:
            self._host.count_tokens(new_tokens, now, first=not self.running)
            self.running = True
        return finished, aborted

    async def _continue(self, sample: SampleAccumulator, completion: Any, versions: Any) -> SampleResult | None:
        """Submit the continuation of ``sample`` once the swap is over; if the engine cannot take it
        (the swap failed, shutdown), the sample's result with "abort"."""
        sampled = len(sample.response_token_ids)
        spec = continuation_spec(self._sampling, sample.index, sampled)
        self._continuations += 1
        try:
            await self._submit(f"{self._request_id}/resume-{self._continuations}",
                               self._prompt + sample.response_token_ids, spec, sample.index)
        except Unavailable:
            return self._result(sample, completion, time.monotonic(), versions)
        sample.continue_after(versions)
        self._host.count_resume(sampled)
        return None

    def _result(self, sample: SampleAccumulator, completion: Any, now: float, versions: Any) -> SampleResult:
        return finished_sample(
            self._request_id, len(self._prompt), sample, completion,
            (self._version_at_submit, self._host.policy_version), (self._called_at, self._submitted_at, now),
            self._cached_prompt_tokens, versions,
        )


@dataclasses.dataclass(frozen=True)
class _Span:
    version: int
    start: int
    end: int


def _pinned_spans(sample: SampleAccumulator, version: int) -> list[_Span]:
    """A request pinned to an adapter: every token it sampled is that version's (vLLM's labels follow
    the engine's weights, not the request's adapter), counted from the request's first token."""
    tokens = len(sample.response_token_ids) - sample.request_start
    return [_Span(version, 0, tokens)] if tokens else []


def _copies(result: SampleResult, copies: int) -> list[SampleResult]:
    return [dataclasses.replace(result, index=index) if index else result for index in range(copies)]


_END = object()


async def _read(stream: AsyncGenerator[Any, None]) -> Any:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _END


class StreamSet:
    """vLLM output streams read as one: the next output of whichever has one.

    One stream (no resume swap so far) is read directly. With more, each stream gets a task that
    forwards its outputs to one queue: one task per stream for its life, not one per engine step."""

    def __init__(self) -> None:
        self._streams: dict[str, AsyncGenerator[Any, None]] = {}
        self._pumps: dict[str, asyncio.Task] = {}
        self._outputs: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def __bool__(self) -> bool:
        return bool(self._streams)

    def add(self, key: str, stream: AsyncGenerator[Any, None]) -> None:
        self._streams[key] = stream

    async def next(self) -> tuple[str, Any]:
        """``(key, output)``; ``(key, None)`` when that stream ended (it leaves the set). A stream's
        error is raised here."""
        if len(self._streams) == 1 and not self._pumps:
            key, stream = next(iter(self._streams.items()))
            output = await _read(stream)
        else:
            for key, stream in self._streams.items():
                if key not in self._pumps:
                    self._pumps[key] = asyncio.create_task(self._pump(key, stream))
            key, output = await self._outputs.get()
            if isinstance(output, BaseException):
                raise output
        if output is _END:
            del self._streams[key]
            self._pumps.pop(key, None)
            return key, None
        return key, output

    async def _pump(self, key: str, stream: AsyncGenerator[Any, None]) -> None:
        try:
            while (output := await _read(stream)) is not _END:
                self._outputs.put_nowait((key, output))
            self._outputs.put_nowait((key, _END))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            self._outputs.put_nowait((key, exc))

    async def aclose(self) -> None:
        """Close every stream: vLLM aborts each request still running."""
        pumps, self._pumps = self._pumps, {}
        for task in pumps.values():
            task.cancel()  # a cancelled read aborts its request inside vLLM's generate
        await asyncio.gather(*pumps.values(), return_exceptions=True)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            await stream.aclose()
