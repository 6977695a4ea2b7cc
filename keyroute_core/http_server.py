"""uvicorn's httptools protocol with one change: what a response writes in one event-loop step goes out in
one socket write.

uvicorn writes a response's status line and headers, then its body, each with its own `transport.write`,
and on a TCP socket each is a `send` system call that runs the whole loopback path to the peer. For the
small answers keyroute serves, those calls are the largest single CPU cost of a proxied read
(benchmarks/RESULTS.md, "Router"). Here the connection's writes are gathered and handed to the socket once,
at the next turn of the event loop (a few microseconds later), which halves the calls for such answers.
Flow control, close, upgrade and peer addresses still go to the real transport.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingWrites:
    """A transport whose writes made during one event-loop step reach the real transport as one write."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        pending = self._pending
        if pending is None:
            self._pending = [data]
            self._loop.call_soon(self.flush)
        else:
            pending.append(data)

    def flush(self) -> None:
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        if not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def write_now(self, data: bytes) -> None:
        """`data` to the socket at once, after whatever is still gathered (the order is kept)."""
        pending = self._pending
        if pending is None:
            if not self._transport.is_closing():
                self._transport.write(data)
        else:
            pending.append(data)
            self.flush()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """Pass as `uvicorn.Config(http=CoalescingHttpToolsProtocol)`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Set after the parent has taken the real transport for flow control and the peer's address.
        self.transport = CoalescingWrites(transport, self.loop)  # type: ignore[assignment]
