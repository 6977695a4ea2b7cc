"""When each waiting read's hedge (or stall delay) is due, on one event-loop timer for all reads.

A timer per read (`loop.call_later` and its cancel) costs ~3 us on uvloop, more than the rest of the hedging
bookkeeping together; here a read costs a heap push, and the one timer is armed for the earliest deadline.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from keyroute.router.key_read import Read

log = logging.getLogger(__name__)


class HedgeTimer:
    """The reads waiting for their hedge, by deadline, and the one loop timer that wakes for the earliest.

    Reads no longer waiting (delivered, failed over or cancelled meanwhile) are dropped when their deadline
    comes up. Deadlines are readings of `clock` (the proxy's, which may be offset from the loop's but runs at
    its rate): the loop's timer wakes it after the clock's time to the earliest deadline, the reads due by
    `clock` are hedged (`Read.fire`), and the timer is armed again for the next one.
    """

    # uvloop counts whole milliseconds, so a timer may fire up to one early: that much early is due.
    _EARLY_S = 0.001

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._due: list[tuple[float, int, Read]] = []
        self._seq = itertools.count()  # ties on the deadline must never compare two reads
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, read: Read, delay_s: float) -> None:
        loop = asyncio.get_running_loop()
        now = self._clock()
        when = now + delay_s
        read.due = when
        if loop is not self._loop:  # a new event loop (tests run one after another): start afresh
            self._loop, self._timer, self._due = loop, None, []
        heapq.heappush(self._due, (when, next(self._seq), read))
        if self._timer is None or when < self._timer_at - self._EARLY_S:
            self._arm(loop, when, now)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(when - now, self._fire, loop)
        self._timer_at = when

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        due = self._due
        now = self._clock()
        while due:
            when, _, read = due[0]
            current = read.waiting and read.due == when  # a read re-armed later has a newer entry too
            if current and when > now + self._EARLY_S:
                self._arm(loop, when, now)
                return
            heapq.heappop(due)
            if current:
                try:
                    read.fire()
                except Exception as exc:  # one read's trouble must not stop the others' hedges
                    log.exception("hedging a read failed", extra={"request_id": read.request_id})
                    if not read.over:
                        read.deliver(exc)
