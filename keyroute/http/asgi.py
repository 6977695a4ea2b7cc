"""The ASGI 3 bridge: a request that is not the data plane's runs the service's ASGI app as a `Cycle` (its
scope, its body as one `http.request`, the app's answer streamed in the connection's answer order)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes

from keyroute.http.exchange import Slot
from keyroute.http.wire import (
    CLOSE,
    INTERNAL_ERROR,
    JSON,
    KEEP_ALIVE_10,
    STATUS_LINES,
    X_REQUEST_ID,
    date_header,
    encode,
    status_line,
)

if TYPE_CHECKING:
    from keyroute.http.protocol import Connection

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _decode_path(raw: bytes) -> str:
    if b"%" in raw:
        raw = unquote_to_bytes(raw)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, tuple) and len(info) >= 2:
        return (str(info[0]), int(info[1]))
    return None


# The scope's extension holding the connection's transport: what app routes that identify a caller by its
# client certificate read it from (keyroute.http.authn.Callers.of_scope).
TRANSPORT_EXTENSION = "keyroute.transport"


def http_scope(
    method: str,
    version: str,
    path: bytes,
    query: bytes,
    headers: list[tuple[bytes, bytes]],
    transport: Any,
    state: dict[str, Any],
) -> Scope:
    """The ASGI `http` scope of a request whose head is parsed (`state`: the lifespan's, copied)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": version,
        "method": method,
        "scheme": "http" if transport.get_extra_info("ssl_object") is None else "https",
        "path": _decode_path(path),
        "raw_path": path,
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": _address(transport.get_extra_info("peername")),
        "server": _address(transport.get_extra_info("sockname")),
        "state": state.copy(),
        "extensions": {TRANSPORT_EXTENSION: transport},
    }


class Cycle(Slot):
    """One request for the ASGI app: its scope, its body, and the app's answer as it streams."""

    __slots__ = (
        "scope",
        "body",
        "_ready",
        "_started",
        "_body_sent",
        "_response_started",
        "_response_done",
        "_head_written",
        "_status",
        "_headers",
        "_chunked",
        "_no_body",
        "_declared",
        "_sent",
        "_disconnect",
    )

    def __init__(
        self, conn: Connection, scope: Scope, rid: bytes, keep_alive: bool, connection: bytes, head: bool
    ) -> None:
        Slot.__init__(self, conn, rid, keep_alive, connection, head)
        self.scope = scope
        self.body = b""
        self._ready = False  # the whole body has arrived
        self._started = False
        self._body_sent = False
        self._response_started = False
        self._response_done = False
        self._head_written = False
        self._status = 0
        self._headers: Any = ()
        self._chunked = False
        self._no_body = head
        self._declared: int | None = None
        self._sent = 0
        self._disconnect: asyncio.Future[None] | None = None

    def _lost(self) -> None:
        self._gone = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._disconnect
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _start(self) -> None:
        # Only the request at the head of the connection's order runs: its answer can then be streamed
        # straight to the socket, and the app sees requests of one connection one at a time.
        self._started = True
        conn = self._conn
        conn._server.track(conn._loop.create_task(self._run()))

    async def _run(self) -> None:
        try:
            await self._conn._app(self.scope, self._receive, self._send)
        except asyncio.CancelledError:
            self._failed()
            raise
        except Exception:
            log.exception("the ASGI app raised on %s %s", self.scope["method"], self.scope["raw_path"])
            self._failed()
        else:
            if not self._response_done and not self._gone:
                log.error(
                    "the ASGI app returned without a complete answer to %s %s",
                    self.scope["method"],
                    self.scope["raw_path"],
                )
                self._failed()

    def _failed(self) -> None:
        if self._gone or self._response_done:
            return
        self._response_done = self._done = True
        conn = self._conn
        if self._head_written:
            # Part of an answer went out: only closing tells the client it is incomplete.
            conn._close_after_flush()
        else:
            conn._complete(self, encode(500, JSON, INTERNAL_ERROR, self._rid, self._connection, self._head))
        self._wake()

    async def _receive(self) -> Message:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if not self._gone and not self._response_done:
            waiter = self._disconnect
            if waiter is None:
                waiter = self._disconnect = self._conn._loop.create_future()
            await waiter
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self._response_started:
                raise RuntimeError("http.response.start sent twice")
            self._response_started = True
            self._status = int(message["status"])
            self._headers = message.get("headers") or ()
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self._response_started or self._response_done:
            raise RuntimeError("http.response.body before http.response.start or after the last body")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self._gone:
            if not more:
                self._response_done = True
            return
        conn = self._conn
        data = b"" if self._head_written else self._write_head(len(body), more)
        if self._no_body:
            pass
        elif self._chunked:
            if body:
                data += b"%x\r\n%s\r\n" % (len(body), body)
            if not more:
                data += b"0\r\n\r\n"
        else:
            data += body
        self._sent += len(body)
        if more:
            conn._emit(self, data)
            # Let the flush run, so that the transport's flow control sees this part before the app makes
            # the next one (an app whose parts are ready at once would otherwise pile them all up here).
            await asyncio.sleep(0)
            if conn._write_paused:
                await conn._drain()
            return
        self._response_done = self._done = True
        declared = self._declared
        if declared is not None and declared != self._sent and not self._no_body:
            log.warning(
                "the ASGI app declared content-length %d and sent %d bytes; closing the connection",
                declared,
                self._sent,
            )
            self._keep_alive = False
        conn._complete(self, data)
        self._wake()

    def _write_head(self, first: int, more: bool) -> bytes:
        status = self._status
        parts = [STATUS_LINES.get(status) or status_line(status)]
        own_id = own_connection = True
        declared = None
        for raw_name, raw_value in self._headers:
            name = bytes(raw_name).lower()
            value = bytes(raw_value)
            if b"\n" in value or b"\r" in value or b"\n" in name or b"\r" in name or b":" in name:
                raise RuntimeError(f"invalid response header {name!r}")
            if name == b"content-length":
                declared = int(value)
            elif name == b"transfer-encoding":
                continue  # the server frames the body
            elif name == b"connection":
                own_connection = False
                if b"close" in value.lower():
                    self._keep_alive = False
            elif name == X_REQUEST_ID:
                own_id = False
            parts += (name, b": ", value, b"\r\n")
        if status < 200 or status == 204 or status == 304:
            self._no_body = True
        elif declared is not None:
            self._declared = declared
        elif not more:
            parts.append(b"content-length: %d\r\n" % first)
        elif not self._head:
            if self.scope["http_version"] == "1.1":
                self._chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                self._keep_alive = False  # HTTP/1.0: the end of the body is the end of the connection
        conn = self._conn
        if conn._stopping and conn._queue and conn._queue[-1] is self:
            self._keep_alive = False
        parts.append(date_header())
        if own_id:
            parts += (b"x-request-id: ", self._rid, b"\r\n")
        if own_connection:
            if not self._keep_alive:
                parts.append(CLOSE)
            elif self.scope["http_version"] == "1.0":
                parts.append(KEEP_ALIVE_10)
        parts.append(b"\r\n")
        self._head_written = True  # not before: an invalid header is still answered 500
        return b"".join(parts)
