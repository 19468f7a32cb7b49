"""Side tasks a component does not await: kept until they end, a failure reported, awaited together."""

from __future__ import annotations

import asyncio

from rlfleet.services.common.background import BackgroundTasks


async def test_a_failing_task_is_reported_by_name_and_the_others_are_awaited():
    failures = []
    tasks = BackgroundTasks(on_failure=lambda name, exc: failures.append((name, str(exc))))
    finished = asyncio.Event()

    async def fails():
        raise RuntimeError("channel would not close")

    async def works():
        await finished.wait()

    tasks.start(fails(), "close-channel-r0")
    tasks.start(works(), "notify")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert failures == [("close-channel-r0", "channel would not close")] and len(tasks) == 1
    finished.set()
    await asyncio.wait_for(tasks.wait(), 5)
    assert len(tasks) == 0


async def test_a_cancelled_task_is_no_failure(caplog):
    tasks = BackgroundTasks()
    task = tasks.start(asyncio.Event().wait(), "waits")
    task.cancel()
    await tasks.wait()
    assert len(tasks) == 0 and "failed" not in caplog.text
