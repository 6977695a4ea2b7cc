"""Other nodes played by one real HTTP/1.1 server on 127.0.0.1, for tests of a member that sends requests over
the wire production uses (keyroute.http.fast_upstream).

Each request the server receives is handed to a handler as an `httpx.Request` whose URL names the node it was
sent to (from its Host header: `FastUpstream(resolve=peers.resolve)` connects every origin here and still
names it), and the handler's `httpx.Response` (or an awaitable of one) is sent back. A handler that raises
`Unreachable` plays a node that is gone: the connection is closed without a reply. Any other exception
plays a node that failed mid-exchange: the reply is a malformed status line and the connection is closed,
which the sender reports as `UpstreamUnavailable` (never retried: the node had started to reply).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import Awaitable, Callable, Iterator

import httpx

Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]

# Framing is the server's: it sends the body it was given, whole, with its own length.
_FRAMING = frozenset({b"content-length", b"transfer-encoding"})
_BROKEN = b"HTTP/1.1 ??? broken\r\n\r\n"


class Unreachable(Exception):
    """Raised by a handler: the node is gone, the connection closes without a reply."""


class Peers:
    """A server (on its own event loop, in a daemon thread) answering every request with `handler`."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="peers", daemon=True)

    def resolve(self, host: str, port: int) -> tuple[str, int]:
        """Where a sender connects for any node (`FastUpstream`'s `resolve`): here."""
        return "127.0.0.1", self.port

    def start(self) -> Peers:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                request_line, *lines = head[:-4].split(b"\r\n")
                method, target, _ = request_line.split(b" ", 2)
                headers = [tuple(part.strip() for part in line.split(b":", 1)) for line in lines]
                fields = {name.lower(): value for name, value in headers}
                length = int(fields.get(b"content-length", b"0"))
                body = await reader.readexactly(length) if length else b""
                url = "http://" + fields[b"host"].decode("ascii") + target.decode("ascii")
                request = httpx.Request(method.decode("ascii"), url, headers=headers, content=body)
                try:
                    response = self.handler(request)
                    if inspect.isawaitable(response):
                        response = await response
                    assert isinstance(response, httpx.Response)
                    body = await response.aread()
                except Unreachable:
                    return
                except Exception:  # the node failed mid-exchange
                    writer.write(_BROKEN)
                    return
                writer.write(_encode(response, body))
                await writer.drain()
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(ConnectionError):
                writer.close()


def _encode(response: httpx.Response, body: bytes) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\n" % (response.status_code, response.reason_phrase.encode("ascii"))]
    lines += [name + b": " + value + b"\r\n" for name, value in response.headers.raw if name.lower() not in _FRAMING]
    lines.append(b"content-length: %d\r\n\r\n" % len(body))
    return b"".join(lines) + body


@contextlib.contextmanager
def serve_peers(handler: Handler) -> Iterator[Peers]:
    peers = Peers(handler).start()
    try:
        yield peers
    finally:
        peers.stop()
