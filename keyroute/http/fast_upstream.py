"""The wire between members: a lean HTTP/1.1 keep-alive pool on asyncio Protocols and httptools, used by the
router to reach nodes and by a node to forward a read to another node.

httpx costs 0.6-1.2 ms of CPU per proxied read on our machines; this does only what members need (GET and
POST to http:// and https:// nodes, whole bodies, keep-alive) for a small fraction of that (benchmarks/RESULTS.md).

    UpstreamUnavailable(node_fault=True)    connect refused/timed out, reset, EOF or a malformed reply
                                            mid-response, the request timed out
    UpstreamUnavailable(node_fault=False)   every connection to the origin stayed busy for `pool_wait_s`,
                                            or the client is closed
    ValueError                              a URL that is not http:// (or https:// with `tls`), a header
                                            that would break the request head (CR/LF, a name that is not
                                            a token)
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import httptools

from keyroute.http.tls import describe
from keyroute.http.upstream import UpstreamResponse, UpstreamUnavailable
from keyroute.runtime.native import mypyc_attr

DEFAULT_MAX_CONNECTIONS_PER_ORIGIN = 256
# Shorter than the nodes' keep-alive timeout (5 s, keyroute.http.exchange's ServerLimits), so we usually let an
# idle connection go before the node does; when the node's close still crosses our next request on the wire,
# that request is sent once more.
DEFAULT_IDLE_EXPIRY_S = 4.0
DEFAULT_POOL_WAIT_S = 1.0

# Set by us from the URL and the body; a caller's value would contradict the framing we send.
_FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "upgrade"})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
_REQUEST_ID = "x-request-id"
# A request target is sent as is: it must already be percent-encoded ASCII without spaces or controls.
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")
# Response headers that change how the message is framed or decoded.
# Constants the compiled build (setup.py) reads from C statics (Final) instead of the module's dict.
_SPECIAL: Final = frozenset({b"content-length", b"transfer-encoding", b"content-encoding"})
_WHEN_CLOSED_MESSAGE: Final = "the upstream client is closed"
_SCHEMES: Final = ("http://", "https://")
_new_tuple: Final = tuple.__new__
_UPSTREAM_RESPONSE: Final = UpstreamResponse  # a C static in the compiled build, not a global looked up


class _Failure(Exception):
    """One exchange on one connection went wrong. `retriable` when a reused connection was closed by the
    peer before any byte of the reply arrived: the node never saw the request or never replied to it."""

    def __init__(self, message: str, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


class _Connection(asyncio.Protocol):
    """One TCP connection to a node; carries one exchange at a time and is reused while the node allows.

    No `__slots__`: a connection lives for many requests, and every attribute is set in `__init__` in one
    order, so CPython keeps them as compactly and reads them as fast as slots."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.feed = self.parser.feed_data  # bound once per connection, not looked up per reply
        self.status_code = self.parser.get_status_code  # and these two, asked once per reply
        self.keeps_alive = self.parser.should_keep_alive
        self.write: Any = None  # the transport's write, bound once (connection_made)
        self.waiter: Any = None  # an asyncio.Future[UpstreamResponse] or an _Exchange
        # Resolved when the socket is really gone, so aclose() can wait for it.
        self.lost: asyncio.Future[None] = pool.loop.create_future()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.received = False
        self.replied = False  # this exchange's reply is complete (a second one is refused)
        self.framed = False
        self.until_eof = False
        self.encoding: bytes | None = None
        self.reusable = True
        self.counted = False
        self.idle_since = 0.0

    # -- one exchange -------------------------------------------------------------------------------

    def start(self, request: bytes, deadline: float) -> asyncio.Future[UpstreamResponse]:
        waiter: asyncio.Future[UpstreamResponse] = self.pool.loop.create_future()
        self.start_with(request, deadline, waiter)
        return waiter

    def start_with(self, request: bytes, deadline: float, waiter: Any) -> None:
        """Send `request`; the reply (or a _Failure) goes to `waiter`: a future, or anything with its
        `done`, `set_result` and `set_exception` (`_Exchange`)."""
        self.waiter = waiter
        self.status = 0
        self.headers = []
        self.body = []
        self.received = self.framed = self.until_eof = self.replied = False
        self.encoding = None
        transport = self.transport
        if transport is None or transport.is_closing():
            waiter.set_exception(_Failure("the connection was closed before the request", retriable=True))
            return
        # FastUpstream.watch, inline (once per request).
        upstream = self.pool.upstream
        upstream._in_flight[self] = deadline
        if upstream._watchdog is None or deadline < upstream._watchdog_at:
            upstream._arm_watchdog(deadline)
        self.write(request)

    def end_exchange(self) -> None:
        """The exchange is over (replied, failed or abandoned): nothing waits, no deadline is watched."""
        self.waiter = None
        self.pool.upstream._in_flight.pop(self, None)  # unwatch, inline

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            # abort, not close: nothing we might still have to send matters, and the socket goes at once.
            self.transport.abort()

    def _fail(self, failure: _Failure) -> None:
        self.reusable = False
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(failure)
        self.close()

    def timed_out(self) -> None:
        self._fail(_Failure(f"no complete reply within {self.pool.upstream.timeout_s}s"))

    # -- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = transport  # type: ignore[assignment]
        self.write = transport.write  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        waiter = self.waiter
        # An _Exchange is its connection's waiter only until it ends (its end clears `waiter`): only a future
        # has to be asked whether it is done.
        if waiter is None or (waiter.__class__ is not _Exchange and waiter.done()):
            # Bytes nobody asked for: the connection is out of step with its requests, never reuse it.
            self.close()
            return
        self.received = True
        try:
            self.feed(data)
        except httptools.HttpParserError as exc:
            self._fail(_Failure(f"malformed response: {exc}"))
        except httptools.HttpParserUpgrade:
            self._fail(_Failure("the node switched protocols on a read"))

    def eof_received(self) -> bool:
        waiter = self.waiter
        if waiter is not None and not waiter.done() and self.until_eof:
            # A body without Content-Length or chunking ends where the connection ends.
            self.reusable = False
            self._complete()
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self.transport = None
        if not self.lost.done():
            self.lost.set_result(None)
        waiter = self.waiter
        if waiter is None:
            self.pool.forget(self)
        elif not waiter.done():
            what = "reset" if exc is not None else "closed"
            if self.received:
                waiter.set_exception(_Failure(f"the node {what} the connection mid-response"))
            else:
                waiter.set_exception(_Failure(f"the node {what} the connection", retriable=True))

    # -- httptools callbacks ------------------------------------------------------------------------
    #
    # No on_message_begin (a callback per reply saved): a second response to one request is caught by its
    # head instead (`replied`), which fails the parse: the connection is closed, never reused.

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self.headers.append((name, value))
        if name in _SPECIAL:
            if name == b"content-encoding":
                self.encoding = value.strip().lower()
            else:
                self.framed = True

    def on_headers_complete(self) -> None:
        if self.replied:
            raise _Failure("a second response arrived for one request")
        self.status = status = self.status_code()
        self.until_eof = not self.framed and status >= 200 and status not in (204, 304)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.status < 200:
            # An informational reply (we never ask for one, but a node may send it): the real one follows.
            self.headers = []
            self.body = []
            self.framed = False
            return
        if not self.keeps_alive():
            self.reusable = False  # Connection: close, or HTTP/1.0 without keep-alive
        waiter = self.waiter
        if self.encoding is None and waiter is not None:
            # _complete's common case, inline (once per reply): no content coding to undo.
            chunks = self.body
            headers = self.headers
            self.headers = []  # a further response's lines go here, not into the reply handed on
            self.replied = True
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            # UpstreamResponse(...) without the Python frame of a NamedTuple's generated __new__.
            waiter.set_result(_new_tuple(_UPSTREAM_RESPONSE, (self.status, headers, body)))
            return
        self._complete()

    def _complete(self) -> None:
        waiter = self.waiter
        if waiter is None:
            raise _Failure("a second response arrived for one request")
        chunks = self.body
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        headers = self.headers
        self.headers = []
        self.replied = True
        if self.encoding is not None and self.encoding != b"identity":
            try:
                body = _decode(self.encoding, body)
            except (ValueError, zlib.error) as exc:
                self._fail(_Failure(f"undecodable body: {exc}"))
                return
            # The body no longer has that coding, so the header no longer describes it (as httpx does).
            headers = [(k, v) for k, v in headers if k != b"content-encoding"]
        # UpstreamResponse(...) without the Python frame of a NamedTuple's generated __new__ (once per reply).
        waiter.set_result(_new_tuple(_UPSTREAM_RESPONSE, (self.status, headers, body)))


class StaleConnection(UpstreamUnavailable):
    """`FastUpstream.get_now` met an idle connection the node had already closed: it never saw the request."""


def _ended_already(result: UpstreamResponse | Exception) -> None:
    raise AssertionError("an exchange ended twice")


_ENDED_ALREADY: Final = _ended_already


class _Exchange:
    """One request sent by `FastUpstream.get_now` and its reply, on one connection: the connection's waiter,
    which hands the connection back and the reply (or the failure) on at once, instead of waking a
    coroutine. (Its own `__init__`, not a dataclass's: that one stays interpreted in the compiled build.)"""

    __slots__ = ("upstream", "pool", "conn", "target", "on_reply", "ended")

    def __init__(
        self,
        upstream: FastUpstream,
        pool: _Pool,
        conn: _Connection,
        target: str,
        on_reply: Callable[[UpstreamResponse | Exception], None],
    ) -> None:
        self.upstream = upstream
        self.pool = pool
        self.conn = conn
        self.target = target  # the path asked for, named with the pool's origin in a failure
        self.on_reply = on_reply
        self.ended = False

    def done(self) -> bool:
        return self.ended

    def cancel(self) -> None:
        """Abandon the exchange: the connection is closed (whatever is still on the wire is not ours to
        read) and `on_reply` is not called."""
        if self.ended:
            return
        self._end()
        self.pool.discard(self.conn)

    def set_result(self, reply: UpstreamResponse) -> None:
        # _end and _Connection.end_exchange, inline (once per reply)
        self.ended = True
        conn = self.conn
        conn.waiter = None
        self.upstream._in_flight.pop(conn, None)
        on_reply = self.on_reply
        self.on_reply = _ENDED_ALREADY
        self.pool.release(conn)
        on_reply(reply)

    def set_exception(self, failure: BaseException) -> None:
        on_reply = self._end()
        self.pool.discard(self.conn)
        if self.upstream.closed:  # aclose() broke the connection off: not the node's fault
            on_reply(UpstreamUnavailable(_WHEN_CLOSED_MESSAGE, node_fault=False))
        elif isinstance(failure, _Failure) and failure.retriable:
            on_reply(StaleConnection(f"GET {self.pool.origin}{self.target}: {failure}"))
        else:
            on_reply(UpstreamUnavailable(f"GET {self.pool.origin}{self.target}: {failure}"))

    def _end(self) -> Callable[[UpstreamResponse | Exception], None]:
        self.ended = True
        self.conn.end_exchange()
        on_reply = self.on_reply
        # Let go of the caller's callback: whoever keeps this exchange (to cancel it) is usually what the
        # callback belongs to, and a reference cycle per read would leave every read to the cyclic garbage
        # collector instead of freeing it at once (measured: ~10% of the router's CPU).
        self.on_reply = _ENDED_ALREADY
        return on_reply


def _decode(coding: bytes, body: bytes) -> bytes:
    """Undo a content coding we did not ask for (we send accept-encoding: identity)."""
    if coding in (b"gzip", b"x-gzip"):
        return zlib.decompress(body, 16 + zlib.MAX_WBITS)
    if coding == b"deflate":
        try:
            return zlib.decompress(body)
        except zlib.error:  # some servers send raw deflate without the zlib wrapper
            return zlib.decompress(body, -zlib.MAX_WBITS)
    raise ValueError(f"unsupported content-encoding {coding.decode('latin-1')!r}")


class _Pool:
    """Connections to one origin: idle ones (most recently used last), a cap, and requests waiting."""

    def __init__(self, upstream: FastUpstream, loop: asyncio.AbstractEventLoop, origin: str) -> None:
        parts = urlsplit(origin)
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"credentials in a node URL are not supported: {origin!r}")
        if not parts.hostname:
            raise ValueError(f"no host in URL {origin!r}")
        self.upstream = upstream
        self.loop = loop
        self.origin = origin
        self.host_line = b" HTTP/1.1\r\nhost: " + parts.netloc.encode("ascii") + b"\r\n"
        self.host = parts.hostname
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        # A list, not a deque: taking and giving back the newest (every request) are native list operations
        # in the compiled build (setup.py); only evicting the oldest (rare) shifts the list.
        self.idle: list[_Connection] = []
        self.connections: set[_Connection] = set()
        # Connections open or being opened: what `max_connections_per_origin` caps.
        self.opened = 0
        # Each gets a connection to reuse, or None: a slot to open a connection of its own.
        self.waiters: deque[asyncio.Future[_Connection | None]] = deque()

    def take_idle(self, now: float) -> _Connection | None:
        """The most recently used idle connection (the least likely to have been closed), if any is fresh."""
        idle = self.idle
        while idle:
            conn = idle.pop()
            if conn.reusable and now - conn.idle_since < self.upstream.idle_expiry_s:
                return conn
            # Expired (or closed): so is every older one; the sweeper or the next call takes those.
            self.discard(conn)
        return None

    async def acquire(self, deadline: float, fresh: bool) -> tuple[_Connection, bool]:
        """A connection and whether it was reused; `fresh` asks for a new one (after a stale reuse)."""
        if self.upstream.closed:
            raise UpstreamUnavailable(_WHEN_CLOSED_MESSAGE, node_fault=False)
        if not fresh:
            conn = self.take_idle(self.loop.time())
            if conn is not None:
                return conn, True
        elif self.idle and self.opened >= self.upstream.max_connections_per_origin:
            # Make room: the node closed one idle connection, the oldest of the others may be as stale.
            self.discard(self.idle.pop(0))
        if self.opened < self.upstream.max_connections_per_origin:
            self.opened += 1
            return await self._connect(deadline), False
        return await self._wait(deadline)

    async def _wait(self, deadline: float) -> tuple[_Connection, bool]:
        loop = self.loop
        waiter: asyncio.Future[_Connection | None] = loop.create_future()
        self.waiters.append(waiter)
        upstream = self.upstream
        timer = loop.call_at(min(deadline, loop.time() + upstream.pool_wait_s), self._expire, waiter)
        try:
            conn = await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Handed something just as we were cancelled: pass it on, or it would leak.
                handed = waiter.result()
                if handed is None:
                    self._slot_freed()
                else:
                    self.release(handed)
            raise
        finally:
            timer.cancel()
            if not waiter.done() or waiter.cancelled():
                self._drop_waiter(waiter)
        if conn is None:
            return await self._connect(deadline), False
        return conn, True

    def _expire(self, waiter: asyncio.Future[_Connection | None]) -> None:
        if not waiter.done():
            limit = self.upstream.max_connections_per_origin
            waiter.set_exception(
                UpstreamUnavailable(f"all {limit} connections to {self.origin} stayed busy", node_fault=False)
            )
            self._drop_waiter(waiter)

    def _drop_waiter(self, waiter: asyncio.Future[_Connection | None]) -> None:
        with contextlib.suppress(ValueError):
            self.waiters.remove(waiter)

    async def _connect(self, deadline: float) -> _Connection:
        """A new connection in a slot already counted in `opened`; the slot is given back on failure."""
        loop = self.loop
        upstream = self.upstream
        limit = min(deadline, loop.time() + upstream.connect_timeout_s)
        try:
            async with asyncio.timeout_at(limit):
                host, port = self.host, self.port
                if upstream.resolve is not None:
                    host, port = upstream.resolve(host, port)
                tls: dict[str, Any] = {}
                if self.tls and upstream.tls is not None:
                    tls = {"ssl": upstream.tls(self.origin), "server_hostname": self.host}
                _, conn = await loop.create_connection(lambda: _Connection(self), host, port, **tls)
        except TimeoutError as exc:  # before OSError: TimeoutError is one
            self._slot_freed()
            raise UpstreamUnavailable(f"connecting to {self.origin} timed out") from exc
        except ssl.SSLError as exc:  # before OSError: SSLError is one
            self._slot_freed()
            raise UpstreamUnavailable(f"TLS with {self.origin} failed: {describe(exc)}") from None
        except OSError as exc:
            self._slot_freed()
            raise UpstreamUnavailable(f"cannot connect to {self.origin}: {exc}") from exc
        except BaseException:
            self._slot_freed()
            raise
        conn.counted = True
        self.connections.add(conn)
        if upstream.closed:
            self.discard(conn)
            raise UpstreamUnavailable(_WHEN_CLOSED_MESSAGE, node_fault=False)
        check_peer = upstream.check_peer
        if self.tls and check_peer is not None:
            refused = check_peer(self.origin, conn.transport)
            if refused is not None:
                self.discard(conn)
                raise UpstreamUnavailable(f"TLS with {self.origin} failed: {refused}")
        return conn

    def release(self, conn: _Connection) -> None:
        """Back into the pool after a complete exchange, or closed when it must not carry another."""
        if not conn.reusable or conn.transport is None or conn.transport.is_closing() or self.upstream.closed:
            self.discard(conn)
            return
        waiters = self.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        conn.idle_since = self.loop.time()
        self.idle.append(conn)
        if self.upstream._sweeper is None:
            self.upstream.sweep_later()

    def discard(self, conn: _Connection) -> None:
        conn.close()
        self.forget(conn)

    def forget(self, conn: _Connection) -> None:
        """The connection is gone or going: no longer idle, no longer counted against the cap."""
        if not conn.counted:
            return
        conn.counted = False
        self.connections.discard(conn)
        with contextlib.suppress(ValueError):  # it was in use, not idle
            self.idle.remove(conn)
        self._slot_freed()

    def _slot_freed(self) -> None:
        self.opened -= 1
        waiters = self.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                self.opened += 1
                waiter.set_result(None)
                return

    def sweep(self, now: float) -> None:
        oldest_allowed = now - self.upstream.idle_expiry_s
        idle = self.idle
        while idle and idle[0].idle_since <= oldest_allowed:
            self.discard(idle.pop(0))

    def close_all(self) -> list[asyncio.Future[None]]:
        lost = [conn.lost for conn in self.connections]
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_exception(UpstreamUnavailable(_WHEN_CLOSED_MESSAGE, node_fault=False))
        self.waiters.clear()
        for conn in list(self.connections):
            conn.close()
        self.idle.clear()
        return lost


@mypyc_attr(allow_interpreted_subclasses=True)
class FastUpstream:
    """`Upstream` over HTTP/1.1 keep-alive connections of our own, pooled per origin (host and port).

    `timeout_s` bounds a whole request (waiting for a connection, connecting, sending, the whole reply);
    `connect_timeout_s` bounds a TCP connect, `pool_wait_s` the wait for a free connection when
    `max_connections_per_origin` are busy. Idle connections live `idle_expiry_s`. A connection whose reply
    was incomplete, said `Connection: close`, or came with extra bytes is never reused. A request that
    meets a reused connection closed by the node before any reply byte is sent once more on a new
    connection: both methods are only used for reads (batch-get is a POST), so that is always safe.
    `resolve`, when given, says where to connect for an origin's host and port (as curl's --resolve: the
    Host header still names the origin); tests use it to reach several named nodes on one local server.
    Use it from one event loop (the one it first ran on).
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 1.0,
        *,
        max_connections_per_origin: int = DEFAULT_MAX_CONNECTIONS_PER_ORIGIN,
        pool_wait_s: float = DEFAULT_POOL_WAIT_S,
        idle_expiry_s: float = DEFAULT_IDLE_EXPIRY_S,
        resolve: Callable[[str, int], tuple[str, int]] | None = None,
        tls: Callable[[str], ssl.SSLContext] | None = None,
    ) -> None:
        if min(timeout_s, connect_timeout_s, pool_wait_s, idle_expiry_s) <= 0:
            raise ValueError("timeouts and the idle expiry must be positive")
        if max_connections_per_origin < 1:
            raise ValueError("max_connections_per_origin must be at least 1")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections_per_origin = max_connections_per_origin
        self.pool_wait_s = pool_wait_s
        self.idle_expiry_s = idle_expiry_s
        self.resolve = resolve
        # The TLS context for https:// origins, by origin (called at each connect: a rotated one is used at
        # once, and the origin's last TLS session is offered for resumption).
        self.tls = tls
        # What the TLS context's maker says of a node just connected to (its certificate): a reason to refuse
        # it, or None (keyroute.http.tls.MemberTls.check_peer: a node's certificate, for the node registered
        # at that address).
        self.check_peer: Callable[[str, Any], str | None] | None = getattr(tls, "check_peer", None)
        self.closed = False
        self._pools: dict[str, _Pool] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        # Exchanges in flight and their deadlines, watched by one timer instead of one timer per request
        # (a timer costs more than the rest of the bookkeeping of a request together).
        self._in_flight: dict[_Connection, float] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        self._watchdog_at = 0.0
        # Encoded header blocks by the caller's headers: a member sends the same few sets again and again.
        self._blocks: dict[tuple[tuple[str, str], ...], bytes] = {}

    async def get(self, url: str, headers: Mapping[str, str]) -> UpstreamResponse:
        return await self._request(b"GET ", url, None, headers)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        return await self._request(b"POST ", url, body, headers)

    def get_now(
        self, url: str, head: bytes, on_reply: Callable[[UpstreamResponse | Exception], None]
    ) -> _Exchange | None:
        """GET `url` on an idle connection, without a coroutine: the exchange (its `cancel()` abandons it:
        the connection is closed and `on_reply` never called), or None (nothing sent) when no idle
        connection to the origin is at hand or the URL needs a closer look, so the caller uses `get` instead.

        `head` is the request's header lines, each ending in CRLF, already checked (no framing
        headers, no CR/LF in values). `on_reply` is called once, from the event loop, with the reply or
        with the failure: UpstreamUnavailable, or `StaleConnection` when the node had closed the idle
        connection before it saw the request (send it again with `get`, which opens a new one)."""
        located = None if self.closed else self._locate_known(url)
        if located is None:
            return None
        return self._send_now(located[0], located[1], head, on_reply)

    def get_now_at(
        self, origin: str, target: str, head: bytes, on_reply: Callable[[UpstreamResponse | Exception], None]
    ) -> _Exchange | None:
        """`get_now(origin + target)` for a caller that holds the two apart and has checked the target:
        `origin` as the pool names it (`scheme://host:port`, the scheme lower-case, nothing after the port),
        `target` percent-encoded visible ASCII without spaces or '#' (what `path_segment` makes). Nothing is
        split or checked again. None (nothing sent) as `get_now`, and when `origin` is not spelt as a pool
        is named (the caller may then try `get_now` with the whole URL)."""
        if self.closed:
            return None
        pool = self._pools.get(origin)
        if pool is None:
            return None
        return self._send_now(pool, target, head, on_reply)

    def _send_now(
        self, pool: _Pool, target: str, head: bytes, on_reply: Callable[[UpstreamResponse | Exception], None]
    ) -> _Exchange | None:
        now = pool.loop.time()
        idle = pool.idle
        while True:
            # _Pool.take_idle, inline (once per request) for the common case: a fresh idle connection.
            conn = idle[-1] if idle else None
            if conn is not None and conn.reusable and now - conn.idle_since < self.idle_expiry_s:
                idle.pop()
            else:
                conn = pool.take_idle(now)
                if conn is None:
                    return None
            transport = conn.transport
            if transport is not None and not transport.is_closing():
                break
            pool.discard(conn)  # closed while idle: `on_reply` must never run before this returns
        request = b"".join((b"GET ", target.encode("ascii"), pool.host_line, head, b"\r\n"))
        exchange = _Exchange(self, pool, conn, target, on_reply)
        conn.start_with(request, now + self.timeout_s, exchange)
        return exchange

    async def aclose(self) -> None:
        """Close every connection (in-flight requests fail as unavailable) and wait until they are gone."""
        self.closed = True
        for timer in (self._sweeper, self._watchdog):
            if timer is not None:
                timer.cancel()
        self._sweeper = self._watchdog = None
        lost: list[asyncio.Future[None]] = []
        for pool in self._pools.values():
            lost += pool.close_all()
        self._pools.clear()
        pending = [f for f in lost if not f.done()]
        if pending:
            await asyncio.wait(pending, timeout=1.0)

    # -- the request --------------------------------------------------------------------------------

    async def _request(
        self, method: bytes, url: str, body: bytes | None, headers: Mapping[str, str]
    ) -> UpstreamResponse:
        if self.closed:
            raise UpstreamUnavailable(_WHEN_CLOSED_MESSAGE, node_fault=False)
        pool, target = self._locate(url)
        request = self._encode(method, target, pool, headers, body)
        now = pool.loop.time()
        deadline = now + self.timeout_s
        conn = pool.take_idle(now)
        reused = conn is not None
        if conn is None:
            conn, reused = await pool.acquire(deadline, fresh=False)
        retried = False
        while True:
            waiter = conn.start(request, deadline)
            try:
                response = await waiter
            except _Failure as failure:
                conn.end_exchange()
                pool.discard(conn)
                if self.closed:  # aclose() broke the connection off: not the node's fault
                    raise UpstreamUnavailable(_WHEN_CLOSED_MESSAGE, node_fault=False) from failure
                if retried or not (reused and failure.retriable):
                    again = " (sent again on a new connection)" if retried else ""
                    raise UpstreamUnavailable(f"{method.decode()}{url}{again}: {failure}") from failure
            except BaseException:
                # Cancelled mid-exchange: whatever is still on the wire is not ours to read.
                conn.end_exchange()
                pool.discard(conn)
                raise
            else:
                conn.end_exchange()
                pool.release(conn)
                return response
            # The node closed the idle connection just as we used it (the keep-alive race): once more, on a
            # new connection, which is never retried.
            conn, _ = await pool.acquire(deadline, fresh=True)
            retried = True

    def _locate(self, url: str) -> tuple[_Pool, str]:
        """The pool for the URL's origin and the request target (path and query)."""
        return self._locate_known(url) or self._locate_slowly(url)

    def _locate_known(self, url: str) -> tuple[_Pool, str] | None:
        """`_locate` for a plain http:// URL of an origin that has a pool already; None for anything else."""
        if url.startswith(_SCHEMES):
            slash = url.find("/", 8)
            if slash > 0:
                pool = self._pools.get(url[:slash])
                if pool is not None:
                    target = url[slash:]
                    # Anything else (non-ASCII, controls, spaces, a fragment) is left to the careful path;
                    # C string methods tell, cheaper than a regular expression.
                    if target.isascii() and target.isprintable() and " " not in target and "#" not in target:
                        return pool, target
        return None

    def _locate_slowly(self, url: str) -> tuple[_Pool, str]:
        scheme, colon, rest = url.partition(":")
        scheme = scheme.lower()
        if not colon or scheme not in ("http", "https") or not rest.startswith("//"):
            raise ValueError(f"only http:// and https:// URLs are supported, not {url!r}")
        if scheme == "https" and self.tls is None:
            raise ValueError(f"{url!r} is https://, and no TLS settings were given for members (--member-ca)")
        parts = urlsplit("http:" + rest)
        origin = f"{scheme}://{parts.netloc}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if _BAD_TARGET.search(target) or not target.isascii():
            raise ValueError(f"the request target must be percent-encoded ASCII: {target!r}")
        pool = self._pools.get(origin)
        if pool is None:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            pool = self._pools[origin] = _Pool(self, self._loop, origin)
        return pool, target

    def _encode(self, method: bytes, target: str, pool: _Pool, headers: Mapping[str, str], body: bytes | None) -> bytes:
        # The request id is the one header that changes on every request: it is added on its own, so the
        # rest (the same few sets again and again) is encoded and checked once.
        request_id = headers.get(_REQUEST_ID)
        key = tuple(headers.items()) if request_id is None else tuple(i for i in headers.items() if i[0] != _REQUEST_ID)
        block = self._blocks.get(key)
        if block is None:
            block = header_block(dict(key))
            if len(self._blocks) >= 256:  # a caller varying other headers must not grow it without bound
                self._blocks.clear()
            self._blocks[key] = block
        if request_id is not None:
            if _BAD_VALUE.search(request_id):
                raise ValueError(f"invalid value for header {_REQUEST_ID!r}")
            block += b"x-request-id: " + request_id.encode("latin-1") + b"\r\n"
        if body is None:
            return b"".join((method, target.encode("ascii"), pool.host_line, block, b"\r\n"))
        return b"".join(
            (
                method,
                target.encode("ascii"),
                pool.host_line,
                block,
                b"content-length: %d\r\n\r\n" % len(body),
                body,
            )
        )

    # -- bookkeeping --------------------------------------------------------------------------------

    def watch(self, conn: _Connection, deadline: float) -> None:
        self._in_flight[conn] = deadline
        if self._watchdog is None or deadline < self._watchdog_at:
            # Deadlines mostly arrive in order, so this arms a timer about once per timeout, not per request.
            self._arm_watchdog(deadline)

    def _arm_watchdog(self, when: float) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        assert self._loop is not None
        self._watchdog = self._loop.call_at(when, self._expire_overdue)
        self._watchdog_at = when

    def unwatch(self, conn: _Connection) -> None:
        self._in_flight.pop(conn, None)

    def _expire_overdue(self) -> None:
        self._watchdog = None
        assert self._loop is not None
        # Timers may fire a little early (uvloop counts whole milliseconds): that much early still counts.
        now = self._loop.time() + 0.002
        soonest: float | None = None
        for conn, deadline in list(self._in_flight.items()):
            if deadline <= now:
                conn.timed_out()
            elif soonest is None or deadline < soonest:
                soonest = deadline
        if soonest is not None and not self.closed:
            self._arm_watchdog(soonest)

    def sweep_later(self) -> None:
        if self._sweeper is None and self._loop is not None:
            self._sweeper = self._loop.call_later(self.idle_expiry_s, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        assert self._loop is not None
        now = self._loop.time()
        for origin, pool in list(self._pools.items()):
            pool.sweep(now)
            if not pool.opened and not pool.waiters:
                del self._pools[origin]
        if any(pool.idle for pool in self._pools.values()):
            self.sweep_later()


def header_block(headers: Mapping[str, str]) -> bytes:
    """The caller's headers as request-head lines, with accept-encoding: identity unless it chose one."""
    lines = []
    identity = True
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            raise ValueError(f"invalid header name {name!r}")
        if _BAD_VALUE.search(value):
            raise ValueError(f"invalid value for header {name!r}")
        lowered = name.lower()
        if lowered in _FRAMING:
            continue
        if lowered == "accept-encoding":
            identity = False
        lines.append(f"{name}: {value}\r\n")
    if identity:
        # The body is passed on as bytes: it must come in no coding we would have to undo.
        lines.append("accept-encoding: identity\r\n")
    return "".join(lines).encode("latin-1")  # UnicodeEncodeError is a ValueError
