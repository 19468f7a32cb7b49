"""A push's bytes spooled for re-syncs, beside its staging (``SpoolWriter``): copied from the push's segment
into the spool (files, or the collector's database), then committed to it once the version committed, or
discarded. Its failure is kept (``error``, ``Status.spool_error``): the push still commits, the spool keeps
the version it had until a later push spools."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from rlfleet.services.collector.spool import DatabaseSpool, DatabaseSpoolWrite, FileSpool, FileSpoolWrite
from rlfleet.services.common.errors import Unavailable
from rlfleet.wire import shm

log = logging.getLogger("rlfleet.collector.fanout")


class SpoolWriter:
    def __init__(self, spool: FileSpool | DatabaseSpool, release: Callable[[shm.Segment], None],
                 on_fatal: Callable[[str, BaseException], None] | None = None):
        self.spool = spool
        self._release = release
        """Hands a push's segment back once the spool (and every replica falling back to grpc) read it."""
        self._on_fatal = on_fatal
        self.error = ""
        """Why the spool does not hold the committed version; "" when current."""
        self._task: asyncio.Task | None = None  # the last push's write

    def start(self, spool: FileSpoolWrite | DatabaseSpoolWrite, segment: shm.Segment, decision: asyncio.Future,
              copied: asyncio.Future | None = None) -> asyncio.Task:
        """Write the push in ``segment`` to ``spool`` (``copied`` is told whether every byte is there), and
        commit or discard it by ``decision`` (whether the version committed)."""
        self._task = asyncio.ensure_future(self._write(spool, segment, decision, copied))
        self._task.add_done_callback(self._finished)
        return self._task

    async def done(self) -> None:
        """Wait for the last push's write (pushes and re-syncs need it done; how it ended was reported by
        it)."""
        if self._task is not None:
            await asyncio.wait({self._task})

    async def _write(self, spool: FileSpoolWrite | DatabaseSpoolWrite, segment: shm.Segment,
                     decision: asyncio.Future, copied: asyncio.Future | None = None) -> None:
        """Spool the push beside the staging (``copied``: whether every byte is), commit it once the
        version committed.

        A file spool is not on the commit's path: a replica that is up applies from the transport, the
        spool only serves later re-syncs, which wait for it (``done``). A collector that dies between
        the commit and the end of this write restarts without the bytes of that version; its replicas
        that were down then rejoin at the next push. The database's spool is (the fan-out's commit waits for
        ``copied``): its manifest switches in the version's own transaction."""
        version, failure, every_byte = spool.manifest.version, "", False
        try:
            await spool.copy(segment)
            every_byte = True
        except (OSError, Unavailable) as err:
            failure = f"spooling version {version} failed: {err}"
        finally:
            if copied is not None and not copied.done():
                copied.set_result(every_byte)
        committed = await decision
        self._release(segment)  # only now: replicas falling back to grpc read from it until staged
        if committed and not failure:
            try:
                await spool.commit()
                self.error = ""
                return
            except (OSError, Unavailable) as err:
                if self.spool.commits_with_version:
                    # The version and its manifest committed together: only older bytes stayed behind.
                    log.warning("deleting the spooled versions before %d failed: %s", version, err)
                    self.error = ""
                    return
                failure = f"committing version {version} to the spool failed: {err}"
        try:
            await spool.discard()
        except (OSError, Unavailable) as err:
            log.warning("discarding the spooled bytes of version %d failed: %s", version, err)
        if committed:  # an aborted push leaves the spool as current as it was
            self.error = failure
            log.error("%s: replicas that restart cannot be re-synced to it until a later push spools", failure)

    def _finished(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self._on_fatal is not None:
            self._on_fatal("the weight spool writer", task.exception())  # not an I/O error: a bug
