"""A connection of keyroute's HTTP server on an event loop whose time the test moves (as uvicorn's protocol tests
do with their MockLoop): `FakeLoop` runs what the connection schedules, in order, only when the test says so;
`FakeTransport` records what the connection writes. No socket, no thread, no wall clock: a test of a time-out
says exactly when it must and must not have happened."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Coroutine
from typing import Any

from keyroute.http.exchange import DataPlane, ServerLimits
from keyroute.http.protocol import Connection, ServerState
from tests.unit.http.harness import Answer

# More callbacks than any scenario here needs: a callback that keeps re-arming itself at the same time fails the
# test instead of hanging it.
_MAX_CALLBACKS = 10_000


class FakeTimer:
    """What `call_soon` and `call_later` return: `cancel()` as asyncio's handles."""

    def __init__(self, when: float, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._when, self._callback, self._args = when, callback, args
        self._cancelled = False

    def when(self) -> float:
        return self._when

    def cancel(self) -> None:
        self._cancelled = True

    def cancelled(self) -> bool:
        return self._cancelled

    def run(self) -> None:
        if not self._cancelled:
            self._cancelled = True  # ran: no longer pending
            self._callback(*self._args)


class FakeLoop(asyncio.AbstractEventLoop):
    """The parts of an event loop a connection uses, with time standing still until `advance`. A task runs at
    once, to its end: the ASGI apps given to it must never wait."""

    def __init__(self) -> None:
        self.now = 0.0
        self._ready: list[FakeTimer] = []
        self._timers: list[tuple[float, int, FakeTimer]] = []
        self._order = itertools.count()

    def get_debug(self) -> bool:
        return False

    def time(self) -> float:
        return self.now

    def call_soon(self, callback: Callable[..., Any], *args: Any, context: Any = None) -> FakeTimer:  # type: ignore[override]
        timer = FakeTimer(self.now, callback, args)
        self._ready.append(timer)
        return timer

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any, context: Any = None) -> FakeTimer:  # type: ignore[override]
        return self.call_at(self.now + delay, callback, *args)

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any, context: Any = None) -> FakeTimer:  # type: ignore[override]
        timer = FakeTimer(when, callback, args)
        heapq.heappush(self._timers, (when, next(self._order), timer))
        return timer

    def create_future(self) -> asyncio.Future[Any]:
        return asyncio.Future(loop=self)

    def create_task(self, coro: Coroutine[Any, Any, Any], **_: Any) -> asyncio.Future[Any]:  # type: ignore[override]
        done: asyncio.Future[Any] = asyncio.Future(loop=self)
        try:
            coro.send(None)
        except StopIteration as stop:
            done.set_result(stop.value)
        except BaseException as exc:  # noqa: BLE001 (the task's outcome, as a real task keeps it)
            done.set_exception(exc)
        else:
            coro.close()
            raise AssertionError("a coroutine waited on the fake loop, which runs only those that never wait")
        return done

    def pending(self) -> list[float]:
        """In how many seconds each timer still pending is due, soonest first."""
        return sorted(when - self.now for when, _, timer in self._timers if not timer.cancelled())

    def run_ready(self) -> None:
        """Run what was scheduled to run now (and what that schedules to run now)."""
        for _ in range(_MAX_CALLBACKS):
            if not self._ready:
                return
            self._ready.pop(0).run()
        raise AssertionError("callbacks keep scheduling callbacks")

    def advance(self, seconds: float) -> None:
        """Move time on by `seconds`, running every timer due meanwhile at its own time, in order."""
        until = self.now + seconds
        self.run_ready()
        for _ in range(_MAX_CALLBACKS):
            timers = self._timers
            while timers and timers[0][2].cancelled():
                heapq.heappop(timers)
            if not timers or timers[0][0] > until:
                break
            when, _, timer = heapq.heappop(timers)
            self.now = max(self.now, when)
            timer.run()
            self.run_ready()
        else:
            raise AssertionError("timers keep re-arming themselves")
        self.now = until
        self.run_ready()


class FakeTransport(asyncio.Transport):
    """A socket's end as a connection sees it: what it wrote, whether it reads, ends its side or closes."""

    def __init__(self, loop: FakeLoop, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self._loop, self._protocol = loop, protocol
        self.written = bytearray()
        self.reading = True
        self.eof_written = False
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "written after close"
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._loop.call_soon(self._protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def take(self) -> list[Answer]:
        """The answers written since the last `take` (complete ones: each has a content-length)."""
        answers = []
        data = bytes(self.written)
        while data:
            head, sep, rest = data.partition(b"\r\n\r\n")
            assert sep, f"an incomplete head: {data!r}"
            lines = head.decode("latin-1").split("\r\n")
            _, status, *_ = lines[0].split(" ", 2)
            headers = [(n.strip(), v.strip()) for n, _, v in (line.partition(":") for line in lines[1:])]
            answer = Answer(int(status), headers, b"")
            length = int(answer.header("content-length") or 0)
            answer.body, data = rest[:length], rest[length:]
            answers.append(answer)
        self.written.clear()
        return answers


class Wire:
    """One connection of a server with `limits`, on a `FakeLoop`, made at time 0: `send` what a client sends,
    `take` what the server answered, `loop.advance` to let time pass."""

    def __init__(self, data_plane: DataPlane | None = None, app: Any = None, **limits: Any) -> None:
        self.loop = FakeLoop()
        self.server = ServerState()
        self.connection = Connection(ServerLimits(**limits), self.server, self.loop, app, data_plane)
        self.transport = FakeTransport(self.loop, self.connection)
        self.connection.connection_made(self.transport)

    def send(self, data: bytes) -> None:
        assert not self.transport.closed, "sent on a closed connection"
        if self.transport.reading:
            self.connection.data_received(data)
        else:
            raise AssertionError("sent while the server does not read")
        self.loop.run_ready()

    def take(self) -> list[Answer]:
        self.loop.run_ready()
        return self.transport.take()

    @property
    def open(self) -> bool:
        return not self.transport.closed
