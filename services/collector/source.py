"""Where prompts come from: trainer-submitted prompts first, then a dataset.

A dataset (``dataset.py`` reads it) has a prompt field — a string, or a list
of chat messages ``{"role", "content"}`` — and optional ground-truth / reward
fields. Epochs, seeded shuffling and a resumable position (epoch, index) are
kept here; every prompt handed out is first written to the prompt ledger
(``ledger.py``), so a restarted collector generates it again. A row that is
not a prompt (``prompt_item.from_row`` says why) is dead-lettered with its
reason, the position moving past it in the same transaction, and the next
row follows. With the curriculum on, a row whose latest group passed all its samples or none is
skipped, the position moving past it (``filtering.py``). Nothing in this module knows gRPC.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import uuid
from typing import TYPE_CHECKING, Any

from rlfleet.services.collector.filtering import GroupOutcome, passed_all_or_none, revisit
from rlfleet.services.collector.prompt_item import PromptItem, from_row
from rlfleet.services.common.errors import InvalidArgument, ResourceExhausted

if TYPE_CHECKING:
    from rlfleet.services.collector.ledger import DeadLetter, PromptLedger

log = logging.getLogger("rlfleet.collector.source")


class PromptSource:
    """Prompts to generate: given back ones first (a restart's pending prompts, discarded groups),
    then submitted ones, then dataset rows in (seeded) shuffled epochs. Each is in the ledger
    before it is handed out; ``done`` / ``dead`` end it there."""

    def __init__(self, ledger: "PromptLedger", records: list[Any] | None = None, *,
                 prompt_field: str = "prompt", ground_truth_field: str = "answer", shuffle: bool = True,
                 seed: int = 0, epochs: int = 0, max_submitted: int = 10_000,
                 curriculum_revisit: float | None = None):
        self.ledger = ledger
        self._records = records or []
        self._prompt_field = prompt_field
        self._ground_truth_field = ground_truth_field
        self._shuffle = shuffle
        self._seed = seed
        self._epochs = epochs  # 0 = cycle forever
        self._max_submitted = max_submitted
        self._curriculum_revisit = curriculum_revisit
        """None: no curriculum; else the fraction of skippable rows drawn anyway."""
        self.curriculum_skipped = 0
        """Dataset rows the curriculum skipped since start."""
        self._submitted: collections.deque[PromptItem] = collections.deque()
        self._requeued: collections.deque[PromptItem] = collections.deque()
        self._replaced: set[int] = set()
        """Ledger rows ``regenerate`` replaced while their items were out: dropped when they come back."""
        self._restored: set[int] = set()
        """Ledger rows pending at the restart (``restore``) not yet ended: their groups may have been
        appended before it (``regenerate``)."""
        self._available = asyncio.Event()
        self.pending = 0
        """Prompts in the ledger: handed out or queued, not yet ended."""
        self.restored = False
        """Whether ``restore`` ran (a collector takes submissions only after it)."""
        self.bad_rows = 0
        """Dataset rows dead-lettered because they are not prompts (each once per epoch)."""
        self._check_some_row_is_a_prompt()
        self.epoch = 0
        self.index = 0
        self._order = self._epoch_order(0)
        if self._records or self._submitted:
            self._available.set()

    def _check_some_row_is_a_prompt(self) -> None:
        """A dataset none of whose rows is a prompt (the wrong ``prompt_field``?) is refused at once
        (dead-lettering row after row forever would only hide it); single bad rows are dead-lettered
        when their turn comes."""
        first_error = None
        for row, record in enumerate(self._records):
            try:
                from_row(record, f"dataset row {row}", self._prompt_field, self._ground_truth_field, f"row{row}")
                return
            except InvalidArgument as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise InvalidArgument(f"no row of the dataset is a prompt with prompt_field {self._prompt_field!r} "
                                  f"(e.g. {first_error})")

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._records)))
        if self._shuffle:
            random.Random(self._seed * 1_000_003 + epoch).shuffle(order)
        return order

    # --- resumable position -------------------------------------------------
    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, state: dict[str, int]) -> None:
        epoch, self.index = int(state.get("epoch", 0)), int(state.get("index", 0))
        if epoch != self.epoch:
            self.epoch, self._order = epoch, self._epoch_order(epoch)

    async def restore(self) -> int:
        """After a restart: the ledger's dataset position, and its pending prompts queued first
        (they were queued or generating when the collector stopped). Returns how many."""
        position = await self.ledger.position()
        if position is not None:
            self.load_state(position)
        pending = await self.ledger.pending()
        self.pending = len(pending)
        self._restored = {item.ledger_seq for item in pending}
        self._requeued.extend(pending)
        if pending:
            self._available.set()
        self.restored = True
        return len(pending)

    # --- input ----------------------------------------------------------------
    async def submit(self, items: list[PromptItem]) -> list[str]:
        """Queue trainer prompts, durably (all or nothing; RESOURCE_EXHAUSTED when full). A prompt id
        already pending is not queued again."""
        if len(self._submitted) + len(items) > self._max_submitted:
            raise ResourceExhausted(
                f"prompt queue full ({len(self._submitted)} queued, max {self._max_submitted})")
        for item in items:
            if not item.prompt_id:
                item.prompt_id = uuid.uuid4().hex
        added = await self.ledger.add(items)
        self.pending += len(added)
        self._submitted.extend(added)
        if added:
            self._available.set()
        return [item.prompt_id for item in items]

    def requeue(self, item: PromptItem) -> None:
        """Put back a pending prompt (its group was discarded, or failed and is retried), ahead of
        everything else; one whose row was replaced meanwhile is dropped (its new row is queued)."""
        if item.ledger_seq in self._replaced:
            self._ended(item)
            return
        self._requeued.append(item)
        self._available.set()

    async def done(self, item: PromptItem, retain_at_version: int | None = None,
                   outcome: GroupOutcome | None = None) -> None:
        """Its group was appended or filtered (see ``PromptLedger.done``)."""
        await self.ledger.done(item, retain_at_version, outcome)
        self._ended(item)

    async def regenerate(self, prompt_ids: list[str], unconfirmed: set[int] = frozenset()) -> list[str]:
        """Generate again the prompts of appended groups that were dropped stale, ahead of everything
        else; returns the prompt ids whose row was no longer kept (not generated again). A pending row
        whose group was appended (``unconfirmed``: its Append went out, its end is not yet written; or
        restored after a restart) is replaced (``PromptLedger.regenerate``): its item, queued, leaves
        the queue; out, it is dropped when it comes back (a late end of its row finds none)."""
        again, missing, replaced = await self.ledger.regenerate(prompt_ids, set(unconfirmed) | self._restored)
        self.pending += len(again)
        if replaced:
            self._replaced.update(replaced)
            self._restored.difference_update(replaced)
            for item in [item for item in self._requeued if item.ledger_seq in self._replaced]:
                self._requeued.remove(item)
                self._ended(item)
        for item in again:
            self.requeue(item)
        return missing

    def _ended(self, item: PromptItem) -> None:
        """``item`` left: ended in the ledger, or dropped as replaced."""
        self._replaced.discard(item.ledger_seq)
        self._restored.discard(item.ledger_seq)
        self.pending -= 1

    async def dead(self, item: PromptItem, stage: str, code: str, error: str) -> "DeadLetter":
        """It failed for good: a dead letter."""
        dead = await self.ledger.dead(item, stage, code, error)
        self._ended(item)
        return dead

    @property
    def queued(self) -> int:
        return len(self._submitted) + len(self._requeued)

    # --- output ---------------------------------------------------------------
    def _rows_ahead(self, limit: int) -> tuple[list[PromptItem] | InvalidArgument, dict[str, int]] | None:
        """The next dataset prompts — up to ``limit``, within this epoch, up to the first row that is
        not a prompt — or, when the very next row is not one, why; and the position after them (the
        source has not moved yet). None: no dataset row is left."""
        if not self._records or (self._epochs and self.epoch >= self._epochs):
            return None
        items: list[PromptItem] = []
        index = self.index
        while len(items) < limit and index < len(self._order):
            row = self._order[index]
            try:
                item = from_row(self._records[row], f"dataset row {row}", self._prompt_field,
                                self._ground_truth_field, default_id=f"row{row}")
            except InvalidArgument as refused:
                if items:
                    break  # the next draw dead-letters it
                return refused, self._position_after(index)
            index += 1
            if self._skipped_by_curriculum(item.prompt_id, row):
                continue
            item.dataset_key = item.prompt_id
            item.prompt_id = f"{item.prompt_id}@e{self.epoch}"
            items.append(item)
        return items, self._position_after(index - 1)

    def _skipped_by_curriculum(self, key: str, row: int) -> bool:
        recent = self.ledger.recent.get(key)
        if (self._curriculum_revisit is None or recent is None or not passed_all_or_none(*recent)
                or revisit(self._seed, self.epoch, row, self._curriculum_revisit)):
            return False
        self.curriculum_skipped += 1
        return True

    def _position_after(self, index: int) -> dict[str, int]:
        epoch, index = self.epoch, index + 1
        if index >= len(self._order):
            epoch, index = epoch + 1, 0
        return {"epoch": epoch, "index": index}

    async def _dead_row(self, refused: InvalidArgument, position: dict[str, int]) -> None:
        row = self._order[self.index]
        item = PromptItem(prompt_id=f"row{row}@e{self.epoch}")
        dead = await self.ledger.dead(item, "dataset", "INVALID_ARGUMENT", str(refused), position)
        self.load_state(position)
        self.bad_rows += 1
        log.error("dataset row is not a prompt, dead-lettered: %s", refused,
                  extra={"prompt_id": item.prompt_id, "dead_letter": dead.seq})

    async def next(self) -> PromptItem:
        """The next prompt, waiting for submissions when the dataset is exhausted or absent."""
        return (await self.take(1))[0]

    async def take(self, limit: int) -> list[PromptItem]:
        """The next prompts, at least one and at most ``limit``, in the order ``next`` would hand them
        out, waiting for submissions when the dataset is exhausted or absent. Dataset rows drawn
        together are written to the ledger in one transaction."""
        while True:
            items = [self._requeued.popleft() for _ in range(min(limit, len(self._requeued)))]
            items += [self._submitted.popleft() for _ in range(min(limit - len(items), len(self._submitted)))]
            if items:
                return items
            drawn = self._rows_ahead(limit)
            if drawn is not None:
                rows, position = drawn
                if isinstance(rows, InvalidArgument):
                    await self._dead_row(rows, position)
                    continue
                added = await self.ledger.add(rows, position)  # durable before they are handed out
                self.load_state(position)
                self.pending += len(added)
                if added:
                    return added
                continue  # all still pending from before a restart: they are queued already
            self._available.clear()
            await self._available.wait()
