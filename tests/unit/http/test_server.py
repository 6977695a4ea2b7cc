"""keyroute.http.server over real sockets on 127.0.0.1: the behaviour contract in the module's docstring, on
asyncio's own event loop and on uvloop. The server runs in the test's event loop; the client speaks raw
bytes over asyncio streams (or a plain socket, for the thread helper)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from keyroute.core.logs import acceptable_request_id, new_request_id
from keyroute.core.metrics import SERVER_REFUSALS
from keyroute.http import Exchange, HttpServer, Request, ServerLimits, run
from tests.util import serve_in_thread, wait_until

# New request ids are keyroute.core.logs's: this process's prefix and a counter.
NEW_ID = re.compile(rf"^{re.escape(new_request_id().rpartition('-')[0])}-[0-9a-f]+$")
IO_TIMEOUT_S = 5.0


def _loop_factories() -> list[Any]:
    params = [pytest.param(None, id="asyncio")]
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return params
    return [*params, pytest.param(uvloop.new_event_loop, id="uvloop")]


@pytest.fixture(params=_loop_factories())
def arun(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    """Run a test coroutine on a fresh loop of the parametrized kind; any error the loop reports (an
    exception in a callback, a task exception never retrieved) fails the test."""
    factory = request.param

    def runner(coro: Coroutine[Any, Any, None]) -> None:
        reported: list[dict[str, Any]] = []

        async def main() -> None:
            asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
            await coro

        with asyncio.Runner(loop_factory=factory) as runner_:
            runner_.run(main())
        assert not reported, reported

    return runner


# -- a raw HTTP client --------------------------------------------------------------------------------


@dataclasses.dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        values = [v for n, v in self.headers if n == name]
        assert len(values) <= 1, f"{name} appears {len(values)} times"
        return values[0] if values else None

    def json(self) -> Any:
        assert self.header("content-type") == "application/json"
        return json.loads(self.body)


async def read_answer(reader: asyncio.StreamReader, head: bool = False) -> Answer:
    raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT_S)
    lines = raw[:-4].decode("latin-1").split("\r\n")
    version, status, *_ = lines[0].split(" ", 2)
    assert version == "HTTP/1.1", lines[0]
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        assert name == name.lower() and name.strip() == name, line
        headers.append((name, value.strip()))
    answer = Answer(int(status), headers, b"")
    length = answer.header("content-length")
    if head or answer.status in (204, 304) or answer.status < 200:
        return answer
    if answer.header("transfer-encoding") == "chunked":
        assert length is None
        chunks = []
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), IO_TIMEOUT_S))[:-2], 16)
            chunk = await asyncio.wait_for(reader.readexactly(size + 2), IO_TIMEOUT_S)
            assert chunk[-2:] == b"\r\n"
            if size == 0:
                break
            chunks.append(chunk[:-2])
        answer.body = b"".join(chunks)
    elif length is not None:
        answer.body = await asyncio.wait_for(reader.readexactly(int(length)), IO_TIMEOUT_S)
    else:
        answer.body = await asyncio.wait_for(reader.read(), IO_TIMEOUT_S)
    return answer


async def closed_by_server(reader: asyncio.StreamReader, timeout_s: float = IO_TIMEOUT_S) -> bool:
    """Whether the server closes the connection (EOF, or a reset) within `timeout_s`, with nothing more sent."""
    try:
        rest = await asyncio.wait_for(reader.read(65536), timeout_s)
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    assert rest == b"", rest
    return True


@contextlib.asynccontextmanager
async def connect(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def exchange(port: int, request: bytes, head: bool = False) -> Answer:
    async with connect(port) as (reader, writer):
        writer.write(request)
        return await read_answer(reader, head=head)


# -- servers under test ---------------------------------------------------------------------------------


class Plane:
    """A data plane for /stores/: echoes what it got; /stores/hold is kept for the test to answer; /stores/boom
    raises; /stores/big answers `big` bytes."""

    def __init__(self) -> None:
        self.handled: list[Request] = []
        self.held: list[Exchange] = []
        self.big = b""

    def accepts(self, method: str, path: bytes) -> bool:
        return path.startswith(b"/stores/")

    def handle(self, exchange: Exchange) -> None:
        request = exchange.request
        self.handled.append(request)
        path = request.path
        if path.startswith(b"/stores/hold"):
            self.held.append(exchange)
        elif path == b"/stores/boom":
            raise ValueError("secret detail of a failing handler")
        elif path == b"/stores/big":
            exchange.answer(200, [(b"content-type", b"application/octet-stream")], self.big)
        elif path == b"/stores/own-id":
            exchange.answer(200, [(b"x-request-id", b"mine")], b"own")
        elif path == b"/stores/bad-answer":
            exchange.answer(200, [(b"x-thing", "not bytes")], b"never sent")  # type: ignore[list-item]
        else:
            exchange.answer(
                200, [(b"content-type", b"text/plain")], b"%s %s %s" % (request.method.encode(), path, request.body)
            )


async def _hello(request: StarletteRequest) -> Response:
    return JSONResponse({"hello": "world", "state": getattr(request.state, "counter", None)})


async def _echo(request: StarletteRequest) -> Response:
    return Response(await request.body(), media_type="application/octet-stream")


async def _stream(request: StarletteRequest) -> Response:
    async def parts() -> AsyncIterator[bytes]:
        for index in range(3):
            yield b"part%d;" % index

    return StreamingResponse(parts(), media_type="text/plain")


async def _broken_stream(request: StarletteRequest) -> Response:
    async def parts() -> AsyncIterator[bytes]:
        yield b"first;"
        raise RuntimeError("the stream broke")

    return StreamingResponse(parts(), media_type="text/plain")


async def _fails(request: StarletteRequest) -> Response:
    raise RuntimeError("a route that fails")


def starlette_app(lifespan: Any = None) -> Starlette:
    return Starlette(
        routes=[
            Route("/hello", _hello),
            Route("/echo", _echo, methods=["POST"]),
            Route("/stream", _stream),
            Route("/broken-stream", _broken_stream),
            Route("/fails", _fails),
        ],
        lifespan=lifespan,
    )


@contextlib.asynccontextmanager
async def serving(plane: Plane | None = None, app: Any = None, **limits: Any) -> AsyncIterator[HttpServer]:
    server = HttpServer(
        app if app is not None else starlette_app(),
        ServerLimits(**limits),
        data_plane=None if plane is None else (lambda state: plane),
    )
    await server.start(port=0)
    try:
        yield server
    finally:
        await server.stop(grace_s=2.0)


def get(path: str, *headers: str, version: str = "1.1", method: str = "GET") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "host: test", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# -- keep-alive and connection handling -----------------------------------------------------------------


def test_http11_keeps_the_connection_alive_and_every_answer_has_date_and_a_request_id(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server, connect(server.port) as (reader, writer):
            ids = []
            for path in ("/stores/a", "/stores/b"):
                writer.write(get(path))
                answer = await read_answer(reader)
                assert answer.status == 200 and answer.body == f"GET {path} ".encode()
                assert answer.header("connection") is None
                assert answer.header("server") is None
                assert (answer.header("date") or "").endswith(" GMT")
                assert answer.header("content-length") == str(len(answer.body))
                ids.append(answer.header("x-request-id"))
            assert all(NEW_ID.match(i or "") for i in ids) and ids[0] != ids[1]
            assert [r.request_id for r in plane.handled] == ids

    arun(scenario())


def test_the_request_carries_raw_path_query_headers_and_version(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server:
            await exchange(server.port, get("/stores/k%2Fx?a=1&b", "X-Thing: One", "x-thing: two", version="1.0"))
        (request,) = plane.handled
        assert (request.method, request.path, request.query) == ("GET", b"/stores/k%2Fx", b"a=1&b")
        assert request.target_bytes == len(b"/stores/k%2Fx") + len(b"a=1&b")
        assert request.http_version == "1.0"
        assert request.header(b"x-thing") == b"One"
        assert (b"x-thing", b"two") in request.headers and request.header(b"absent") is None

    arun(scenario())


def test_http10_without_keep_alive_is_closed_after_the_answer(arun: Any) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/a", version="1.0"))
            answer = await read_answer(reader)
            assert answer.status == 200 and answer.header("connection") == "close"
            assert await closed_by_server(reader)

    arun(scenario())


def test_http10_with_keep_alive_stays_open_and_says_so(arun: Any) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            for path in ("/stores/a", "/hello"):  # the data plane, then the ASGI app
                writer.write(get(path, "Connection: keep-alive", version="1.0"))
                answer = await read_answer(reader)
                assert answer.status == 200 and answer.header("connection") == "keep-alive"

    arun(scenario())


def test_connection_close_is_honoured_and_later_requests_are_not_answered(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/a", "Connection: close") + get("/stores/b"))
            answer = await read_answer(reader)
            assert answer.body == b"GET /stores/a " and answer.header("connection") == "close"
            assert await closed_by_server(reader)
        assert [r.path for r in plane.handled] == [b"/stores/a"]

    arun(scenario())


def test_pipelined_answers_leave_in_request_order_whatever_order_they_are_given_in(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/hold") + get("/stores/b") + get("/hello") + get("/stores/c"))
            await wait_until(lambda: len(plane.handled) == 3, message="three data-plane requests handled")
            # /stores/b and /stores/c are answered already; the ASGI request waits its turn.
            (first,) = plane.held
            first.answer(200, [], b"first")
            answers = [await read_answer(reader) for _ in range(4)]
            assert [a.body for a in answers[:2]] == [b"first", b"GET /stores/b "]
            assert answers[2].json()["hello"] == "world"
            assert answers[3].body == b"GET /stores/c "

    arun(scenario())


def test_reading_pauses_at_max_pipelined_and_resumes_without_losing_requests(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane, max_pipelined=2) as server, connect(server.port) as (reader, writer):
            for index in range(6):
                writer.write(get(f"/stores/hold{index}"))
                await writer.drain()
            await wait_until(lambda: len(plane.held) >= 2, message="two requests held")
            answered = 0
            while answered < 6:
                await wait_until(lambda n=answered: len(plane.held) > n, message=f"request {answered} handled")
                plane.held[answered].answer(200, [], b"%d" % answered)
                assert (await read_answer(reader)).body == b"%d" % answered
                answered += 1

    arun(scenario())


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(arun: Any) -> None:
    async def scenario() -> None:
        async with serving(Plane(), keep_alive_timeout_s=0.2) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/a"))
            assert (await read_answer(reader)).status == 200
            answered = time.monotonic()
            assert await closed_by_server(reader)
            assert time.monotonic() - answered >= 0.15

    arun(scenario())


def test_a_request_waiting_for_its_answer_is_not_timed_out(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane, keep_alive_timeout_s=0.1) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/hold"))
            await wait_until(lambda: plane.held)
            began = time.monotonic()
            await wait_until(lambda: time.monotonic() - began > 0.35, message="three time-outs to pass")
            plane.held[0].answer(200, [], b"late")
            assert (await read_answer(reader)).body == b"late"

    arun(scenario())


# -- bodies, Expect, HEAD --------------------------------------------------------------------------------


def test_expect_100_continue_is_answered_before_the_body_is_sent(arun: Any) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            for path in ("/stores/e", "/echo"):
                writer.write(get(path, "Content-Length: 5", "Expect: 100-continue", method="POST"))
                interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT_S)
                assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
                writer.write(b"hello")
                answer = await read_answer(reader)
                assert answer.status == 200 and answer.body.endswith(b"hello")

    arun(scenario())


def test_expect_100_continue_with_a_body_over_the_limit_is_refused_at_once(arun: Any) -> None:
    async def scenario() -> None:
        async with serving(Plane(), max_body_bytes=1000) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/e", "Content-Length: 1001", "Expect: 100-continue", method="POST"))
            answer = await read_answer(reader)
            assert answer.status == 413
            assert answer.json() == {"error": "body_too_large", "message": "the body is larger than 1000 bytes"}
            assert answer.header("connection") == "close" and NEW_ID.match(answer.header("x-request-id") or "")
            assert await closed_by_server(reader)

    arun(scenario())


def test_an_unknown_expectation_is_417(arun: Any) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/e", "Content-Length: 3", "Expect: something-else", method="POST"))
            answer = await read_answer(reader)
            assert answer.status == 417 and answer.json()["error"] == "expectation_failed"
            assert await closed_by_server(reader)

    arun(scenario())


def test_head_answers_have_the_body_length_and_no_body(arun: Any) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/h", method="HEAD") + get("/stores/after"))
            head = await read_answer(reader, head=True)
            assert head.status == 200 and head.header("content-length") == str(len(b"HEAD /stores/h "))
            # Had the HEAD answer carried a body, this would read it as the next answer's status line.
            assert (await read_answer(reader)).body == b"GET /stores/after "
            writer.write(get("/hello", method="HEAD") + get("/stores/after"))
            head = await read_answer(reader, head=True)
            assert head.status == 200 and int(head.header("content-length") or 0) > 0
            assert (await read_answer(reader)).body == b"GET /stores/after "

    arun(scenario())


def test_a_chunked_request_body_is_assembled(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server, connect(server.port) as (reader, writer):
            for path in ("/stores/c", "/echo"):
                writer.write(get(path, "Transfer-Encoding: chunked", method="POST"))
                writer.write(b"3\r\nabc\r\n")
                await writer.drain()
                writer.write(b"4\r\ndefg\r\n0\r\n\r\n")
                answer = await read_answer(reader)
                assert answer.status == 200 and answer.body.endswith(b"abcdefg")
        assert plane.handled[0].body == b"abcdefg"

    arun(scenario())


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_over_the_limit_is_413_and_closes(arun: Any, framing: str) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane, max_body_bytes=100) as server, connect(server.port) as (reader, writer):
            if framing == "chunked":
                writer.write(get("/stores/c", "Transfer-Encoding: chunked", method="POST") + b"65\r\n" + b"x" * 101)
            else:
                writer.write(get("/stores/c", "Content-Length: 101", method="POST") + b"x" * 101)
            answer = await read_answer(reader)
            assert answer.status == 413 and answer.json()["error"] == "body_too_large"
            assert await closed_by_server(reader)
        assert plane.handled == []

    arun(scenario())


@pytest.mark.parametrize("path", ["/stores/slow", "/echo"], ids=["data-plane", "asgi"])
def test_a_body_that_does_not_arrive_in_time_is_408_and_closes(arun: Any, path: str) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane, body_timeout_s=0.2) as server, connect(server.port) as (reader, writer):
            writer.write(get(path, "Content-Length: 100", "x-request-id: slow-1", method="POST") + b"x" * 10)
            await writer.drain()
            sent = time.monotonic()
            answer = await read_answer(reader)  # within IO_TIMEOUT_S: the deadline of this poll
            waited = time.monotonic() - sent
            assert answer.status == 408 and answer.json() == {
                "error": "body_timeout",
                "message": "the body did not arrive within 0.2 s",
            }
            assert answer.header("connection") == "close" and answer.header("x-request-id") == "slow-1"
            assert 0.15 <= waited < IO_TIMEOUT_S
            assert await closed_by_server(reader)
        assert plane.handled == [] and server.refusals == {"body_timeout": 1}

    arun(scenario())


def test_only_a_request_whose_body_is_still_coming_has_a_body_timer(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane, body_timeout_s=0.2) as server, connect(server.port) as (reader, writer):
            (conn,) = await _connections(server)
            # No body, or all of it in the read that brought the head: no timer is ever made.
            writer.write(get("/stores/a") + get("/stores/b", "Content-Length: 3", method="POST") + b"abc")
            assert [(await read_answer(reader)).status for _ in range(2)] == [200, 200]
            assert conn._body_timer is None
            # A body still coming after the read: one timer, gone with the body's end.
            writer.write(get("/stores/c", "Content-Length: 6", method="POST") + b"abc")
            await wait_until(lambda: conn._body_timer is not None, message="the body timer armed")
            writer.write(b"def")
            assert (await read_answer(reader)).body == b"POST /stores/c abcdef"
            assert conn._body_timer is None
        assert server.refusals == {}

    arun(scenario())


def test_no_body_timeout_with_0(arun: Any) -> None:
    async def scenario() -> None:
        # The keep-alive timeout is the test's clock: a connection opened once the slow body's head is read
        # is closed as idle after it, while the slow body is still waited for.
        limits = {"body_timeout_s": 0, "keep_alive_timeout_s": 0.3}
        async with serving(Plane(), **limits) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/slow", "Content-Length: 4", "Expect: 100-continue", method="POST") + b"ab")
            # The interim answer leaves at the end of the read that brought the head, when a body timer would
            # have been armed.
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT_S)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            (conn,) = await _connections(server)
            async with connect(server.port) as (idle_reader, _):
                assert await closed_by_server(idle_reader)
            assert conn._body_timer is None
            writer.write(b"cd")
            assert (await read_answer(reader)).body == b"POST /stores/slow abcd"
        assert server.refusals == {}

    arun(scenario())


def test_the_body_timeout_does_not_run_while_the_server_has_paused_reading(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        limits = {"body_timeout_s": 0.2, "max_pipelined": 2}
        async with serving(plane, **limits) as server, connect(server.port) as (reader, writer):
            # The second request's head fills the pipeline: the server stops reading before its body.
            writer.write(get("/stores/hold") + get("/stores/body", "Content-Length: 2", method="POST"))
            await wait_until(lambda: plane.held, message="the first request held")
            (conn,) = await _connections(server)
            # A body late on another connection, whose clock starts after this one's head was read, runs out
            # of time: had this connection's clock run while reading was paused, it would have run out first.
            async with connect(server.port) as (late_reader, late_writer):
                late_writer.write(get("/stores/late", "Content-Length: 2", method="POST"))
                assert (await read_answer(late_reader)).status == 408
            assert conn._read_paused and conn._body_timer is None
            plane.held[0].answer(200, [], b"first")
            assert (await read_answer(reader)).body == b"first"
            writer.write(b"ok")  # reading resumed: the body has its whole time again
            assert (await read_answer(reader)).body == b"POST /stores/body ok"
        assert server.refusals == {"body_timeout": 1}  # the late connection's only

    arun(scenario())


async def _connections(server: HttpServer) -> list[Any]:
    await wait_until(lambda: server._connections, message="the connection accepted")
    return list(server._connections)


def test_headers_over_the_limit_are_431_and_close(arun: Any) -> None:
    async def scenario() -> None:
        async with serving(Plane(), max_header_bytes=1024) as server:
            async with connect(server.port) as (reader, writer):
                writer.write(get("/stores/a", "x-big: " + "b" * 1100))
                answer = await read_answer(reader)
                assert answer.status == 431 and answer.json() == {
                    "error": "headers_too_large",
                    "message": "the request line and headers exceed 1024 bytes",
                }
                assert answer.header("connection") == "close"
                assert await closed_by_server(reader)
            # Within the limit: served.
            assert (await exchange(server.port, get("/stores/a", "x-big: " + "b" * 900))).status == 200

    arun(scenario())


def test_a_head_that_never_ends_is_431_and_closes(arun: Any) -> None:
    async def scenario() -> None:
        async with serving(Plane(), max_header_bytes=1024) as server, connect(server.port) as (reader, writer):
            writer.write(b"GET /stores/a HTTP/1.1\r\nx-endless: ")
            chunk = b"y" * 65536
            for _ in range(6):  # beyond the limit plus one read of the server's
                writer.write(chunk)
                await writer.drain()
            answer = await read_answer(reader)
            assert answer.status == 431
            assert await closed_by_server(reader)

    arun(scenario())


@pytest.mark.parametrize(
    "request_bytes",
    [b"NOT HTTP AT ALL\r\n\r\n", b"GET /x HTTP/1.1\r\nbad header line\r\n\r\n", b"GET /x HTTP/9.9\r\n\r\n"],
    ids=["garbage", "header", "version"],
)
def test_a_malformed_request_is_400_and_closes(arun: Any, request_bytes: bytes) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            writer.write(request_bytes)
            answer = await read_answer(reader)
            assert answer.status == 400 and answer.json()["error"] == "bad_request"
            assert await closed_by_server(reader)

    arun(scenario())


# -- refusals: counted, and reported to on_refusal --------------------------------------------------------

REFUSED = [
    pytest.param(b"NOT HTTP AT ALL\r\n\r\n", 400, "bad_request", id="malformed"),
    pytest.param(get("/stores/b", "Content-Length: 10", method="POST") + b"abc", 408, "body_timeout", id="slow-body"),
    pytest.param(get("/stores/c", "Content-Length: 101", method="POST"), 413, "body_too_large", id="declared-body"),
    pytest.param(
        get("/stores/c", "Transfer-Encoding: chunked", method="POST") + b"65\r\n" + b"x" * 101,
        413,
        "body_too_large",
        id="chunked-body",
    ),
    pytest.param(
        get("/echo", "Content-Length: 3", "Expect: other", method="POST"), 417, "expectation_failed", id="417"
    ),
    pytest.param(get("/hello", "x-big: " + "b" * 1100), 431, "headers_too_large", id="head"),
]


@pytest.mark.parametrize(("request_bytes", "status", "code"), REFUSED)
def test_every_refusal_of_the_server_is_counted_and_reported_with_its_code(
    arun: Any, request_bytes: bytes, status: int, code: str
) -> None:
    reported: list[str] = []

    async def scenario() -> None:
        plane = Plane()
        server = HttpServer(
            starlette_app(),
            ServerLimits(max_header_bytes=1024, max_body_bytes=100, body_timeout_s=0.1),
            data_plane=lambda state: plane,
            on_refusal=reported.append,
        )
        await server.start(port=0)
        try:
            async with connect(server.port) as (reader, writer):
                writer.write(get("/stores/first") + request_bytes)
                assert (await read_answer(reader)).status == 200  # the request before is not refused
                answer = await read_answer(reader)
                assert answer.status == status and answer.json()["error"] == code
                assert await closed_by_server(reader)
            assert server.refusals == {code: 1}
        finally:
            await server.stop()
        assert [r.path for r in plane.handled] == [b"/stores/first"]

    arun(scenario())
    assert reported == [code]
    assert code in SERVER_REFUSALS  # what keyroute.http.admission.Admission.refused counts


def test_a_head_that_never_ends_is_one_refusal(arun: Any) -> None:
    reported: list[str] = []

    async def scenario() -> None:
        server = HttpServer(starlette_app(), ServerLimits(max_header_bytes=1024), on_refusal=reported.append)
        await server.start(port=0)
        try:
            async with connect(server.port) as (reader, writer):
                writer.write(b"GET /hello HTTP/1.1\r\nx-endless: ")
                for _ in range(6):
                    writer.write(b"y" * 65536)
                    with contextlib.suppress(ConnectionError):
                        await writer.drain()
                assert (await read_answer(reader)).status == 431
        finally:
            await server.stop()

    arun(scenario())
    assert reported == ["headers_too_large"]


def test_answers_that_are_not_refusals_are_not_reported(arun: Any, caplog: pytest.LogCaptureFixture) -> None:
    reported: list[str] = []

    async def scenario() -> None:
        server = HttpServer(starlette_app(), data_plane=lambda state: Plane(), on_refusal=reported.append)
        await server.start(port=0)
        try:
            async with connect(server.port) as (reader, writer):
                for path in ("/stores/boom", "/fails", "/missing", "/stores/a"):  # 500, 500, the app's 404, 200
                    writer.write(get(path))
                    assert (await read_answer(reader)).status in (500, 404, 200)
            assert server.refusals == {}
        finally:
            await server.stop()

    with caplog.at_level(logging.ERROR, logger="keyroute.http"):
        arun(scenario())
    assert reported == []


def test_an_on_refusal_that_raises_is_logged_and_the_refusal_still_answered(
    arun: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(code: str) -> None:
        raise RuntimeError(f"cannot count {code}")

    async def scenario() -> None:
        server = HttpServer(starlette_app(), ServerLimits(max_header_bytes=1024), on_refusal=broken)
        await server.start(port=0)
        try:
            answer = await exchange(server.port, get("/hello", "x-big: " + "b" * 1100))
            assert answer.status == 431 and answer.json()["error"] == "headers_too_large"
            assert (await exchange(server.port, get("/hello"))).status == 200
            assert server.refusals == {"headers_too_large": 1}
        finally:
            await server.stop()

    with caplog.at_level(logging.ERROR, logger="keyroute.http.server"):
        arun(scenario())
    assert any(
        r.name == "keyroute.http.server" and r.exc_info and "cannot count headers_too_large" in str(r.exc_info[1])
        for r in caplog.records
    )


# -- failures --------------------------------------------------------------------------------------------


def test_a_handler_that_raises_is_a_logged_500_and_the_connection_goes_on(
    arun: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/boom", "x-request-id: failing-1"))
            answer = await read_answer(reader)
            assert answer.status == 500 and answer.json() == {"error": "internal_error", "message": "internal error"}
            assert answer.header("x-request-id") == "failing-1"
            assert b"secret" not in answer.body and b"Traceback" not in answer.body
            writer.write(get("/stores/next"))
            assert (await read_answer(reader)).body == b"GET /stores/next "

    with caplog.at_level(logging.ERROR, logger="keyroute.http.protocol"):
        arun(scenario())
    failures = [r for r in caplog.records if r.exc_info and "secret detail" in str(r.exc_info[1])]
    assert [r.name for r in failures] == ["keyroute.http.protocol"]
    assert len(failures) == 1


def test_an_answer_after_the_client_left_writes_nothing_and_raises_nothing(
    arun: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server:
            async with connect(server.port) as (_, writer):
                writer.write(get("/stores/hold"))
                await wait_until(lambda: plane.held, message="the request held")
                assert not plane.held[0].gone
            await wait_until(lambda: plane.held[0].gone, message="the exchange to see the client gone")
            plane.held[0].answer(200, [], b"nobody listens")
            plane.held[0].answer(200, [], b"twice")
            # The server still serves.
            assert (await exchange(server.port, get("/stores/a"))).status == 200

    with caplog.at_level(logging.WARNING):
        arun(scenario())
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_second_answer_is_ignored(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/hold"))
            await wait_until(lambda: plane.held)
            plane.held[0].answer(200, [], b"one")
            plane.held[0].answer(200, [], b"two")
            writer.write(get("/stores/next"))
            assert (await read_answer(reader)).body == b"one"
            assert (await read_answer(reader)).body == b"GET /stores/next "

    arun(scenario())


# -- request ids -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/stores/a", "/hello"], ids=["data-plane", "asgi"])
def test_a_valid_request_id_is_echoed_and_others_replaced(arun: Any, path: str) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            valid = "client-id/42:" + "x" * 115  # 128 visible characters, as keyroute.core.logs accepts
            writer.write(get(path, f"X-Request-Id: {valid}"))
            assert (await read_answer(reader)).header("x-request-id") == valid
            for bad in ("y" * 129, "caf\xe9", "with space"):
                writer.write(get(path, f"X-Request-Id: {bad}"))
                assert NEW_ID.match((await read_answer(reader)).header("x-request-id") or "")
            writer.write(get(path))
            assert NEW_ID.match((await read_answer(reader)).header("x-request-id") or "")

    arun(scenario())


def test_the_request_id_rule_is_the_core_logs_own(arun: Any) -> None:
    candidates = ["a", "x" * 128, "x" * 129, "tab\there", "caf\xe9", "semi;colon", 'quote"d', "{json}"]

    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server, connect(server.port) as (reader, writer):
            for candidate in candidates:
                writer.write(get("/stores/id", f"x-request-id: {candidate}"))
                echoed = (await read_answer(reader)).header("x-request-id")
                kept = echoed == candidate
                assert kept == acceptable_request_id(candidate), candidate
                assert kept or NEW_ID.match(echoed or ""), candidate
        assert [r.request_id for r in plane.handled[:2]] == candidates[:2]

    arun(scenario())


def test_an_answer_with_its_own_request_id_keeps_it(arun: Any) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server:
            answer = await exchange(server.port, get("/stores/own-id", "x-request-id: theirs"))
            assert answer.header("x-request-id") == "mine"

    arun(scenario())


# -- the ASGI bridge -------------------------------------------------------------------------------------


def test_asgi_json_post_echo_and_percent_decoded_path(arun: Any) -> None:
    seen: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            raise RuntimeError("no lifespan here")  # an app without lifespan support is fine
        seen.append(scope)
        message = await receive()
        body = json.dumps({"path": scope["path"], "body": message["body"].decode()}).encode()
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    async def scenario() -> None:
        async with serving(app=app) as server:
            port = server.port
            request = b"POST /caf%C3%A9/x?q=1 HTTP/1.1\r\nhost: t\r\nContent-Length: 4\r\n\r\nbody"
            answer = await exchange(server.port, request)
            assert answer.status == 201 and answer.json() == {"path": "/caf\xe9/x", "body": "body"}
            assert answer.header("content-length") == str(len(answer.body))
            assert NEW_ID.match(answer.header("x-request-id") or "") and answer.header("date")
        (scope,) = seen
        assert scope["raw_path"] == b"/caf%C3%A9/x" and scope["query_string"] == b"q=1"
        assert scope["http_version"] == "1.1" and scope["method"] == "POST" and scope["scheme"] == "http"
        assert scope["root_path"] == "" and scope["client"][0] == "127.0.0.1" and scope["server"][1] == port
        assert (b"content-length", b"4") in scope["headers"]

    arun(scenario())


def test_starlette_routes_through_the_bridge(arun: Any) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            writer.write(get("/hello"))
            assert (await read_answer(reader)).json()["hello"] == "world"
            writer.write(get("/echo", "Content-Length: 6", method="POST") + b"echo!!")
            assert (await read_answer(reader)).body == b"echo!!"
            writer.write(get("/stream"))
            streamed = await read_answer(reader)
            assert streamed.header("transfer-encoding") == "chunked" and streamed.body == b"part0;part1;part2;"
            writer.write(get("/missing"))
            assert (await read_answer(reader)).status == 404

    arun(scenario())


def test_a_stream_to_http10_is_delimited_by_closing(arun: Any) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stream", "Connection: keep-alive", version="1.0"))
            answer = await read_answer(reader)  # read to the end of the connection
            assert answer.header("transfer-encoding") is None and answer.header("connection") == "close"
            assert answer.body == b"part0;part1;part2;"

    arun(scenario())


def test_an_app_that_raises_before_answering_is_a_500_and_the_connection_goes_on(
    arun: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return
        if scope["path"] == "/raise":
            raise RuntimeError("app secret")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"fine"})

    async def scenario() -> None:
        async with serving(app=app) as server, connect(server.port) as (reader, writer):
            writer.write(get("/raise", "x-request-id: r-1"))
            answer = await read_answer(reader)
            assert answer.status == 500 and answer.json() == {"error": "internal_error", "message": "internal error"}
            assert answer.header("x-request-id") == "r-1"
            writer.write(get("/fine"))
            assert (await read_answer(reader)).body == b"fine"

    with caplog.at_level(logging.ERROR, logger="keyroute.http.asgi"):
        arun(scenario())
    assert any(
        r.name == "keyroute.http.asgi" and r.exc_info and "app secret" in str(r.exc_info[1]) for r in caplog.records
    )


def test_a_starlette_route_that_raises_is_a_500_and_is_logged(arun: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            writer.write(get("/fails"))
            answer = await read_answer(reader)
            assert answer.status == 500 and b"a route that fails" not in answer.body
            writer.write(get("/stores/next"))
            assert (await read_answer(reader)).status == 200

    with caplog.at_level(logging.ERROR, logger="keyroute.http.asgi"):
        arun(scenario())
    assert any(
        r.name == "keyroute.http.asgi" and r.exc_info and "a route that fails" in str(r.exc_info[1])
        for r in caplog.records
    )


def test_an_app_that_raises_after_its_answer_started_closes_the_connection(
    arun: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            writer.write(get("/broken-stream"))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT_S)
            assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in head
            rest = await asyncio.wait_for(reader.read(), IO_TIMEOUT_S)  # until the server closes
            assert rest.startswith(b"6\r\nfirst;\r\n") and not rest.endswith(b"0\r\n\r\n")

    with caplog.at_level(logging.ERROR, logger="keyroute.http.asgi"):
        arun(scenario())
    assert any(
        r.name == "keyroute.http.asgi" and r.exc_info and "the stream broke" in str(r.exc_info[1])
        for r in caplog.records
    )


def test_the_lifespan_state_reaches_the_data_plane_factory_and_the_requests(arun: Any) -> None:
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        app.state.proxy = "the proxy"
        events.append("startup")
        yield {"counter": 7}
        events.append("shutdown")

    async def scenario() -> None:
        plane = Plane()
        given: list[Any] = []

        def factory(state: Any) -> Plane:
            given.append(state.proxy)
            return plane

        server = HttpServer(starlette_app(lifespan), data_plane=factory)
        await server.start(port=0)
        assert given == ["the proxy"] and events == ["startup"] and server.data_plane is plane
        try:
            answer = await exchange(server.port, get("/hello"))
            assert answer.json()["state"] == 7
            assert (await exchange(server.port, get("/stores/x"))).status == 200
        finally:
            await server.stop()
        assert events == ["startup", "shutdown"]

    arun(scenario())


def test_a_failing_lifespan_makes_start_raise_and_nothing_listens(arun: Any) -> None:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        raise ValueError("no store here")
        yield  # pragma: no cover

    async def scenario() -> None:
        built: list[Any] = []
        server = HttpServer(starlette_app(lifespan), data_plane=built.append)
        with pytest.raises(RuntimeError, match="no store here"):
            await server.start(port=0)
        assert built == []
        with pytest.raises(RuntimeError):
            server.port  # noqa: B018

    arun(scenario())


# -- shutdown and flow control ---------------------------------------------------------------------------


def test_stop_lets_the_request_under_way_finish_then_closes(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        server = HttpServer(starlette_app(), data_plane=lambda state: plane)
        await server.start(port=0)
        port = server.port
        async with connect(port) as (reader, writer), connect(port) as (idle_reader, _):
            writer.write(get("/stores/hold"))
            await wait_until(lambda: plane.held)
            stopping = asyncio.ensure_future(server.stop(grace_s=5.0))
            assert await closed_by_server(idle_reader)  # the idle connection goes at once
            assert not stopping.done()
            loop = asyncio.get_running_loop()
            loop.call_later(0.05, plane.held[0].answer, 200, [], b"finished")
            answer = await read_answer(reader)
            assert answer.body == b"finished" and answer.header("connection") == "close"
            assert await closed_by_server(reader)
            await asyncio.wait_for(stopping, IO_TIMEOUT_S)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

    arun(scenario())


def test_stop_answers_every_pipelined_request_under_way(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        server = HttpServer(starlette_app(), data_plane=lambda state: plane)
        await server.start(port=0)
        async with connect(server.port) as (reader, writer):
            writer.write(get("/stores/hold1") + get("/stores/hold2"))
            await wait_until(lambda: len(plane.held) == 2)
            stopping = asyncio.ensure_future(server.stop(grace_s=5.0))
            await asyncio.sleep(0)
            plane.held[1].answer(200, [], b"second")
            plane.held[0].answer(200, [], b"first")
            first, second = await read_answer(reader), await read_answer(reader)
            assert (first.body, first.header("connection")) == (b"first", None)
            assert (second.body, second.header("connection")) == (b"second", "close")
            assert await closed_by_server(reader)
            await asyncio.wait_for(stopping, IO_TIMEOUT_S)

    arun(scenario())


def test_stop_closes_what_is_still_busy_after_the_grace_period(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        server = HttpServer(starlette_app(), data_plane=lambda state: plane)
        await server.start(port=0)
        async with connect(server.port) as (reader, writer):
            writer.write(get("/stores/hold"))
            await wait_until(lambda: plane.held)
            await asyncio.wait_for(server.stop(grace_s=0.1), IO_TIMEOUT_S)
            assert await closed_by_server(reader)
            assert plane.held[0].gone

    arun(scenario())


def test_answers_are_not_lost_while_the_write_buffer_is_full(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        plane.big = os.urandom(1 << 20)
        total = 40
        async with serving(plane) as server, connect(server.port) as (reader, writer):
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # fill the server's buffer sooner
            # One request at a time, not reading: the server stops reading once its write buffer is full.
            sent = 0
            while sent < total:
                writer.write(get("/stores/big"))
                await writer.drain()
                sent += 1
                try:
                    await wait_until(lambda n=sent: len(plane.handled) >= n, timeout_s=0.5)
                except AssertionError:
                    break
            handled_before_reading = len(plane.handled)
            assert handled_before_reading < total, "the server kept reading with a full write buffer"
            for _ in range(total - sent):
                writer.write(get("/stores/big"))
            for index in range(total):
                answer = await read_answer(reader)
                assert answer.status == 200 and answer.body == plane.big, index
            assert len(plane.handled) == total

    arun(scenario())


# -- helpers for other tests: a server on a thread, run() ------------------------------------------------


def test_serve_in_thread_serves_plain_sockets_and_stops() -> None:
    plane = Plane()
    server = HttpServer(starlette_app(), data_plane=lambda state: plane)
    with serve_in_thread(server) as port, socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(get("/stores/t", "Connection: close"))
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        assert received.startswith(b"HTTP/1.1 200 OK\r\n") and received.endswith(b"GET /stores/t ")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_run_stops_cleanly_on_request_and_reports_a_failed_start() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = HttpServer(starlette_app())
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run(server, "127.0.0.1", 0, sockets=[listener])))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                    sock.sendall(get("/hello", "Connection: close"))
                    assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")
                break
            except ConnectionError:
                assert time.monotonic() < deadline, "run() did not start serving"
                time.sleep(0.01)
    finally:
        server.request_stop()
        thread.join(timeout=10)
    assert codes == [0]

    @contextlib.asynccontextmanager
    async def failing(app: Starlette) -> AsyncIterator[None]:
        raise ValueError("cannot start")
        yield  # pragma: no cover

    assert run(HttpServer(starlette_app(failing)), "127.0.0.1", 0) == 1


def test_run_stops_gracefully_on_sigterm(tmp_path: Any) -> None:
    script = textwrap.dedent(
        """
        import contextlib, socket, sys
        from keyroute.http import HttpServer, run
        from starlette.applications import Starlette

        @contextlib.asynccontextmanager
        async def lifespan(app):
            yield
            print("shutdown ran", flush=True)

        listener = socket.create_server(("127.0.0.1", 0))
        print(listener.getsockname()[1], flush=True)
        sys.exit(run(HttpServer(Starlette(lifespan=lifespan)), "127.0.0.1", 0, sockets=[listener]))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                    sock.sendall(get("/nothing", "Connection: close"))
                    assert sock.recv(65536).startswith(b"HTTP/1.1 404 ")
                break
            except ConnectionError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "shutdown ran" in out


# -- more of the bridge and the data plane ---------------------------------------------------------------


def test_an_answer_that_cannot_be_encoded_is_a_500(arun: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/bad-answer"))
            answer = await read_answer(reader)
            assert answer.status == 500 and answer.json()["error"] == "internal_error"
            writer.write(get("/stores/next"))
            assert (await read_answer(reader)).status == 200

    with caplog.at_level(logging.ERROR, logger="keyroute.http.protocol"):
        arun(scenario())
    assert any(r.name == "keyroute.http.protocol" and r.exc_info for r in caplog.records)


def test_an_absolute_form_target_is_split_into_path_and_query(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server:
            answer = await exchange(server.port, b"GET http://example.com/stores/abs?x=1 HTTP/1.1\r\nhost: t\r\n\r\n")
            assert answer.body == b"GET /stores/abs "
        assert plane.handled[0].query == b"x=1"

    arun(scenario())


def asgi_app(handler: Callable[[dict[str, Any], Any, Any], Coroutine[Any, Any, None]]) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return  # no lifespan support
        await handler(scope, receive, send)

    return app


def test_an_invalid_response_header_or_no_answer_at_all_is_a_500(arun: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def handler(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/injection":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1\r\nx-b: 2")]})
            await send({"type": "http.response.body", "body": b"never"})
        elif scope["path"] == "/nothing":
            return
        else:
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    async def scenario() -> None:
        async with serving(app=asgi_app(handler)) as server, connect(server.port) as (reader, writer):
            for path in ("/injection", "/nothing"):
                writer.write(get(path))
                answer = await read_answer(reader)
                assert answer.status == 500 and answer.json()["error"] == "internal_error", path
            writer.write(get("/empty"))
            empty = await read_answer(reader)
            assert empty.status == 204 and empty.header("content-length") is None
            assert NEW_ID.match(empty.header("x-request-id") or "")

    with caplog.at_level(logging.ERROR, logger="keyroute.http.asgi"):
        arun(scenario())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and {r.name for r in errors} == {"keyroute.http.asgi"}


def test_receive_gives_the_body_then_the_disconnect(arun: Any) -> None:
    messages: list[dict[str, Any]] = []

    async def handler(scope: dict[str, Any], receive: Any, send: Any) -> None:
        messages.append(await receive())
        messages.append(await receive())  # waits for the client to leave

    async def scenario() -> None:
        async with serving(app=asgi_app(handler)) as server:
            async with connect(server.port) as (_, writer):
                writer.write(get("/wait", "content-length: 3", method="POST") + b"abc")
                await wait_until(lambda: messages, message="the body received")
            await wait_until(lambda: len(messages) == 2, message="the disconnect received")
        assert messages == [
            {"type": "http.request", "body": b"abc", "more_body": False},
            {"type": "http.disconnect"},
        ]

    arun(scenario())


def test_a_failing_lifespan_shutdown_is_logged_and_stop_returns(arun: Any, caplog: pytest.LogCaptureFixture) -> None:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        raise ValueError("shutdown trouble")

    async def scenario() -> None:
        server = HttpServer(starlette_app(lifespan))
        await server.start(port=0)
        await server.stop()

    with caplog.at_level(logging.ERROR, logger="keyroute.http.lifespan"):
        arun(scenario())
    assert any(r.name == "keyroute.http.lifespan" and "shutdown trouble" in r.getMessage() for r in caplog.records)
