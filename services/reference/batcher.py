"""Micro-batching of concurrent score requests.

Many collector calls arrive at once, each with a handful of sequences. Running
each alone wastes the forward pass; the micro-batcher gathers the requests that
arrive within ``max_wait_ms`` of the first one (or until ``token_budget``
tokens are waiting), runs one :meth:`ReferenceScorer.score_validated` call in
a worker thread (the event loop keeps accepting requests meanwhile) and hands
every caller its own slice of the result.

Each request is validated in its caller before it joins a batch, so one bad
request fails alone. The queue is bounded (``max_queued_requests``,
``max_queued_tokens``): a request that does not fit is ResourceExhausted at
once. A failure of the forward pass is delivered to every caller of that
batch — never swallowed.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from rlfleet.services.common.errors import ResourceExhausted, Unavailable
from rlfleet.services.reference.scorer import ReferenceScorer, ReferenceScores, TokenSequence


@dataclass
class _Request:
    sequences: list[Tensor]
    response_starts: list[int]
    with_entropy: bool
    future: asyncio.Future[ReferenceScores]
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = sum(sequence.numel() for sequence in self.sequences)


class MicroBatcher:
    """Batch concurrent :meth:`score` calls into shared forward passes."""

    def __init__(
        self,
        scorer: ReferenceScorer,
        *,
        max_wait_ms: float | None = None,
        token_budget: int | None = None,
        max_queued_requests: int | None = None,
        max_queued_tokens: int | None = None,
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task] | None = None,
    ) -> None:
        """``spawn(coroutine, name)`` starts the batching loop (at the first call): the service's
        ``supervise``, so that a loop that dies fails the service; a plain task by default (its
        death still reaches every caller, see ``_on_loop_exit``)."""
        self.scorer = scorer
        self._spawn = spawn or (lambda coroutine, name: asyncio.get_running_loop().create_task(coroutine, name=name))
        self.max_wait = (scorer.config.max_wait_ms if max_wait_ms is None else max_wait_ms) / 1000
        self.token_budget = token_budget or scorer.config.token_budget
        self.max_queued_requests = max_queued_requests or scorer.config.max_queued_requests
        self.max_queued_tokens = max_queued_tokens or scorer.config.max_queued_tokens
        self.forward_calls = 0
        """Number of batched forward calls run so far (each may hold many requests)."""
        self._pending: collections.deque[_Request] = collections.deque()
        self._pending_tokens = 0
        self._in_flight: list[_Request] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        # One worker: forward passes run one at a time, off the event loop.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference-forward")

    async def score(
        self,
        sequences: Sequence[TokenSequence],
        response_starts: Sequence[int],
        with_entropy: bool = False,
    ) -> ReferenceScores:
        """Score like :meth:`ReferenceScorer.score`, sharing forward passes with concurrent callers."""
        if self._closed:
            raise Unavailable("reference scorer is shutting down")
        tokens = self.scorer.validate(sequences, response_starts)
        if not tokens:
            return ReferenceScores([], [] if with_entropy else None)
        self._ensure_running()
        future: asyncio.Future[ReferenceScores] = asyncio.get_running_loop().create_future()
        request = _Request(tokens, [int(start) for start in response_starts], with_entropy, future)
        self._admit(request)
        self._pending.append(request)
        self._pending_tokens += request.tokens
        assert self._wakeup is not None
        self._wakeup.set()
        return await future

    def check_size(self, sequences: int, tokens: int) -> None:
        """The scorer's ``check_size``: refuse an oversize request before it is split or copied."""
        self.scorer.check_size(sequences, tokens)

    async def aclose(self) -> None:
        """Stop the batching loop and fail whatever is still waiting with ``Unavailable``."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            # A loop that died was reported then (to its callers, and by ``spawn``): closing goes on.
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_all(Unavailable("reference scorer is shutting down"))
        # Let a forward pass already running finish in its thread; do not block the loop on it.
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> MicroBatcher:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ---------------------------------------------------------------- internals

    def _admit(self, request: _Request) -> None:
        """ResourceExhausted unless the queue has room (one request always fits an empty queue)."""
        if not self._pending:
            return
        if len(self._pending) >= self.max_queued_requests \
                or self._pending_tokens + request.tokens > self.max_queued_tokens:
            raise ResourceExhausted(
                f"reference queue full: {len(self._pending)} requests of {self._pending_tokens} tokens waiting "
                f"(max_queued_requests={self.max_queued_requests}, max_queued_tokens={self.max_queued_tokens}); "
                f"retry later")

    def _ensure_running(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = self._spawn(self._run(), "the reference micro-batcher")
            self._task.add_done_callback(self._on_loop_exit)
        elif self._task.done():
            raise self._stopped(self._task)

    @staticmethod
    def _stopped(task: asyncio.Task[None]) -> Unavailable:
        """What a caller hears once the loop ended: cancelled (shutdown) or died, naming why."""
        cause = None if task.cancelled() else task.exception()
        if cause is None:
            return Unavailable("reference micro-batcher stopped")
        error = Unavailable(f"reference micro-batcher died: {type(cause).__name__}: {cause}")
        error.__cause__ = cause
        return error

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        # The loop only ends by cancellation or by a bug; either way nobody may wait forever.
        self._fail_all(self._stopped(task))

    def _fail_all(self, error: Exception) -> None:
        for request in [*self._in_flight, *self._pending]:
            if not request.future.done():
                request.future.set_exception(error)
        self._in_flight = []
        self._pending.clear()
        self._pending_tokens = 0

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            while not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            deadline = loop.time() + self.max_wait
            while self._pending_tokens < self.token_budget and (remaining := deadline - loop.time()) > 0:
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    break
            self._in_flight = self._take_batch()
            await self._run_batch(loop, self._in_flight)
            self._in_flight = []

    def _take_batch(self) -> list[_Request]:
        """Pop requests up to the token budget (always at least one); skip cancelled callers."""
        batch: list[_Request] = []
        tokens = 0
        while self._pending and (not batch or tokens + self._pending[0].tokens <= self.token_budget):
            request = self._pending.popleft()
            self._pending_tokens -= request.tokens
            if request.future.done():
                continue
            batch.append(request)
            tokens += request.tokens
        return batch

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_Request]) -> None:
        if not batch:
            return
        sequences = [sequence for request in batch for sequence in request.sequences]
        starts = [start for request in batch for start in request.response_starts]
        with_entropy = any(request.with_entropy for request in batch)
        self.forward_calls += 1
        try:
            scores = await loop.run_in_executor(
                self._executor, self.scorer.score_validated, sequences, starts, with_entropy
            )
        except Exception as exc:  # delivered to every caller of this batch, not hidden
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(exc)
            return
        offset = 0
        for request in batch:
            count = len(request.sequences)
            entropies = None
            if request.with_entropy and scores.entropies is not None:
                entropies = scores.entropies[offset : offset + count]
            if not request.future.done():
                log_probs = scores.log_probs[offset : offset + count]
                request.future.set_result(ReferenceScores(log_probs, entropies))
            offset += count
