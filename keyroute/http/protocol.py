"""keyroute's HTTP/1.1 connection protocol (asyncio.Protocol + httptools): requests parsed, answered in request
order, under the server's limits and flow control. A data-plane request is handed to the `DataPlane` as an
`Exchange` straight from the parser's callbacks (no ASGI, no task); any other runs the ASGI app
(keyroute.http.asgi).

Behaviour contract (checked over real sockets by tests/unit/http/test_protocol.py, its timers there on an event
loop whose time the test moves, the ASGI rows by test_asgi.py and the stop by test_server.py; the single write
aside):

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
client gone (or its end of input)      ``Exchange.gone`` and its ``on_done`` callback called at once, ASGI
before the answer                      ``http.disconnect``; a later answer is dropped, nothing raised
writes of one event-loop step          one socket write; reading pauses while the write buffer is full or
                                       ``max_pipelined`` requests wait for their answers
server stops                           idle connections closed; requests under way answered (the last with
                                       ``connection: close``) for up to ``grace_s``, then everything closed
idle for keep_alive_timeout_s          closed
TLS connection without a client        only GET/HEAD of a probe path (``/healthz``, ``/readyz``) answered;
certificate where one is required      anything else 403 ``client_certificate_required``, closed
TLS client certificate the server's    every request 403 (``member_certificate_refused``: the check's error),
``peer_check`` refuses                 closed
every answer                           ``date``, ``x-request-id`` (the client's when
                                       ``keyroute.runtime.logs.acceptable_request_id`` accepts it, else
                                       ``keyroute.runtime.logs.new_request_id()``; an answer that carries its own
                                       is left alone); no ``server``
=====================================  =========================================================================

Error bodies are the API's (``keyroute.api``): ``{"error": code, "message": text}`` with
``content-type: application/json``; a traceback never goes to a client. Every request the server refuses
itself (the 400, 408, 413, 417 and 431 above), before any service code sees it, is counted in
``HttpServer.refusals`` and reported to ``on_refusal`` with its error code.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import httptools

from keyroute.api import (
    ApiError,
    BadRequest,
    BodyTimeout,
    BodyTooLarge,
    HeadersTooLarge,
    error_headers,
    error_json,
)
from keyroute.http.admission import PROBE_PATHS
from keyroute.http.asgi import Cycle, http_scope
from keyroute.http.errors import ClientCertificateRequired, ExpectationFailed
from keyroute.http.exchange import Exchange, Request, Slot
from keyroute.http.tls import without_certificate
from keyroute.http.wire import (
    CLOSE,
    CONTINUE,
    INTERNAL_ERROR,
    JSON,
    KEEP_ALIVE_10,
    X_REQUEST_ID,
    encode,
    request_id_from,
)
from keyroute.runtime.logs import REQUEST_ID_NUMBERS, REQUEST_ID_PREFIX

if TYPE_CHECKING:
    from keyroute.http.asgi import ASGIApp
    from keyroute.http.exchange import DataPlane, ServerLimits

log = logging.getLogger(__name__)

# Final: the compiled build (setup.py) reads these from C statics, not from the module's dict.
_METHODS: Final = {m.encode(): m for m in ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE")}
# Headers the parser's callbacks must look at; everything else is only collected.
_NOTABLE: Final = frozenset((b"connection", b"content-length", b"expect", b"upgrade", X_REQUEST_ID))
# How long a connection closed after an error answer keeps reading (and dropping) what the client still sends.
_LINGER_S: Final = 2.0
# keyroute.runtime.logs.new_request_id's ids, made here: C statics and a native `next` in the compiled build.
_ID_PREFIX: Final = REQUEST_ID_PREFIX
_ID_NUMBERS: Final = REQUEST_ID_NUMBERS
_hex: Final = hex
# What a TLS client without a certificate may ask where certificates are required: the kubelet's probes.
_PROBES: Final = frozenset(path.encode("ascii") for path in PROBE_PATHS)
_PROBE_METHODS: Final = frozenset(("GET", "HEAD"))


class ServerState:
    """What a server shares with its connections (as uvicorn's `ServerState`): the open connections, the tasks
    they started, the lifespan state, the client-certificate rules, and the count of the requests refused by
    the server itself. A server makes one and hands it to each `Connection` it makes; a test makes its own.

    `lifespan_state`: the ASGI lifespan state (each request's scope gets a shallow copy). `certificate_option`:
    the option of the CA client certificates must chain to ("": none is required; see `HttpServer`).
    `peer_check(transport)`: asked once per TLS connection whether its client's certificate is refused.
    `on_refusal(code)`: told of every request the server refuses itself (`refusals` counts them by code)."""

    def __init__(
        self,
        lifespan_state: dict[str, Any] | None = None,
        certificate_option: str = "",
        peer_check: Callable[[Any], ApiError | None] | None = None,
        on_refusal: Callable[[str], None] | None = None,
    ) -> None:
        self.lifespan_state: dict[str, Any] = {} if lifespan_state is None else lifespan_state
        self.certificate_option = certificate_option
        self.peer_check = peer_check
        self.on_refusal = on_refusal
        self.refusals: dict[str, int] = {}
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        # Set (by the server stopping) to learn when the last connection has gone.
        self.all_closed: asyncio.Future[None] | None = None

    def refused(self, code: str) -> None:
        """A request refused by the server itself, with the API error code of its answer."""
        self.refusals[code] = self.refusals.get(code, 0) + 1
        on_refusal = self.on_refusal
        if on_refusal is not None:
            try:
                on_refusal(code)
            except Exception:
                log.exception("on_refusal(%r) raised", code)

    def track(self, task: asyncio.Task[None]) -> None:
        """Keep `task` (a request's ASGI app) until it is done: a stopping server cancels what is left."""
        tasks = self.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def opened(self, conn: Connection) -> None:
        """`conn` is made (its transport connected)."""
        self.connections.add(conn)

    def closed(self, conn: Connection) -> None:
        """`conn` is gone; the last one to go resolves `all_closed` when it is set."""
        connections = self.connections
        connections.discard(conn)
        waiter = self.all_closed
        if not connections and waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Rejected(Exception):
    """Raised in a parser callback to stop parsing; the answer is in `Connection._rejection`."""


class Connection(asyncio.Protocol):
    """One client connection: the parser's callbacks, the answer order of its requests (`Slot`s: `Exchange`
    for the data plane, `Cycle` for the ASGI app), flow control, its timers and its shutdown. The slots and
    the ASGI bridge use its underscore attributes and methods: they are keyroute.http's own, for no other
    package.

    Built from what it needs (as uvicorn's `HttpToolsProtocol(config, server_state, _loop)`): the server's
    `limits`, the `ServerState` it shares with the server's other connections, the event `loop` whose clock
    and timers it uses (idle and body time-outs, the lingering close; a test hands in one whose time it
    moves), the ASGI `app`, and the `data_plane` (None: every request goes to the app, as on an admin
    port)."""

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
        "_write",
        "_parser",
        "_get_method",
        "_keeps_alive",
        "_feed",
        "_dp_prefix",
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
        "_upgrade",
        "_connection_named",
        "_body",
        "_body_size",
        "_probes_only",
        "_refused",
    )

    def __init__(
        self,
        limits: ServerLimits,
        server_state: ServerState,
        loop: asyncio.AbstractEventLoop,
        app: ASGIApp,
        data_plane: DataPlane | None = None,
    ) -> None:
        self._server = server_state
        self._loop = loop
        self._app = app
        self._dp = data_plane
        self._max_head = limits.max_header_bytes
        self._max_body = limits.max_body_bytes
        self._timeout = limits.keep_alive_timeout_s
        self._body_timeout = limits.body_timeout_s
        self._max_pipelined = limits.max_pipelined
        self._transport: Any = None
        self._write: Any = None  # the transport's write, bound once (connection_made)
        self._parser = httptools.HttpRequestParser(self)
        self._feed = self._parser.feed_data  # bound once: one lookup per connection, not per read
        self._get_method = self._parser.get_method  # and these two, asked once per request
        self._keeps_alive = self._parser.should_keep_alive
        # What every data-plane path starts with, when the data plane says (`RoutedDataPlane.prefix`): then a
        # request is the data plane's by one comparison, else by asking `accepts`.
        self._dp_prefix: bytes | None = getattr(self._dp, "prefix", None)
        # The requests awaiting their answers, oldest first: a list, not a deque, so that the compiled build
        # (setup.py) appends, looks and takes natively; it holds at most `max_pipelined` slots.
        self._queue: list[Slot] = []
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
        self._current: Slot | None = None  # the request whose head is parsed and whose body is not complete
        self._rejection: ApiError | None = None
        self._in_head = False
        self._head_raw = 0
        self._feed_len = 0
        self._ended_in_feed = False
        self._probes_only = False  # a TLS client without the certificate the server requires (connection_made)
        self._refused: ApiError | None = None  # ...or with one it refuses (its answer to every request)
        self._reset()

    def _reset(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_size = 0
        self._content_length: int | None = None
        self._expect: bytes | None = None
        self._rid_raw: bytes | None = None
        self._upgrade = False
        self._connection_named = False  # the head has a Connection header
        self._body: list[bytes] | None = None
        self._body_size = 0

    # -- asyncio.Protocol -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._write = transport.write  # type: ignore[attr-defined]
        server = self._server
        server.opened(self)
        # Decided once, the handshake being complete: only such a connection checks its requests' targets.
        if server.certificate_option and without_certificate(transport):
            self._probes_only = True
        elif server.peer_check is not None:
            refused = server.peer_check(transport)
            if refused is not None:
                self._refused = refused
                self._probes_only = True  # the one flag a request looks at: every request is refused
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
            queue.pop(0)._lost()
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
        self._server.closed(self)

    def data_received(self, data: bytes) -> None:
        if self._close_pending or self._closed or self._halted:
            return
        # Writes made while parsing this read are gathered and leave in one write at the end.
        scheduled = self._flush_pending
        self._flush_pending = True
        self._feed_len = len(data)
        self._ended_in_feed = False
        try:
            self._feed(data)
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
        self._upgrade = self._connection_named = False
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
            if name == X_REQUEST_ID:
                if self._rid_raw is None:
                    self._rid_raw = value
            elif name == b"expect":
                self._expect = value
            elif name == b"upgrade":
                self._upgrade = True
            elif name == b"connection":
                self._connection_named = True
            else:
                self._content_length = int(value)  # the parser has checked the digits

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        raw_method = self._get_method()
        method = _METHODS.get(raw_method) or raw_method.decode("latin-1")
        alive = self._keeps_alive()
        # Of the versions llhttp parses (0.9, 1.0, 1.1, 2.0), only HTTP/1.1 keeps a connection alive without
        # a Connection header: the common case needs no version string (get_http_version formats one).
        version = "1.1" if alive and not self._connection_named else parser.get_http_version()
        keep_alive = alive and not self._stopping
        # Only a request with an Upgrade header, or a CONNECT, can be one (one parser call less for the rest).
        if (self._upgrade or method == "CONNECT") and parser.should_upgrade():
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
        if self._probes_only and (self._refused is not None or path not in _PROBES or method not in _PROBE_METHODS):
            if self._refused is not None:
                self._rejection = self._refused
                raise _Rejected
            option = self._server.certificate_option
            self._rejection = ClientCertificateRequired(
                f"this server requires a client certificate chaining to its {option}: without one only the"
                f" probes ({', '.join(sorted(PROBE_PATHS))}) answer"
            )
            raise _Rejected
        supplied = self._rid_raw
        if supplied is None:
            request_id = _ID_PREFIX + _hex(next(_ID_NUMBERS))[2:]  # new_request_id(), inline
            rid = request_id.encode("ascii")
        else:
            request_id, rid = request_id_from(supplied)
        length = self._content_length
        if length is not None and length > self._max_body:
            self._rejection = self._body_too_large()
            raise _Rejected
        expect = self._expect
        if expect is not None and expect.lower() != b"100-continue":
            self._rejection = ExpectationFailed("only Expect: 100-continue is supported")
            raise _Rejected
        if not keep_alive:
            connection = CLOSE
            self._no_more = True
        elif version == "1.1":
            connection = b""
        else:
            connection = KEEP_ALIVE_10
        head = method == "HEAD"
        dp = self._dp
        prefix = self._dp_prefix
        try:
            data_plane = path.startswith(prefix) if prefix is not None else dp is not None and dp.accepts(method, path)
        except Exception:
            log.exception("DataPlane.accepts raised on %s %r", method, path)
            self._rejection = ApiError("internal error")  # 500 internal_error
            raise _Rejected from None
        slot: Slot
        if data_plane:
            exchange = Exchange(self, rid, keep_alive, connection, head)
            exchange.request = Request(method, path, query, self._headers, b"", request_id, version)
            slot = exchange
        else:
            state = self._server.lifespan_state
            scope = http_scope(method, version, path, query, self._headers, self._transport, state)
            slot = Cycle(self, scope, rid, keep_alive, connection, head)
        queue = self._queue
        queue.append(slot)
        self._current = slot
        if expect is not None and version == "1.1" and length != 0:
            self._emit(slot, CONTINUE)
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
                exchange.answer(500, JSON, INTERNAL_ERROR)
        else:
            cycle: Cycle = slot  # type: ignore[assignment]
            cycle.body = body
            cycle._ready = True
            queue = self._queue
            if queue and queue[0] is cycle:
                cycle._start()

    # -- the request's target -------------------------------------------------------------------------------

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

    # -- answers, in request order ----------------------------------------------------------------------

    def _emit(self, slot: Slot, data: bytes) -> None:
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

    def _complete(self, slot: Slot, data: bytes) -> None:
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
        queue.pop(0)
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
                if slot.__class__ is Cycle and slot._ready and not slot._started:  # type: ignore[attr-defined]
                    slot._start()  # type: ignore[attr-defined]
                if self._read_paused:
                    self._update_reading()
                return
            queue.pop(0)
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
                self._write(data)
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
            queue.pop(0)._lost()  # requests after a closing answer are never answered
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
        nothing after it is parsed. A 4xx is a refusal: counted by the server, with `error.code` (but for a
        missing client certificate: the server's refusals are those of a request's form, SERVER_REFUSALS)."""
        self._in_head = False
        self._linger = True
        self._halted = True
        if self._body_timer is not None:
            self._cancel_body_timer()
        slot = self._current
        self._current = None
        self._no_more = True
        if slot is None or slot._done or slot._gone:
            slot = Slot(self, request_id_from(self._rid_raw)[1], False, CLOSE, False)
            self._queue.append(slot)
        slot._keep_alive = False
        slot._done = True
        headers = JSON
        if error.headers:  # the server says `connection: close` itself
            headers = [h for h in error_headers(error) if h[0] != b"connection"]
        body = error_json(error.code, error.message)
        self._complete(slot, encode(error.status, headers, body, slot._rid, CLOSE, slot._head))
        if error.status < 500 and error.__class__ is not ClientCertificateRequired and error is not self._refused:
            self._server.refused(error.code)

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
