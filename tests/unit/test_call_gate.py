"""The bound on sandboxed calls in flight (``sandbox.CallGate``), on plain coroutines."""

from __future__ import annotations

import asyncio

from rlfleet.services.common import host
from rlfleet.services.environment.sandbox import CALLS_PER_CPU, CallGate


async def test_at_most_limit_inside_the_rest_counted_waiting():
    gate = CallGate(2)
    inside, most, release = 0, 0, asyncio.Event()

    async def call() -> None:
        nonlocal inside, most
        async with gate.held():
            inside += 1
            most = max(most, inside)
            await release.wait()
            inside -= 1

    tasks = [asyncio.create_task(call()) for _ in range(5)]
    while gate.waiting < 3:
        await asyncio.sleep(0.01)
    assert inside == 2 and gate.waiting == 3
    release.set()
    await asyncio.gather(*tasks)
    assert most == 2 and gate.waiting == 0 and inside == 0


async def test_a_cancelled_waiter_is_no_longer_counted_and_takes_no_slot():
    gate = CallGate(1)
    async with gate.held():
        waiter = asyncio.create_task(gate.held().__aenter__())
        while gate.waiting < 1:
            await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert gate.waiting == 0
    async with gate.held():  # the slot came back
        pass


def test_the_default_is_per_cpu_and_each_event_loop_gets_its_own_semaphore():
    gate = CallGate()
    assert gate.limit == CALLS_PER_CPU * host.cpus()

    async def once() -> None:
        async with gate.held():
            pass
    asyncio.run(once())
    asyncio.run(once())  # a semaphore bound to the first loop would raise here
    gate.configure(3)
    assert gate.limit == 3
