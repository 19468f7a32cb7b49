"""The one way tests wait: for a condition, never for a guessed amount of time."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``condition`` until it returns something truthy (returned); ``TimeoutError`` naming
    ``what`` after ``timeout`` seconds. ``timeout`` is a bound derived from what is awaited (an
    engine start, a retry budget), generous for a loaded CI machine, never a synchronization."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
    return result


async def wait_for_async(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.01) -> T:
    """``wait_for`` for code on an event loop (the condition is a plain callable)."""
    import asyncio

    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)
    return result


async def settle(rounds: int = 100) -> None:
    """Let every task of this event loop run until none can advance without a timer or I/O: what a test
    asserts did *not* happen (a task still waiting) then holds whatever the machine's speed, where a short
    sleep only guesses. For in-process logic only (no sockets, no threads)."""
    import asyncio

    for _ in range(rounds):
        await asyncio.sleep(0)
