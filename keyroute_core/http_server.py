"""uvicorn's httptools protocol, changed in two ways for keyroute's small answers.

Coalesced writes: what a response writes in one event-loop step goes out in one socket write.

uvicorn writes a response's status line and headers, then its body, each with its own `transport.write`,
and on a TCP socket each is a `send` system call that runs the whole loopback path to the peer. For the
small answers keyroute serves, those calls are the largest single CPU cost of a proxied read
(benchmarks/RESULTS.md, "Router"). Here the connection's writes are gathered and handed to the socket once,
at the next turn of the event loop (a few microseconds later), which halves the calls for such answers.
Flow control, close, upgrade and peer addresses still go to the real transport.

Direct answers (`DirectAnswerProtocol`): single-key reads, nearly all the traffic, are answered by the
protocol itself in one write. The usual way ("express") starts as soon as httptools has parsed the request
head: no ASGI scope, no RequestResponseCycle, no task unless the answer has to wait on a coroutine. A
request the express way cannot take (a pipelined one behind an unanswered request, one with a body, an
upgrade) is answered where uvicorn would start the ASGI application, from the scope uvicorn builds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import MutableMapping
from typing import Any

from keyroute.core.api import ApiError, error_headers, error_json, is_key_read
from keyroute.core.request_guard import Admission, request_id_of
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

Scope = MutableMapping[str, Any]
# Status, headers (without content-length: it is added) and body.
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
_REQUEST_ID = b"x-request-id"
_BODY_HEADERS = (b"content-length", b"transfer-encoding")


class _NoEvent:
    """uvicorn sets its cycle's `message_event` on a body chunk, the end of a message or a lost connection;
    an express exchange waits on none of them."""

    __slots__ = ()

    def set(self) -> None:
        pass


class ExpressCycle:
    """What uvicorn's protocol reads and writes of the current request's cycle, for a request answered the
    express way (`DirectAnswerProtocol.express`): whether the connection stays open, whether the response
    is complete, whether the client has gone. Answer it with `DirectAnswerProtocol.finish_express`."""

    __slots__ = ("keep_alive", "head", "response_complete", "disconnected", "more_body", "body")
    message_event = _NoEvent()

    def __init__(self, keep_alive: bool, head: bool) -> None:
        self.keep_alive = keep_alive
        self.head = head  # a HEAD request: the answer goes without its body
        self.response_complete = False
        self.disconnected = False
        self.more_body = False
        self.body = bytearray()


# `DirectAnswerProtocol.express` returns this when it will call `finish_express` later.
PENDING: Any = object()

log = logging.getLogger(__name__)


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

    def is_closing(self) -> bool:  # asked once per request: not through __getattr__
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """Pass as `uvicorn.Config(http=CoalescingHttpToolsProtocol)`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Set after the parent has taken the real transport for flow control and the peer's address.
        self.transport = CoalescingWrites(transport, self.loop)  # type: ignore[assignment]


class DirectAnswerProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol answering single-key reads itself.

    uvicorn parses the request and builds its scope as usual; where it would start the ASGI application, a
    key read (`keyroute.core.api.is_key_read`) instead runs the admission checks (the ones `RequestGuard`
    applies to every other request, on the same counters: the application's `state.admission`), gets its
    answer from `answer` and writes it whole in one call. That leaves out the ASGI exchange, the middleware
    chain, routing and the per-header checks of uvicorn's response writer: an answer's headers are our own
    or ones httptools parsed (so without line breaks). Keep-alive, HTTP/1.0, pipelining and flow control
    follow uvicorn's own cycle, whose state is kept up to date. When `answer` returns None the application
    answers; an ApiError it raises is answered as such, anything else it raises is logged and answered 500.

    Before that, as soon as a GET or HEAD head under /stores/ is parsed, `express` may take the request:
    uvicorn then builds no scope and no cycle for it (an `ExpressCycle` stands in for the cycle). It is
    offered only a request that may be answered at once: nothing unanswered before it on the connection,
    no body, no upgrade, writing not paused.

    Subclasses implement `answer` and `express`; `for_app` makes the class uvicorn is given.
    `extra_error_headers` go on every error answered here.
    """

    owner_app: Any = None  # the ASGI application; its state is read once its lifespan has started
    extra_error_headers: tuple[tuple[bytes, bytes], ...] = ()
    # The keep-alive timeout: one timer per connection, re-armed only when it fires (see on_response_complete).
    _keep_alive_timer: asyncio.TimerHandle | None = None
    _idle_since = 0.0
    _requests_begun = 0
    _idle_after = 0

    @classmethod
    def for_app(cls, app: Any, base: type[HttpToolsProtocol] = HttpToolsProtocol, **attributes: Any) -> type:
        """The protocol class to pass as uvicorn's `http`: this one for `app`, over `base` (another
        HttpToolsProtocol subclass, whose changes are kept), with `attributes` set."""
        bases = (cls,) if base is HttpToolsProtocol else (cls, base)
        return type(cls.__name__, bases, {"owner_app": app, **attributes})

    async def answer(self, scope: Scope, raw_path: bytes) -> Answer | None:
        return None

    def express(
        self, cycle: ExpressCycle, raw_path: bytes, target_bytes: int, headers: list[tuple[bytes, bytes]]
    ) -> Any:
        """Take the request (`raw_path` without its query; `target_bytes` the length of the whole target;
        `headers` with lower-case names): its Answer, PENDING when `finish_express(cycle, ...)` follows
        later, or None to leave it to the application. Must not raise."""
        return None

    # -- the express way ------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        # uvicorn's own, without the scope: built in on_headers_complete only when the application answers.
        self._requests_begun += 1
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def on_headers_complete(self) -> None:
        if self._express_head():
            return
        url, headers, expect_100_continue = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()  # the scope, as uvicorn builds it, for the headers parsed into ours
        self.url, self.headers, self.expect_100_continue = url, headers, expect_100_continue
        self.scope["headers"] = headers
        super().on_headers_complete()

    def _express_head(self) -> bool:
        url = self.url
        if not url.startswith(b"/stores/"):
            return False
        parser = self.parser
        method = parser.get_method()
        if method != b"GET" and method != b"HEAD":
            return False
        cycle = self.cycle
        if (
            (cycle is not None and not cycle.response_complete)
            or self.flow.write_paused
            or self.limit_concurrency is not None
            or parser.should_upgrade()
            or self.root_path
        ):
            return False
        headers = self.headers
        for name, _ in headers:
            if name in _BODY_HEADERS:
                return False
        query = url.find(b"?")
        raw_path = url if query < 0 else url[:query]
        if b"#" in raw_path:
            return False
        express = ExpressCycle(parser.get_http_version() != "1.0" and parser.should_keep_alive(), method == b"HEAD")
        self.cycle = express  # type: ignore[assignment]
        # The target's length as uvicorn's scope has it: raw path plus query string, without the '?'.
        answered = self.express(express, raw_path, len(url) - (query >= 0), headers)
        if answered is None:
            self.cycle = cycle
            return False
        if answered is not PENDING:
            self.finish_express(express, *answered)
        return True

    def finish_express(self, cycle: ExpressCycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Write the answer of an express request in one write (once; nothing when the client has gone)."""
        if cycle.response_complete:
            return
        cycle.response_complete = True
        if cycle.disconnected:
            return
        transport = self.transport
        head = response_head(status, self.server_state.default_headers, headers, len(body), cycle.keep_alive)
        write_at_once(transport, head if cycle.head else head + body)
        if not cycle.keep_alive:
            transport.close()
        self.on_response_complete()

    def on_response_complete(self) -> None:
        # uvicorn's own, except for the keep-alive timeout: uvicorn starts a timer when a response completes
        # and cancels it when the next request arrives, a timer per request; here one timer per connection
        # checks, when it fires, whether the connection has been idle for the whole timeout since the last
        # response (then it closes it, as uvicorn would) and otherwise waits again for what is left.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        self._idle_after = self._requests_begun
        if self._keep_alive_timer is None:
            self._keep_alive_timer = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_due)

    def _keep_alive_due(self) -> None:
        self._keep_alive_timer = None
        if self._requests_begun != self._idle_after or self.transport.is_closing():
            return  # a request came meanwhile: the next response completed starts the wait again
        left = self._idle_since + self.timeout_keep_alive - self.loop.time()
        if left > 0.001:  # uvloop's timers count whole milliseconds
            self._keep_alive_timer = self.loop.call_later(left, self._keep_alive_due)
        else:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        timer = self._keep_alive_timer
        if timer is not None:
            timer.cancel()
            self._keep_alive_timer = None
        super().connection_lost(exc)

    def express_error(self, exc: ApiError, request_id: str) -> Answer:
        """An ApiError as an express answer."""
        headers = error_headers(exc, self.extra_error_headers)
        headers.append((_REQUEST_ID, request_id.encode("latin-1")))
        return exc.status, headers, error_json(exc.code, exc.message)

    # -- where uvicorn would start the application ----------------------------------------------------

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        scope = cycle.scope
        raw = scope["raw_path"]
        # `app is self.app`: not uvicorn's own refusal (its concurrency limit, which keyroute leaves off).
        if app is self.app and is_key_read(scope["method"], raw):
            task = self.loop.create_task(self._serve(cycle, app, raw))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)
            return
        super()._start_asgi_task(cycle, app)

    async def _serve(self, cycle: RequestResponseCycle, app: Any, raw: bytes) -> None:
        admission: Admission = self.owner_app.state.admission
        scope: Scope = cycle.scope  # type: ignore[assignment]
        refusal = admission.admit(scope)
        if refusal is not None:
            await respond(cycle, *self._error(scope, refusal))
            return
        try:
            answered = await self.answer(scope, raw)
        except ApiError as exc:
            answered = self._error(scope, exc)
        except Exception:
            # Never a hung connection and never a traceback for the client: logged, answered 500.
            log.exception("answering %s %r failed", scope["method"], raw[:200])
            answered = self._error(scope, ApiError("internal error"))
        finally:
            admission.release()
        if answered is None:
            await cycle.run_asgi(app)
        else:
            await respond(cycle, *answered)

    def _error(self, scope: Scope, exc: ApiError) -> Answer:
        headers = error_headers(exc, self.extra_error_headers)
        headers.append((_REQUEST_ID, request_id_of(scope).encode("latin-1")))
        return exc.status, headers, error_json(exc.code, exc.message)


async def respond(cycle: RequestResponseCycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """The whole response in one write, with the cycle's state as uvicorn's own writer leaves it."""
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()
    if cycle.disconnected:
        return
    head = response_head(status, cycle.default_headers, headers, len(body), cycle.keep_alive)
    cycle.response_started = True
    cycle.response_complete = True
    transport = cycle.transport
    write_at_once(transport, head if cycle.scope["method"] == "HEAD" else head + body)
    cycle.message_event.set()
    if not cycle.keep_alive:
        transport.close()
    cycle.on_response()


def response_head(
    status: int,
    default_headers: list[tuple[bytes, bytes]],
    headers: list[tuple[bytes, bytes]],
    content_length: int,
    keep_alive: bool,
) -> bytes:
    """Status line and headers of a whole answer: the server's default ones (date, server), then `headers`,
    the length, and `connection: close` when the connection ends with it."""
    out = [STATUS_LINE.get(status) or b"HTTP/1.1 %d \r\n" % status]
    for name, value in default_headers:
        out += (name, b": ", value, b"\r\n")
    for name, value in headers:
        out += (name, b": ", value, b"\r\n")
    out.append(b"content-length: %d\r\n" % content_length)
    if not keep_alive:
        out.append(b"connection: close\r\n")
    out.append(b"\r\n")
    return b"".join(out)


def write_at_once(transport: Any, data: bytes) -> None:
    """`data` to the socket now (after what CoalescingWrites still holds), not at the next loop turn."""
    write_now = getattr(transport, "write_now", None)
    (write_now or transport.write)(data)
