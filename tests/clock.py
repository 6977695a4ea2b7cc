"""`ManualClock`: a `keyroute.runtime.clock.Clock` whose time moves only when a test says so (`advance`), so that
a grace period, a retry back-off or a report interval is passed in no time and a test can say exactly what has
happened before it ends and what after."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

# Where the wall clock of a ManualClock starts: any fixed time will do, a recent one reads naturally.
WALL_START = 1_800_000_000.0


class _Timer:
    __slots__ = ("when", "callback", "cancelled")

    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """Monotonic time from `start`, the wall clock from `WALL_START`; both move by `advance` only. Sleepers and
    timers due by then run within `advance`, in time order (a sleeper resumes at the event loop's next turn)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._start = start
        self._timers: list[tuple[float, int, _Timer]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return WALL_START + (self.now - self._start)

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> _Timer:
        timer = _Timer(self.now + max(0.0, delay_s), callback)
        heapq.heappush(self._timers, (timer.when, next(self._order), timer))
        return timer

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self.call_later(seconds, lambda: woken.done() or woken.set_result(None))
        try:
            await woken
        finally:
            timer.cancel()

    def pending(self) -> list[float]:
        """In how many seconds each timer and sleeper still waiting is due, soonest first."""
        return sorted(when - self.now for when, _, timer in self._timers if not timer.cancelled)

    def advance(self, seconds: float) -> None:
        """Move time on by `seconds`, running what falls due meanwhile, each at its own time."""
        until = self.now + seconds
        while self._timers and self._timers[0][0] <= until:
            when, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self.now = max(self.now, when)
            timer.cancelled = True
            timer.callback()
        self.now = until
