"""`Clock`: the time a service's timers run on (grace periods, retries, periodic reports). What has timers takes
one, so that its tests move time by hand instead of waiting for it; the product gives `SYSTEM_CLOCK`.

    clock.monotonic()                       # seconds, for intervals and deadlines
    clock.time()                            # seconds since the epoch, for what a record or a metric shows
    await clock.sleep(grace_s)              # on the event loop
    timer = clock.call_later(delay_s, cb)   # on the event loop; timer.cancel()
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds that only go forward (intervals, deadlines)."""
        ...

    def time(self) -> float:
        """The wall clock: seconds since the epoch."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of this clock's time (on the event loop)."""
        ...

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> Timer:
        """Call `callback()` on the event loop `delay_s` seconds of this clock's time from now."""
        ...


class SystemClock:
    """The process's clocks, and the running event loop's sleep and timers."""

    __slots__ = ()

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_later(delay_s, callback)


SYSTEM_CLOCK: Clock = SystemClock()
