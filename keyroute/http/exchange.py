"""What a data plane sees of a request (`Request`, `Exchange`, the `DataPlane` protocol, `ServerLimits`), and
`Slot`: the place every request holds in its connection's answer order, which `Exchange` extends."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from keyroute.api import DEFAULT_BODY_TIMEOUT_S
from keyroute.http.wire import CLOSE, encode
from keyroute.runtime.native import mypyc_attr

if TYPE_CHECKING:
    from keyroute.http.protocol import Connection

# A data plane's answer as a value: status, headers, body.
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


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


@mypyc_attr(allow_interpreted_subclasses=True)
class Slot:
    """One request's place in its connection's answer order (pipelining): what it has written while an
    earlier request was still unanswered waits in `_held`. Its connection (keyroute.http.protocol) reads
    and sets its underscore attributes; nothing outside keyroute.http does."""

    __slots__ = ("_conn", "_held", "_done", "_gone", "_keep_alive", "_head", "_rid", "_connection", "_on_done")

    def __init__(self, conn: Connection, rid: bytes, keep_alive: bool, connection: bytes, head: bool) -> None:
        self._conn = conn
        self._held: list[bytes] | None = None
        self._done = False  # its whole answer has been given
        self._gone = False  # the client left, or the connection closes before this answer
        self._keep_alive = keep_alive
        self._connection = connection  # the `connection` header line its answer carries (b"" for none)
        self._head = head  # a HEAD request: answered without a body
        self._rid = rid
        self._on_done: Callable[[], None] | None = None  # an exchange's, told of its end (see Exchange)

    def _lost(self) -> None:
        self._gone = True
        done = self._on_done
        if done is not None:  # still unanswered: a callback is cleared when it is called
            self._on_done = None
            done()


class Exchange(Slot):
    """One data-plane request and its answer slot: `answer` once, now or later, on the loop's thread.

    An exchange ends once: when it is answered, or when it is lost before that (its client left, or its
    connection closes first). `on_done` has a callable told of that end.

    Made as its `Slot` (one `__init__` for both), then given its `request`."""

    __slots__ = ("request",)

    request: Request

    def on_done(self, callback: Callable[[], None]) -> None:
        """Have `callback()` called exactly once, on the loop's thread, when the exchange ends: at its answer
        (before the answer is written), or as soon as it is lost unanswered. One callback per exchange, set
        while it is open (the data plane's `handle` is given an open exchange); ValueError otherwise. It must
        not raise. Pass a callable made once (a bound method), not one per request: nothing else is stored."""
        if self._on_done is not None or self._done or self._gone:
            raise ValueError(f"{self!r} already has a callback for its end, or has ended")
        self._on_done = callback

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
            self._connection = CLOSE
        data = encode(status, headers, body, self._rid, self._connection, self._head)
        self._done = True  # only now: an answer that fails to encode leaves the exchange unanswered (500)
        done = self._on_done
        if done is not None:
            self._on_done = None
            done()
        conn._complete(self, data)

    @property
    def gone(self) -> bool:
        """The client closed the connection before the answer."""
        return self._gone

    @property
    def transport(self) -> Any:
        """The asyncio transport of the connection the request came on (with TLS: its peer's certificate,
        `keyroute.http.tls.peer_identity`)."""
        return self._conn._transport

    def __repr__(self) -> str:
        return f"Exchange({self.request!r}, done={self._done}, gone={self._gone})"


class Answerable(Protocol):
    """What a data plane uses of an `Exchange`. The routed data plane takes this, not `Exchange`, so that a
    stand-in (tests) is accepted by the compiled build (setup.py) as by the pure one."""

    request: Request
    _on_done: Callable[[], None] | None

    @property
    def gone(self) -> bool: ...

    @property
    def transport(self) -> Any: ...

    def on_done(self, callback: Callable[[], None]) -> None: ...

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None: ...


class DataPlane(Protocol):
    """A data plane may also have `prefix` (bytes): then every request whose raw path starts with it is the
    data plane's, and `accepts` is not asked (one comparison per request instead of a call)."""

    def accepts(self, method: str, path: bytes) -> bool:
        """Whether the request with this method and raw path is the data plane's (called as soon as the
        request head is parsed; cheap). Everything else goes to the ASGI app."""
        ...

    def handle(self, exchange: Exchange) -> None:
        """Answer the exchange, now or later. Should not raise; if it does, the server logs the traceback
        and answers 500 {"error": "internal_error", "message": "internal error"} (never a traceback to the
        client)."""
        ...
