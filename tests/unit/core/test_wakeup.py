"""`Wakeup`, the worker threads' wake-up calls (keyroute.runtime.wakeup)."""

from __future__ import annotations

import threading

from keyroute.runtime.wakeup import Wakeup


def test_rings_make_one_turn_and_a_timeout_none() -> None:
    wake = Wakeup()
    assert not wake.wait(0)
    wake.ring()
    wake.ring()
    assert wake.wait(0)
    assert not wake.wait(0)  # both rings were taken by that one turn


def test_stop_wakes_the_worker_and_cuts_its_pauses_short() -> None:
    wake = Wakeup()
    turns: list[bool] = []
    worker = threading.Thread(target=lambda: turns.append(wake.wait(3600)))
    worker.start()
    wake.stop()
    worker.join(60)
    assert turns == [True] and wake.stopped
    wake.ring_after(3600)  # returns at once once stopped, and asks for a turn
    assert wake.wait(0)
