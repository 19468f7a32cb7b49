"""Where prompts come from: trainer-submitted prompts first, then a dataset.

A dataset is a JSONL or Parquet file (or a Hugging Face ``datasets`` directory
saved with ``save_to_disk``) with a prompt field — a string, or a list of chat
messages ``{"role", "content"}`` — and optional ground-truth / reward fields.
Epochs, seeded shuffling and a resumable position (epoch, index) are kept
here; every prompt handed out is first written to the prompt ledger
(``ledger.py``), so a restarted collector generates it again. Nothing in this
module knows gRPC.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.services.common.errors import InvalidArgument, ResourceExhausted

if TYPE_CHECKING:
    from rlfleet.services.collector.ledger import DeadLetter, PromptLedger


@dataclass
class PromptItem:
    """One prompt and how to score it."""

    prompt_id: str
    text: str | None = None
    """Raw text prompt (tokenized by generation without a chat template)."""
    chat: list[dict[str, str]] | None = None
    """Chat messages (generation applies the model's chat template)."""
    token_ids: list[int] | None = None
    """Pre-tokenized prompt."""
    ground_truth: str = ""
    reward_fn: str = ""
    reward_args: dict[str, str] = field(default_factory=dict)
    sampling: dict[str, Any] | None = None
    """Overrides of the configured sampling parameters."""
    ledger_seq: int | None = None
    """Its row in the prompt ledger (set when it is written there)."""
    attempts: int = 0
    """Transient failures so far (persisted in the ledger)."""

    @property
    def append_key(self) -> str:
        """The idempotency key of its group's Append: one group per ledger row, even when a
        collector restarted after the Append and generates the prompt again."""
        return f"{self.prompt_id}#{self.ledger_seq}"

    @property
    def query(self) -> str:
        """The prompt as text, as TorchRL names it: the raw text, or a chat's last user message
        ("" for token ids, which the collector never detokenizes)."""
        if self.text is not None:
            return self.text
        users = [message["content"] for message in self.chat or () if message.get("role") == "user"]
        return users[-1] if users else ""

    def prompt_text(self) -> str:
        """Human-readable prompt for reward functions."""
        if self.text is not None:
            return self.text
        if self.chat:
            return self.chat[-1].get("content", "")
        return ""


def item_from_record(record: dict[str, Any], index: int, prompt_field: str, ground_truth_field: str,
                     default_id: str) -> PromptItem:
    """A dataset row -> PromptItem (InvalidArgument naming the row when malformed)."""
    prompt = record.get(prompt_field)
    item = PromptItem(prompt_id=str(record.get("id", default_id)),
                      ground_truth=str(record.get(ground_truth_field, "") or ""),
                      reward_fn=str(record.get("reward_fn", "") or ""))
    if isinstance(prompt, str) and prompt:
        item.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        item.chat = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    else:
        raise InvalidArgument(f"dataset row {index}: field {prompt_field!r} must be a string or chat messages")
    return item


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL / JSON / Parquet file or a saved ``datasets`` directory."""
    path = Path(path)
    if path.is_dir():
        import datasets  # optional: only for `save_to_disk` directories

        return [dict(row) for row in datasets.load_from_disk(str(path))]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # optional

        return pq.read_table(path).to_pylist()
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        return list(data) if isinstance(data, list) else list(data["data"])
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class PromptSource:
    """Prompts to generate: given back ones first (a restart's pending prompts, discarded groups),
    then submitted ones, then dataset rows in (seeded) shuffled epochs. Each is in the ledger
    before it is handed out; ``done`` / ``dead`` end it there."""

    def __init__(self, ledger: "PromptLedger", records: list[dict[str, Any]] | None = None, *,
                 prompt_field: str = "prompt", ground_truth_field: str = "answer", shuffle: bool = True,
                 seed: int = 0, epochs: int = 0, max_submitted: int = 10_000):
        self.ledger = ledger
        self._records = records or []
        self._prompt_field = prompt_field
        self._ground_truth_field = ground_truth_field
        self._shuffle = shuffle
        self._seed = seed
        self._epochs = epochs  # 0 = cycle forever
        self._max_submitted = max_submitted
        self._submitted: collections.deque[PromptItem] = collections.deque()
        self._requeued: collections.deque[PromptItem] = collections.deque()
        self._available = asyncio.Event()
        self.pending = 0
        """Prompts in the ledger: handed out or queued, not yet ended."""
        self.restored = False
        """Whether ``restore`` ran (a collector takes submissions only after it)."""
        self.epoch = 0
        self.index = 0
        self._order = self._epoch_order(0)
        if self._records or self._submitted:
            self._available.set()

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
        everything else."""
        self._requeued.append(item)
        self._available.set()

    async def done(self, item: PromptItem, retain_at_version: int | None = None) -> None:
        """Its group was appended (see ``PromptLedger.done``)."""
        await self.ledger.done(item, retain_at_version)
        self.pending -= 1

    async def regenerate(self, prompt_ids: list[str]) -> list[str]:
        """Generate again the prompts of appended groups that were dropped stale, ahead of everything
        else; returns the prompt ids whose row was no longer kept (not generated again)."""
        again, missing = await self.ledger.regenerate(prompt_ids)
        self.pending += len(again)
        for item in again:
            self.requeue(item)
        return missing

    async def dead(self, item: PromptItem, stage: str, code: str, error: str) -> "DeadLetter":
        """It failed for good: a dead letter."""
        dead = await self.ledger.dead(item, stage, code, error)
        self.pending -= 1
        return dead

    @property
    def exhausted(self) -> bool:
        return (not self._submitted and not self._requeued and self._epochs > 0
                and self.epoch >= self._epochs)

    @property
    def queued(self) -> int:
        return len(self._submitted) + len(self._requeued)

    # --- output ---------------------------------------------------------------
    def _next_row(self) -> tuple[PromptItem, dict[str, int]] | None:
        """The next dataset prompt and the position after it (the source has not moved yet)."""
        if not self._records or (self._epochs and self.epoch >= self._epochs):
            return None
        row = self._order[self.index]
        item = item_from_record(self._records[row], row, self._prompt_field, self._ground_truth_field,
                                default_id=f"row{row}")
        item.prompt_id = f"{item.prompt_id}@e{self.epoch}"
        epoch, index = self.epoch, self.index + 1
        if index >= len(self._order):
            epoch, index = epoch + 1, 0
        return item, {"epoch": epoch, "index": index}

    async def next(self) -> PromptItem:
        """The next prompt, waiting for submissions when the dataset is exhausted or absent."""
        while True:
            if self._requeued:
                return self._requeued.popleft()
            if self._submitted:
                return self._submitted.popleft()
            drawn = self._next_row()
            if drawn is not None:
                item, position = drawn
                added = await self.ledger.add([item], position)  # durable before it is handed out
                self.load_state(position)
                if added:
                    self.pending += 1
                    return item
                continue  # still pending from before a restart: it is queued already
            self._available.clear()
            await self._available.wait()
