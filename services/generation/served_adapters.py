"""The LoRA adapters a replica serves: the current one, and older ones requests still run on.

An adapter push (``WeightManifest.lora``) is written as a directory (``lora_adapter.write_adapter_dir``)
under a directory of this replica's in ``/dev/shm`` and added to vLLM under a name of its own
(``rlfleet-v{version}-{serial}``: vLLM's prefix cache keys blocks on it). Each request is pinned at
submission to the adapter current then (``pin``) and runs on it to its end, whatever is pushed
meanwhile; its tokens are that version's. An adapter that is no longer current leaves vLLM, and its
directory goes, once the last request pinned to it ends (vLLM reloads an adapter from its directory
when a request names one it evicted). A full or delta push drops the current adapter (``switch(None)``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

from rlfleet.services.common.background import BackgroundTasks
from rlfleet.services.generation.lora_adapter import LoraAdapterConfig, lora_request, remove_adapter_dir, write_adapter_dir
from rlfleet.wire import shm

log = logging.getLogger("rlfleet.generation.adapters")


@dataclass(eq=False)
class ServedAdapter:
    version: int
    request: Any
    """vLLM's ``LoRARequest``."""
    directory: Path
    users: int = 0
    """Requests pinned to it and still running."""


@dataclass
class AdapterSet:
    current: ServedAdapter | None = None
    serials: itertools.count = field(default_factory=lambda: itertools.count(1))
    """Where each adapter's serial comes from (vLLM's id and name): the replica's, shared by every run's set."""
    _root: Path | None = None
    _held: shm.HeldDirectory | None = None
    _retiring: set[ServedAdapter] = field(default_factory=set)
    _tasks: BackgroundTasks = field(default_factory=BackgroundTasks)

    async def load(self, engine, version: int, config: LoraAdapterConfig, names, dtypes, shapes,
                   buffer) -> ServedAdapter:
        """Write an adapter push's directory and add it to vLLM; not current yet (``switch``)."""
        if self._root is None:
            self._held = shm.HeldDirectory("rlfleet-lora-")  # swept once this process is gone, SIGKILL included
            self._root = Path(self._held.path)
        serial = next(self.serials)
        directory = self._root / f"v{version}-{serial}"
        await asyncio.to_thread(write_adapter_dir, directory, names, dtypes, shapes, buffer, config)
        adapter = ServedAdapter(version, lora_request(version, directory, serial), directory)
        try:
            await engine.add_lora(adapter.request)
        except BaseException:
            await asyncio.to_thread(remove_adapter_dir, directory)
            raise
        return adapter

    def switch(self, engine, adapter: ServedAdapter | None) -> None:
        """Make ``adapter`` (None: the model's weights alone) the one new requests run on."""
        old, self.current = self.current, adapter
        if old is not None:
            self._retiring.add(old)
            self._retire_unused(engine)

    def pin(self) -> ServedAdapter | None:
        """The adapter a request submitted now runs on (it counts as a user until ``unpin``)."""
        adapter = self.current
        if adapter is not None:
            adapter.users += 1
        return adapter

    def unpin(self, engine, adapter: ServedAdapter) -> None:
        adapter.users -= 1
        self._retire_unused(engine)

    def _retire_unused(self, engine) -> None:
        for adapter in [a for a in self._retiring if a.users == 0]:
            self._retiring.discard(adapter)
            self._tasks.start(self._remove(engine, adapter), f"retire-adapter-{adapter.request.lora_name}")

    @staticmethod
    async def _remove(engine, adapter: ServedAdapter) -> None:
        try:
            await engine.remove_lora(adapter.request.lora_int_id)
        except Exception as err:  # an engine shutting down: its directory goes all the same
            log.warning("removing adapter %s from vLLM failed: %s", adapter.request.lora_name, err)
        await asyncio.to_thread(remove_adapter_dir, adapter.directory)

    async def discard(self, adapter: ServedAdapter, engine) -> None:
        """An adapter loaded but never made current (its swap failed)."""
        await self._remove(engine, adapter)

    def drop(self, engine) -> None:
        """The set's run ended and no request uses its adapters: each leaves vLLM, then the set's directory."""
        adapters = [adapter for adapter in (self.current, *self._retiring) if adapter is not None]
        self.current = None
        self._retiring.clear()
        self._tasks.start(self._drop(engine, adapters), "drop-adapters")

    async def _drop(self, engine, adapters: list[ServedAdapter]) -> None:
        for adapter in adapters:
            await self._remove(engine, adapter)
        held, self._held, self._root = self._held, None, None
        if held is not None:
            await asyncio.to_thread(held.close)

    @property
    def directory(self) -> Path | None:
        """Where the adapters' directories are (in /dev/shm; None before the first adapter)."""
        return self._root

    def close(self) -> None:
        """Every directory goes (the engine is shut down)."""
        self.current = None
        self._retiring.clear()
        held, self._held, self._root = self._held, None, None
        if held is not None:
            held.close()


async def held_while_read(stream: AsyncGenerator[Any, None], release: Callable[[], None],
                          hold: Callable[[], None] | None = None) -> AsyncGenerator[Any, None]:
    """``stream`` (a vLLM request's outputs), with ``hold`` called at its first read and ``release`` once
    it ends or is closed: an adapter's pin (``AdapterSet.unpin``), a run's count of its requests."""
    if hold is not None:
        hold()
    try:
        async for output in stream:
            yield output
    finally:
        await stream.aclose()
        release()
