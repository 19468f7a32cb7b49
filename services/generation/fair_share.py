"""A replica's batch shared between the runs whose calls it serves, by weight (start-time fair queuing).

The batch is ``capacity`` sequences (vLLM's ``max_num_seqs``: vLLM runs no more at once). A ``generate``
call takes one per sample it computes, and gives each back as that sample finishes. While the batch has
room a call goes straight in, whatever its run; once it is full, calls wait here instead of in vLLM's
first-come queue, and each time sequences come back the waiting call with the smallest start tag goes in.

Tags are those of start-time fair queuing (Goyal, Vin and Cheng, 1996): a call of run ``r`` costing ``c``
(sampled tokens it may produce: computed samples x max_tokens) at weight ``w`` starts at
``S = max(V, F[r])`` and moves the run's finish tag to ``F[r] = S + c / w``; ``V`` is the start tag of the
call that went in last. So while several runs wait, each gets sequences in proportion to its weight; a
run with nothing waiting leaves its share to the others (the scheduler is work-conserving), and a run
that comes back after idling starts at ``V``, with no credit saved up: one run's backlog of thousands
of calls never keeps another's next call waiting behind more than one call of each other run. Within a
run calls go in the order they came.

A call larger than the whole batch goes in alone once the batch is empty. Knows nothing of vLLM or gRPC.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(order=True)
class _Waiting:
    start: float
    order: int
    run_id: str = field(compare=False)
    sequences: int = field(compare=False)
    granted: asyncio.Future = field(compare=False)
    gone: bool = field(default=False, compare=False)
    """Cancelled while waiting: skipped when it comes to the head (removal in O(log n), not O(n))."""


class Lease:
    """The sequences one call holds; each ``release``d as a sample finishes, the rest when it ends."""

    def __init__(self, share: FairShare, sequences: int) -> None:
        self._share = share
        self.held = sequences

    def release(self, sequences: int = 1) -> None:
        sequences = min(sequences, self.held)
        if sequences > 0:
            self.held -= sequences
            self._share._give_back(sequences)

    def close(self) -> None:
        self.release(self.held)


class FairShare:
    """The batch's sequences, shared between runs by weight (see the module)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.in_use = 0
        self._virtual_time = 0.0
        self._finish: dict[str, float] = {}
        """Each run's finish tag; a run whose tag is behind ``V`` is forgotten (it starts at V anyway)."""
        self._waiting: list[_Waiting] = []
        self._order = itertools.count()
        self.waiting_by_run: dict[str, int] = {}

    async def acquire(self, run_id: str, weight: float, sequences: int, cost: float) -> Lease:
        """A lease of ``sequences`` for a call of ``run_id`` costing ``cost`` at ``weight`` (> 0), once its
        turn comes; cancelled while waiting, it takes nothing."""
        start = max(self._virtual_time, self._finish.get(run_id, 0.0))
        self._finish[run_id] = start + cost / weight
        if self._head() is None and self._fits(sequences):
            self._grant(start, sequences)
            return Lease(self, sequences)
        waiter = _Waiting(start, next(self._order), run_id, sequences, asyncio.get_running_loop().create_future())
        heapq.heappush(self._waiting, waiter)
        self.waiting_by_run[run_id] = self.waiting_by_run.get(run_id, 0) + 1
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._give_back(sequences)  # granted as it was cancelled: the sequences go to the next
            else:
                self._remove(waiter)
            raise
        return Lease(self, sequences)

    def _fits(self, sequences: int) -> bool:
        return self.in_use + sequences <= self.capacity or self.in_use == 0

    def _grant(self, start: float, sequences: int) -> None:
        self.in_use += sequences
        self._virtual_time = max(self._virtual_time, start)
        self._forget_idle_runs()

    def _head(self) -> _Waiting | None:
        """The waiting call with the smallest start tag (those cancelled dropped on the way)."""
        while self._waiting and self._waiting[0].gone:
            heapq.heappop(self._waiting)
        return self._waiting[0] if self._waiting else None

    def _give_back(self, sequences: int) -> None:
        self.in_use -= sequences
        while (waiter := self._head()) is not None and self._fits(waiter.sequences):
            heapq.heappop(self._waiting)
            self._count_out(waiter.run_id)
            self._grant(waiter.start, waiter.sequences)
            waiter.granted.set_result(None)

    def _remove(self, waiter: _Waiting) -> None:
        waiter.gone = True
        self._count_out(waiter.run_id)
        self._give_back(0)  # the call it held back may go in now

    def _count_out(self, run_id: str) -> None:
        left = self.waiting_by_run[run_id] - 1
        if left:
            self.waiting_by_run[run_id] = left
        else:
            del self.waiting_by_run[run_id]

    def _forget_idle_runs(self) -> None:
        """Finish tags at or behind V say nothing ``max(V, F)`` does not: bounded by the runs busy now."""
        if len(self._finish) > 2 * len(self.waiting_by_run) + 16:
            self._finish = {run: tag for run, tag in self._finish.items() if tag > self._virtual_time}
