"""Tasks a component starts and does not await (a channel closing, a waiter woken, an adapter retired):
kept referenced until they end, each one's failure reported rather than lost with the task, and awaited
together at shutdown. A service's own loops use ``Service.supervise``, which fails the service; these are
side work whose failure a component reports through ``on_failure`` (by default an error in the log, with
the traceback)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Coroutine

log = logging.getLogger(__name__)


def _log_failure(name: str, exc: BaseException) -> None:
    log.error("background task %s failed", name, exc_info=exc)


class BackgroundTasks:
    def __init__(self, on_failure: Callable[[str, BaseException], None] = _log_failure):
        self.on_failure = on_failure
        self._tasks: set[asyncio.Task] = set()

    def start(self, coroutine: Coroutine, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.on_failure(task.get_name(), task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self) -> None:
        """Until every task started so far ended (their failures reported as they end)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
