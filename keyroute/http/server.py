"""keyroute's HTTP/1.1 server (asyncio.Protocol + httptools): data-plane requests answered synchronously from
the parsed request, with no ASGI and no task; all others through an ASGI 3 bridge to the service's app.

Behaviour contract (tests/unit/http/test_server.py checks it over real sockets, the single write aside):

=====================================  =========================================================================
Request / event                        Answer
=====================================  =========================================================================
HTTP/1.1                               kept alive unless it says ``Connection: close``
HTTP/1.0                               closed after the answer, unless it says ``Connection: keep-alive`` (the
                                       answer then says ``connection: keep-alive``)
pipelined requests                     answered in request order, whatever order they are answered in
``Expect: 100-continue``               ``HTTP/1.1 100 Continue`` before the body; content-length over the
                                       limit: 413 ``body_too_large`` at once, closed
another ``Expect``                     417 ``expectation_failed``, closed
HEAD                                   the body's content-length, no body
request line + headers over the limit  431 ``headers_too_large``, closed
body over the limit                    413 ``body_too_large``, closed (as soon as it is known)
head complete, body not within         408 ``body_timeout``, closed (time spent with reading paused by the
``body_timeout_s``                     server does not count)
malformed request                      400 ``bad_request``, closed
DataPlane.handle raises                500 ``internal_error`` (traceback logged); the connection goes on
ASGI app raises before answering       500 ``internal_error`` (logged); after its answer started: closed
ASGI answer without content-length     chunked on HTTP/1.1, delimited by closing on HTTP/1.0
client gone (or its end of input)      ``Exchange.gone``, ASGI ``http.disconnect``; a later answer is
before the answer                      dropped, nothing raised
writes of one event-loop step          one socket write; reading pauses while the write buffer is full or
                                       ``max_pipelined`` requests wait for their answers
server stops                           idle connections closed; requests under way answered (the last with
                                       ``connection: close``) for up to ``grace_s``, then everything closed
idle for keep_alive_timeout_s          closed
every answer                           ``date``, ``x-request-id`` (the client's when
                                       ``keyroute.core.logs.acceptable_request_id`` accepts it, else
                                       ``keyroute.core.logs.new_request_id()``; an answer that carries its own
                                       is left alone); no ``server``
=====================================  =========================================================================

Error bodies are the API's (``keyroute.core.api``): ``{"error": code, "message": text}`` with
``content-type: application/json``; a traceback never goes to a client. Every request the server refuses
itself (the 400, 408, 413, 417 and 431 above), before any service code sees it, is counted in
``HttpServer.refusals`` and reported to ``on_refusal`` with its error code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import threading
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from email.utils import formatdate
from http import HTTPStatus
from time import time
from typing import Any, Protocol
from urllib.parse import unquote_to_bytes

import httptools

from keyroute.core.api import (
    DEFAULT_BODY_TIMEOUT_S,
    ApiError,
    BadRequest,
    BodyTimeout,
    BodyTooLarge,
    HeadersTooLarge,
    error_headers,
    error_json,
)
from keyroute.core.logs import acceptable_request_id, new_request_id

log = logging.getLogger(__name__)

Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode("latin-1")) for s in HTTPStatus}
_METHODS = {m.encode(): m for m in ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE")}
_X_REQUEST_ID = b"x-request-id"
# Headers the parser's callbacks must look at; everything else is only collected.
_NOTABLE = frozenset((b"content-length", b"expect", _X_REQUEST_ID))
_CLOSE = b"connection: close\r\n"
_KEEP_ALIVE_10 = b"connection: keep-alive\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_JSON = [(b"content-type", b"application/json")]
# How long a connection closed after an error answer keeps reading (and dropping) what the client still sends.
_LINGER_S = 2.0


class ExpectationFailed(ApiError):
    """An `Expect` other than 100-continue (the API itself has no use for Expect: only the server answers it)."""

    status = 417
    code = "expectation_failed"


def _request_id(raw: bytes | None) -> tuple[str, bytes]:
    """(id, its bytes) of a request whose x-request-id header is `raw`: the client's when
    `acceptable_request_id` accepts it (one rule for the whole project), else a new one."""
    if raw is not None:
        text = raw.decode("latin-1")  # one character per byte: a non-ASCII byte stays non-ASCII, and is refused
        if acceptable_request_id(text):
            return text, raw
    text = new_request_id()
    return text, text.encode("ascii")


_date_second = -1
_date_line = b""


def _date_header() -> bytes:
    global _date_second, _date_line
    now = int(time())
    if now != _date_second:
        _date_line = b"date: " + formatdate(now, usegmt=True).encode("ascii") + b"\r\n"
        _date_second = now
    return _date_line


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status  # the reason phrase may be empty


_INTERNAL_ERROR = error_json(ApiError.code, "internal error")  # 500 internal_error


def _encode(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes, request_id: bytes, connection: bytes, head: bool
) -> bytes:
    """A whole answer as one bytes object: one join, one format for the server's own headers."""
    parts = [_STATUS_LINES.get(status) or _status_line(status)]
    own_id = True
    for name, value in headers:
        if name == _X_REQUEST_ID:
            own_id = False
        parts += (name, b": ", value, b"\r\n")
    if status >= 200 and status != 204 and status != 304:
        if own_id:
            parts.append(
                b"content-length: %d\r\n%sx-request-id: %s\r\n%s\r\n"
                % (len(body), _date_header(), request_id, connection)
            )
        else:
            parts.append(b"content-length: %d\r\n%s%s\r\n" % (len(body), _date_header(), connection))
        if body and not head:
            parts.append(body)
    elif own_id:
        parts.append(b"%sx-request-id: %s\r\n%s\r\n" % (_date_header(), request_id, connection))
    else:
        parts.append(b"%s%s\r\n" % (_date_header(), connection))
    return b"".join(parts)


@dataclasses.dataclass(frozen=True, slots=True)
class ServerLimits:
    max_header_bytes: int = 16384  # request line + headers beyond this: 431 JSON error, connection closed
    max_body_bytes: int = 1048576  # a larger body (by content-length or as it arrives): 413 JSON, closed
    keep_alive_timeout_s: float = 5.0  # idle connections closed after this (one timer per connection)
    max_pipelined: int = 32  # parsed-but-unanswered requests per connection before reading pauses
    # A request whose head is complete must have its whole body within this long (0: no limit): else 408
    # JSON, closed. Time during which the server has paused reading does not count.
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S


class Request:
    """A data-plane request, built by the server once its head is parsed (`body` once it is complete)."""

    __slots__ = ("method", "path", "query", "target_bytes", "headers", "body", "request_id", "http_version")

    def __init__(
        self,
        method: str,
        path: bytes,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        request_id: str,
        http_version: str,
    ) -> None:
        self.method = method
        self.path = path  # raw, still percent-encoded, without the query
        self.query = query  # raw, without '?'
        self.target_bytes = len(path) + len(query)
        self.headers = headers  # lower-case names, in order received
        self.body = body
        self.request_id = request_id
        self.http_version = http_version

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower case), None when absent."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def __repr__(self) -> str:
        return f"Request({self.method} {self.path!r} id={self.request_id})"


class _Slot:
    """One request's place in its connection's answer order (pipelining): what it has written while an
    earlier request was still unanswered waits in `_held`."""

    __slots__ = ("_conn", "_held", "_done", "_gone", "_keep_alive", "_head", "_rid", "_connection")

    def __init__(self, conn: _Connection, rid: bytes, keep_alive: bool, connection: bytes, head: bool) -> None:
        self._conn = conn
        self._held: list[bytes] | None = None
        self._done = False  # its whole answer has been given
        self._gone = False  # the client left, or the connection closes before this answer
        self._keep_alive = keep_alive
        self._connection = connection  # the `connection` header line its answer carries (b"" for none)
        self._head = head  # a HEAD request: answered without a body
        self._rid = rid

    def _lost(self) -> None:
        self._gone = True


class Exchange(_Slot):
    """One data-plane request and its answer slot: `answer` once, now or later, on the loop's thread."""

    __slots__ = ("request",)

    def __init__(
        self, conn: _Connection, request: Request, rid: bytes, keep_alive: bool, connection: bytes, head: bool
    ) -> None:
        # _Slot.__init__, inline: one exchange per data-plane request.
        self._conn = conn
        self._held = None
        self._done = False
        self._gone = False
        self._keep_alive = keep_alive
        self._connection = connection
        self._head = head
        self._rid = rid
        self.request = request

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Answer once, now or later (from any callback on the event loop's thread). Later calls are
        ignored. Nothing is written when the client has gone. The server appends content-length, date,
        `x-request-id: request.request_id` unless the headers already carry x-request-id, and `connection`
        as keep-alive needs; a HEAD answer is written without its body."""
        if self._done:
            return
        if self._gone:
            self._done = True
            return
        conn = self._conn
        if conn._stopping and conn._queue and conn._queue[-1] is self:
            self._keep_alive = False
            self._connection = _CLOSE
        data = _encode(status, headers, body, self._rid, self._connection, self._head)
        self._done = True  # only now: an answer that fails to encode leaves the exchange unanswered (500)
        conn._complete(self, data)

    @property
    def gone(self) -> bool:
        """The client closed the connection before the answer."""
        return self._gone

    def __repr__(self) -> str:
        return f"Exchange({self.request!r}, done={self._done}, gone={self._gone})"


class DataPlane(Protocol):
    def accepts(self, method: str, path: bytes) -> bool:
        """Whether the request with this method and raw path is the data plane's (called as soon as the
        request head is parsed; cheap). Everything else goes to the ASGI app."""
        ...

    def handle(self, exchange: Exchange) -> None:
        """Answer the exchange, now or later. Should not raise; if it does, the server logs the traceback
        and answers 500 {"error": "internal_error", "message": "internal error"} (never a traceback to the
        client)."""
        ...


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


class _Cycle(_Slot):
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
        self, conn: _Connection, scope: Scope, rid: bytes, keep_alive: bool, connection: bytes, head: bool
    ) -> None:
        _Slot.__init__(self, conn, rid, keep_alive, connection, head)
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
        conn._server._track(conn._loop.create_task(self._run()))

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
            conn._complete(self, _encode(500, _JSON, _INTERNAL_ERROR, self._rid, self._connection, self._head))
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
        parts = [_STATUS_LINES.get(status) or _status_line(status)]
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
            elif name == _X_REQUEST_ID:
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
        parts.append(_date_header())
        if own_id:
            parts += (b"x-request-id: ", self._rid, b"\r\n")
        if own_connection:
            if not self._keep_alive:
                parts.append(_CLOSE)
            elif self.scope["http_version"] == "1.0":
                parts.append(_KEEP_ALIVE_10)
        parts.append(b"\r\n")
        self._head_written = True  # not before: an invalid header is still answered 500
        return b"".join(parts)


class _Rejected(Exception):
    """Raised in a parser callback to stop parsing; the answer is in `_Connection._rejection`."""


class _Connection(asyncio.Protocol):
    __slots__ = (
        "_server",
        "_loop",
        "_app",
        "_dp",
        "_max_head",
        "_max_body",
        "_timeout",
        "_body_timeout",
        "_max_pipelined",
        "_transport",
        "_parser",
        "_queue",
        "_out",
        "_flush_pending",
        "_close_pending",
        "_linger",
        "_closed",
        "_stopping",
        "_no_more",
        "_timer",
        "_body_timer",
        "_halted",
        "_last_active",
        "_read_paused",
        "_write_paused",
        "_drain_waiter",
        "_current",
        "_rejection",
        "_url",
        "_headers",
        "_head_size",
        "_in_head",
        "_head_raw",
        "_feed_len",
        "_ended_in_feed",
        "_content_length",
        "_expect",
        "_rid_raw",
        "_body",
        "_body_size",
    )

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = server._loop
        self._app = server.app
        self._dp = server._dp
        limits = server.limits
        self._max_head = limits.max_header_bytes
        self._max_body = limits.max_body_bytes
        self._timeout = limits.keep_alive_timeout_s
        self._body_timeout = limits.body_timeout_s
        self._max_pipelined = limits.max_pipelined
        self._transport: Any = None
        self._parser = httptools.HttpRequestParser(self)
        self._queue: deque[_Slot] = deque()
        self._out: list[bytes] = []
        self._flush_pending = False
        self._close_pending = False
        self._linger = False  # close_pending closes with a lingering close (after an error answer)
        self._closed = False
        self._stopping = False
        self._no_more = False  # no request after the current one is taken
        self._timer: asyncio.TimerHandle | None = None
        # Armed only while a request's head is complete and its body is not, after a read (see data_received).
        self._body_timer: asyncio.TimerHandle | None = None
        self._halted = False  # after an error answer (the connection's last) nothing more is parsed
        self._last_active = 0.0
        self._read_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._current: _Slot | None = None  # the request whose head is parsed and whose body is not complete
        self._rejection: ApiError | None = None
        self._in_head = False
        self._head_raw = 0
        self._feed_len = 0
        self._ended_in_feed = False
        self._reset()

    def _reset(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_size = 0
        self._content_length: int | None = None
        self._expect: bytes | None = None
        self._rid_raw: bytes | None = None
        self._body: list[bytes] | None = None
        self._body_size = 0

    # -- asyncio.Protocol -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._server._connections.add(self)
        self._last_active = self._loop.time()
        self._timer = self._loop.call_later(self._timeout, self._on_timer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._cancel_body_timer()
        queue = self._queue
        while queue:
            queue.popleft()._lost()
        current = self._current
        if current is not None:
            current._lost()
            self._current = None
        self._out.clear()
        waiter = self._drain_waiter
        if waiter is not None:
            self._drain_waiter = None
            if not waiter.done():
                waiter.set_result(None)
        self._server._forget(self)

    def data_received(self, data: bytes) -> None:
        if self._close_pending or self._closed or self._halted:
            return
        # Writes made while parsing this read are gathered and leave in one write at the end.
        scheduled = self._flush_pending
        self._flush_pending = True
        self._feed_len = len(data)
        self._ended_in_feed = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # the upgrading request closes its connection: what follows its head is not HTTP for us
        except httptools.HttpParserError as exc:
            self._parse_failed(exc)
        else:
            if self._in_head:
                self._head_raw += len(data)
                if self._head_raw > self._max_head:
                    self._reject(self._headers_too_large())
            elif self._current is not None and self._body_timer is None and not self._read_paused:
                # A head complete and its body not, at the end of a read: only now is a timer armed, so a
                # request without a body (or with all of it in one read) never creates one.
                self._start_body_clock()
        if not scheduled:
            if self._out or self._close_pending:
                self._flush()
            else:
                self._flush_pending = False  # nothing to write (the answer comes later): what _flush does

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        waiter = self._drain_waiter
        if waiter is not None:
            self._drain_waiter = None
            if not waiter.done():
                waiter.set_result(None)
        self._update_reading()

    # -- httptools callbacks ----------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._no_more:
            raise _Rejected  # with no rejection recorded: ignored (see _parse_failed)
        self._in_head = True
        # Bytes of the unfinished head: parser callbacks give no offsets, so a head that began in a read
        # where an earlier request ended counts from the next read on (a lower bound: never a false 431);
        # otherwise it began with the read, and the whole read is head.
        self._head_raw = -self._feed_len if self._ended_in_feed else 0
        # What `_reset` does, inline (once per request).
        self._url = b""
        self._headers = []
        self._head_size = 0
        self._content_length = None
        self._expect = None
        self._rid_raw = None
        self._body = None
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self._headers.append((name, value))
        size = self._head_size + len(name) + len(value) + 4
        self._head_size = size
        if size > self._max_head:
            self._rejection = self._headers_too_large()
            raise _Rejected
        if name in _NOTABLE:
            if name == _X_REQUEST_ID:
                if self._rid_raw is None:
                    self._rid_raw = value
            elif name == b"expect":
                self._expect = value
            else:
                self._content_length = int(value)  # the parser has checked the digits

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        raw_method = parser.get_method()
        method = _METHODS.get(raw_method) or raw_method.decode("latin-1")
        version = parser.get_http_version()
        keep_alive = parser.should_keep_alive() and not self._stopping
        if parser.should_upgrade():
            keep_alive = False  # we speak no other protocol; what follows this head is not HTTP
        url = self._url
        if url[:1] == b"/":
            mark = url.find(b"?")
            if mark < 0:
                path, query = url, b""
            else:
                path, query = url[:mark], url[mark + 1 :]
        else:
            path, query = self._odd_target(url)
        supplied = self._rid_raw
        if supplied is None:
            request_id = new_request_id()
            rid = request_id.encode("ascii")
        else:
            request_id, rid = _request_id(supplied)
        length = self._content_length
        if length is not None and length > self._max_body:
            self._rejection = self._body_too_large()
            raise _Rejected
        expect = self._expect
        if expect is not None and expect.lower() != b"100-continue":
            self._rejection = ExpectationFailed("only Expect: 100-continue is supported")
            raise _Rejected
        if not keep_alive:
            connection = _CLOSE
            self._no_more = True
        elif version == "1.1":
            connection = b""
        else:
            connection = _KEEP_ALIVE_10
        head = method == "HEAD"
        dp = self._dp
        try:
            data_plane = dp is not None and dp.accepts(method, path)
        except Exception:
            log.exception("DataPlane.accepts raised on %s %r", method, path)
            self._rejection = ApiError("internal error")  # 500 internal_error
            raise _Rejected from None
        slot: _Slot
        if data_plane:
            request = Request(method, path, query, self._headers, b"", request_id, version)
            slot = Exchange(self, request, rid, keep_alive, connection, head)
        else:
            slot = _Cycle(self, self._scope(method, version, path, query), rid, keep_alive, connection, head)
        queue = self._queue
        queue.append(slot)
        self._current = slot
        if expect is not None and version == "1.1" and length != 0:
            self._emit(slot, _CONTINUE)
        if len(queue) >= self._max_pipelined:
            self._update_reading()

    def on_body(self, body: bytes) -> None:
        size = self._body_size + len(body)
        if size > self._max_body:
            self._rejection = self._body_too_large()
            raise _Rejected
        self._body_size = size
        if self._body is None:
            self._body = [body]
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        self._ended_in_feed = True
        self._rid_raw = None  # a failure before the next head is not this request's
        slot = self._current
        if slot is None:
            return
        self._current = None
        if self._body_timer is not None:
            self._cancel_body_timer()
        chunks = self._body
        body = b"" if chunks is None else chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if slot.__class__ is Exchange:
            exchange: Exchange = slot  # type: ignore[assignment]
            exchange.request.body = body
            try:
                self._dp.handle(exchange)  # type: ignore[union-attr]
            except Exception:
                log.exception("DataPlane.handle raised on %r", exchange.request)
                exchange.answer(500, _JSON, _INTERNAL_ERROR)
        else:
            cycle: _Cycle = slot  # type: ignore[assignment]
            cycle.body = body
            cycle._ready = True
            queue = self._queue
            if queue and queue[0] is cycle:
                cycle._start()

    # -- the request's target and scope ---------------------------------------------------------------

    def _odd_target(self, url: bytes) -> tuple[bytes, bytes]:
        """Path and query of an absolute-form (`http://host/p?q`) or asterisk-form target."""
        if url == b"*":
            return url, b""
        try:
            parsed = httptools.parse_url(url)
        except httptools.HttpParserInvalidURLError:
            self._rejection = BadRequest("malformed request target")
            raise _Rejected from None
        return parsed.path or b"/", parsed.query or b""

    def _scope(self, method: str, version: str, path: bytes, query: bytes) -> Scope:
        transport = self._transport
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "method": method,
            "scheme": "http",
            "path": _decode_path(path),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": self._headers,
            "client": _address(transport.get_extra_info("peername")),
            "server": _address(transport.get_extra_info("sockname")),
            "state": self._server._state.copy(),
        }

    # -- answers, in request order ----------------------------------------------------------------------

    def _emit(self, slot: _Slot, data: bytes) -> None:
        """Part of `slot`'s answer: to the socket when it is the oldest unanswered request, else held."""
        queue = self._queue
        if queue and queue[0] is slot:
            self._out.append(data)
            if not self._flush_pending:
                self._flush_pending = True
                self._loop.call_soon(self._flush)
        elif slot._held is None:
            slot._held = [data]
        else:
            slot._held.append(data)

    def _complete(self, slot: _Slot, data: bytes) -> None:
        """The last of `slot`'s answer (its `_done` is set)."""
        queue = self._queue
        if not queue or queue[0] is not slot:
            if slot._held is None:
                slot._held = [data]
            else:
                slot._held.append(data)
            return
        self._out.append(data)
        # Answered outside this connection's own read (from a node's reply, a task): nothing else of this
        # step is coming for it, so the answer goes to the socket now rather than a loop turn later.
        write_now = not self._flush_pending
        self._flush_pending = True  # what follows in this call (held pipelined answers) joins the write
        queue.popleft()
        if not slot._keep_alive:
            self._close_after_flush()
        elif queue:
            self._advance()
        elif not self._stopping and not self._read_paused:
            self._last_active = self._loop.time()  # `_idle` when it has nothing else to do
        else:
            self._idle()
        if write_now:
            self._flush()

    def _advance(self) -> None:
        queue = self._queue
        out = self._out
        while queue:
            slot = queue[0]
            held = slot._held
            if held is not None:
                slot._held = None
                out += held
                if not self._flush_pending:
                    self._flush_pending = True
                    self._loop.call_soon(self._flush)
            if not slot._done:
                if slot.__class__ is _Cycle and slot._ready and not slot._started:  # type: ignore[attr-defined]
                    slot._start()  # type: ignore[attr-defined]
                if self._read_paused:
                    self._update_reading()
                return
            queue.popleft()
            if not slot._keep_alive:
                self._close_after_flush()
                return
        self._idle()

    def _idle(self) -> None:
        self._last_active = self._loop.time()
        if self._stopping and self._current is None:
            self._close_after_flush()
        elif self._read_paused:
            self._update_reading()

    def _flush(self) -> None:
        self._flush_pending = False
        out = self._out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            if not self._closed:
                self._transport.write(data)
        if self._close_pending and not self._closed:
            transport = self._transport
            if self._linger and transport.can_write_eof():
                self._linger_close(transport)
            else:
                transport.close()

    def _linger_close(self, transport: Any) -> None:
        # A client cut off mid-request may still be sending: closing with its bytes unread makes the kernel
        # reset the connection, which can destroy the error answer before the client reads it. So: end our
        # side, read and drop what still comes for a while, then close.
        self._linger = False
        transport.write_eof()
        if self._read_paused:
            self._read_paused = False
            transport.resume_reading()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(_LINGER_S, transport.close)

    def eof_received(self) -> bool | None:
        # A client's end of input is taken as its leaving (as uvicorn does): the exchanges it leaves behind
        # see `gone` at once, instead of when a later write fails. A client that half-closes and still waits
        # for answers is not served.
        return None

    def _close_after_flush(self) -> None:
        self._close_pending = True
        self._no_more = True
        self._cancel_body_timer()
        queue = self._queue
        while queue:
            queue.popleft()._lost()  # requests after a closing answer are never answered
        current = self._current
        if current is not None:
            current._lost()
            self._current = None
        if not self._flush_pending:
            self._flush()

    def _update_reading(self) -> None:
        pause = self._write_paused or len(self._queue) >= self._max_pipelined
        if pause == self._read_paused or self._closed or self._close_pending:
            return
        self._read_paused = pause
        if pause:
            self._transport.pause_reading()
            # A body cannot arrive while the server does not read: that time is not the client's.
            self._cancel_body_timer()
        else:
            self._transport.resume_reading()
            if self._current is not None and not self._in_head:
                self._start_body_clock()  # the body's whole time again

    async def _drain(self) -> None:
        if not self._write_paused or self._closed:
            return
        waiter = self._drain_waiter
        if waiter is None:
            waiter = self._drain_waiter = self._loop.create_future()
        await waiter

    # -- errors, time-out, shutdown ---------------------------------------------------------------------

    def _parse_failed(self, exc: httptools.HttpParserError) -> None:
        rejection = self._rejection
        self._rejection = None
        if rejection is None:
            if self._no_more and self._current is None:
                return  # bytes after the last request this connection takes
            if isinstance(exc, httptools.HttpParserCallbackError):
                log.error("unexpected error while parsing a request", exc_info=exc)
                rejection = ApiError("internal error")  # 500 internal_error
            else:
                rejection = BadRequest(f"malformed HTTP request: {exc}")
        self._reject(rejection)

    def _headers_too_large(self) -> HeadersTooLarge:
        return HeadersTooLarge(f"the request line and headers exceed {self._max_head} bytes")

    def _body_too_large(self) -> BodyTooLarge:
        return BodyTooLarge(f"the body is larger than {self._max_body} bytes")

    def _reject(self, error: ApiError) -> None:
        """Answer the request being parsed with `error`'s JSON (in order) and close the connection after it;
        nothing after it is parsed. A 4xx is a refusal: counted by the server, with `error.code`."""
        self._in_head = False
        self._linger = True
        self._halted = True
        if self._body_timer is not None:
            self._cancel_body_timer()
        slot = self._current
        self._current = None
        self._no_more = True
        if slot is None or slot._done or slot._gone:
            slot = _Slot(self, _request_id(self._rid_raw)[1], False, _CLOSE, False)
            self._queue.append(slot)
        slot._keep_alive = False
        slot._done = True
        headers = _JSON
        if error.headers:  # the server says `connection: close` itself
            headers = [h for h in error_headers(error) if h[0] != b"connection"]
        body = error_json(error.code, error.message)
        self._complete(slot, _encode(error.status, headers, body, slot._rid, _CLOSE, slot._head))
        if error.status < 500:
            self._server._refused(error.code)

    def _start_body_clock(self) -> None:
        """(Re)start the time the body of the request being read has to arrive (none with no body timeout)."""
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self._body_timeout and not self._halted and not self._closed:
            self._body_timer = self._loop.call_later(self._body_timeout, self._on_body_timer)

    def _cancel_body_timer(self) -> None:
        timer = self._body_timer
        if timer is not None:
            self._body_timer = None
            timer.cancel()

    def _on_body_timer(self) -> None:
        self._body_timer = None
        if self._closed or self._close_pending or self._halted or self._current is None or self._in_head:
            return
        self._reject(BodyTimeout(f"the body did not arrive within {self._body_timeout:g} s"))

    def _on_timer(self) -> None:
        # One timer per connection, re-armed only here: nothing is created or cancelled per request. Idle
        # means no request awaiting its answer or its body since `_last_active` (the last answer, or the
        # connection's start): a head still arriving after that long is dropped with the connection.
        self._timer = None
        if self._closed or self._close_pending:
            return
        delay = self._timeout
        if not self._queue:
            idle = self._loop.time() - self._last_active
            if idle >= delay:
                self._close_after_flush()
                return
            delay -= idle
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _shutdown(self) -> None:
        """The server stops: close now when idle, else after the answers under way."""
        self._stopping = True
        self._no_more = True
        if not self._queue and self._current is None:
            self._close_after_flush()

    def _abort(self) -> None:
        if not self._closed:
            self._transport.abort()


def url_of(sock: socket.socket) -> str:
    """The http:// address a listening socket answers on."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class StartupError(Exception):
    """Raised by an app's lifespan when it cannot start for a reason its operator can act on (ZooKeeper
    unreachable, a node id in use): the server logs the message as one line, without a traceback."""


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to (host, port), one per address the host resolves to, not yet listening: the port is
    ours (a second process gets "address in use" here, before it does anything else), but connections are
    refused rather than queued until `listen`. Raises OSError."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen: set[tuple[Any, ...]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class _Lifespan:
    """The ASGI lifespan protocol (spec 2.0) around the server's listening."""

    def __init__(self, app: ASGIApp, state: dict[str, Any]) -> None:
        self._app = app
        self._state = state
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._startup: asyncio.Future[tuple[bool, str]] | None = None
        self._shutdown: asyncio.Future[tuple[bool, str]] | None = None
        self._supported = True

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        self._startup = loop.create_future()
        self._shutdown = loop.create_future()
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self._state}
        self._task = task = loop.create_task(self._app(scope, self._inbox.get, self._send))
        self._inbox.put_nowait({"type": "lifespan.startup"})
        await asyncio.wait((self._startup, task), return_when=asyncio.FIRST_COMPLETED)
        if self._startup.done():
            failed, message = self._startup.result()
            if failed:
                await asyncio.wait((task,), timeout=5.0)
                exc = self._retrieve()
                if isinstance(exc, StartupError):
                    raise exc
                raise RuntimeError(f"lifespan startup failed: {message}")
            return
        # Per the lifespan spec, an app that ends (or raises) before answering startup does not support it.
        self._supported = False
        exc = None if task.cancelled() else task.exception()
        log.info("the ASGI app does not support the lifespan protocol (%r); going on without it", exc)

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind.startswith("lifespan.startup."):
            future = self._startup
        elif kind.startswith("lifespan.shutdown."):
            future = self._shutdown
        else:
            raise RuntimeError(f"unexpected lifespan message {kind!r}")
        if future is not None and not future.done():
            future.set_result((kind.endswith(".failed"), str(message.get("message", ""))))

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        task = self._task
        if not self._supported or task is None or self._shutdown is None:
            return
        if not task.done():
            self._inbox.put_nowait({"type": "lifespan.shutdown"})
            await asyncio.wait((self._shutdown, task), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait((task,), timeout=5.0)
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
        reported = self._shutdown.done()
        if reported and self._shutdown.result()[0]:
            log.error("lifespan shutdown failed: %s", self._shutdown.result()[1])
            self._retrieve()
        elif not reported:
            exc = self._retrieve()
            log.error("the lifespan ended without completing its shutdown", exc_info=exc)
        else:
            exc = self._retrieve()
            if exc is not None:
                log.error("the lifespan raised after its shutdown", exc_info=exc)

    def _retrieve(self) -> BaseException | None:
        task = self._task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()


class HttpServer:
    """keyroute's HTTP/1.1 server: the data plane answered directly, everything else by the ASGI app."""

    def __init__(
        self,
        app: ASGIApp,
        limits: ServerLimits = ServerLimits(),  # noqa: B008 (frozen: one shared default is safe)
        data_plane: Callable[[Any], DataPlane | None] | None = None,
        on_refusal: Callable[[str], None] | None = None,
        name: str = "the server",
    ) -> None:
        """`app`: the Starlette app (admin, health, metrics). `data_plane(app_state)` is called once, after
        the lifespan's startup, with the app's `state` (starlette.datastructures.State: the lifespan put the
        service's objects there); it returns the DataPlane (None: everything goes to the app).
        `on_refusal(code)` is called, on the event loop, for every request the server refuses itself before
        any service code sees it, with the API error code of its answer: bad_request (400, malformed),
        body_timeout (408), body_too_large (413), expectation_failed (417), headers_too_large (431). The
        same counts are kept in `refusals`. `name` (e.g. "node n1") starts the lines it logs about itself."""
        self.name = name
        self.app = app
        self.limits = limits
        self.on_refusal = on_refusal
        # error code -> requests the server refused itself with it
        self.refusals: dict[str, int] = {}
        self._data_plane_factory = data_plane
        self._dp: DataPlane | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.Server] = []
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._state: dict[str, Any] = {}
        self._lifespan: _Lifespan | None = None
        self._stopping = False
        self._all_closed: asyncio.Future[None] | None = None
        self._stop_requested: asyncio.Event | None = None
        self._stop_wanted = False

    @property
    def data_plane(self) -> DataPlane | None:
        """The DataPlane `data_plane(app_state)` returned at start (None before, or when there is none)."""
        return self._dp

    @property
    def state(self) -> dict[str, Any]:
        """The lifespan state (ASGI `scope["state"]`); each request's scope gets a shallow copy."""
        return self._state

    async def start(self, host: str = "127.0.0.1", port: int = 0, sockets: list[socket.socket] | None = None) -> None:
        """Bind the port (OSError when taken: nothing else has happened), lifespan startup (an exception there
        propagates, nothing listens), then listen. port 0 = any free port. The app's startup (a node joining
        its cluster) thus runs only once the port is known to be ours."""
        if self._servers or self._lifespan is not None:
            raise RuntimeError("the server is already started")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stopping = False
        owned = not sockets
        if owned:
            sockets = bind(host, port)
        lifespan = _Lifespan(self.app, self._state)
        try:
            await lifespan.startup()
        except BaseException:
            if owned:
                for sock in sockets or ():
                    sock.close()
            raise
        try:
            if self._data_plane_factory is not None:
                self._dp = self._data_plane_factory(self._app_state())
            for sock in sockets or ():
                self._servers.append(await loop.create_server(self._connection, sock=sock, backlog=2048))
        except BaseException:
            for server in self._servers:
                server.close()
            self._servers = []
            self._dp = None
            await lifespan.shutdown()
            raise
        self._lifespan = lifespan
        # Sockets handed in are shared by worker processes: whoever handed them in says where it listens.
        log.log(
            logging.INFO if owned else logging.DEBUG,
            "%s is listening on %s",
            self.name,
            ", ".join(url_of(s) for server in self._servers for s in server.sockets),
        )

    def _app_state(self) -> Any:
        state = getattr(self.app, "state", None)
        if state is not None:
            return state
        from starlette.datastructures import State

        return State(self._state)

    def _connection(self) -> _Connection:
        return _Connection(self)

    def _refused(self, code: str) -> None:
        self.refusals[code] = self.refusals.get(code, 0) + 1
        on_refusal = self.on_refusal
        if on_refusal is not None:
            try:
                on_refusal(code)
            except Exception:
                log.exception("on_refusal(%r) raised", code)

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget(self, conn: _Connection) -> None:
        self._connections.discard(conn)
        if not self._connections and self._all_closed is not None and not self._all_closed.done():
            self._all_closed.set_result(None)

    @property
    def port(self) -> int:
        """The bound port (first listening socket)."""
        if not self._servers:
            raise RuntimeError("the server is not listening")
        return int(self._servers[0].sockets[0].getsockname()[1])

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish (up to grace_s), close idle and then all
        connections, run the lifespan's shutdown."""
        if self._stopping or self._lifespan is None:
            return
        self._stopping = True
        loop = asyncio.get_running_loop()
        for server in self._servers:
            server.close()
        self._all_closed = loop.create_future()
        for conn in list(self._connections):
            conn._shutdown()
        if self._connections:
            await asyncio.wait((self._all_closed,), timeout=grace_s)
        for conn in list(self._connections):
            conn._abort()
        if self._connections:
            await asyncio.wait((self._all_closed,), timeout=1.0)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for server in self._servers:
            await asyncio.wait((loop.create_task(server.wait_closed()),), timeout=1.0)
        self._servers = []
        self._all_closed = None
        lifespan, self._lifespan = self._lifespan, None
        await lifespan.shutdown()
        self._dp = None

    def request_stop(self) -> None:
        """Make `run()` stop gracefully, from any thread (what SIGINT/SIGTERM do on the main thread)."""
        self._stop_wanted = True
        loop, event = self._loop, self._stop_requested
        if loop is not None and event is not None:
            loop.call_soon_threadsafe(event.set)

    async def _serve(self, host: str, port: int, sockets: list[socket.socket] | None) -> int:
        loop = asyncio.get_running_loop()
        self._loop = loop
        stop = self._stop_requested = asyncio.Event()
        try:
            await self.start(host, port, sockets)
        except StartupError as exc:
            log.error("%s did not start: %s", self.name, exc)
            return 1
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()
            log.error("%s did not start: cannot listen on %s port %d: %s", self.name, host or "*", port, reason)
            return 1
        except Exception:
            log.exception("%s did not start", self.name)
            return 1
        if self._stop_wanted:
            stop.set()
        installed: list[int] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(sig, stop.set)
                except (NotImplementedError, RuntimeError, ValueError):
                    continue
                installed.append(sig)
        try:
            await stop.wait()
            log.info("stopping")
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
        await self.stop()
        self._stop_wanted = False
        return 0


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(server: HttpServer, host: str, port: int, sockets: list[socket.socket] | None = None) -> int:
    """Blocking: serve on a new event loop (uvloop when installed) until SIGINT/SIGTERM (when called on the
    main thread), then stop gracefully. Exit code: 0 after a clean stop; 1 when startup failed (logged)."""
    loop = _new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(server._serve(host, port, sockets))
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
