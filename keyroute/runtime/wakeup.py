"""`Wakeup`: how a worker thread (the map watcher's, the controller's) is asked for another turn, or to stop.

    wake = Wakeup()
    while not wake.stopped:
        rung = wake.wait(timeout_s)   # False: the timeout passed (a safety-net turn)
        if wake.stopped:
            break
        try:
            work()
        except Failure:
            wake.ring_after(retry_s)  # try again soon, unless stopped meanwhile

Other threads call `ring` (something changed: never blocks) and `stop` (which wakes the worker too).
"""

from __future__ import annotations

import threading


class Wakeup:
    __slots__ = ("_rung", "_stopped")

    def __init__(self) -> None:
        self._rung = threading.Event()
        self._stopped = threading.Event()

    def ring(self) -> None:
        """Ask for another turn."""
        self._rung.set()

    def stop(self) -> None:
        """Ask the worker to end, and wake it."""
        self._stopped.set()
        self._rung.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` for a ring and take it (rings meanwhile make one turn): whether one came."""
        rung = self._rung.wait(timeout_s)
        self._rung.clear()
        return rung

    def pause(self, seconds: float) -> None:
        """Sleep `seconds`, less when stopped meanwhile."""
        self._stopped.wait(seconds)

    def ring_after(self, seconds: float) -> None:
        """A retry: another turn in `seconds` (at once when stopped meanwhile)."""
        self.pause(seconds)
        self.ring()
