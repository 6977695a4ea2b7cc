"""keyroute.http.protocol over real sockets on 127.0.0.1: the behaviour contract in the module's docstring, on
asyncio's own event loop and on uvloop. The server runs in the test's event loop; the client speaks raw bytes
over asyncio streams."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

import pytest

from keyroute.runtime.logs import acceptable_request_id, new_request_id
from tests.unit.http.fake_loop import Wire
from tests.unit.http.harness import (
    IO_TIMEOUT_S,
    NEW_ID,
    Plane,
    asgi_app,
    closed_by_server,
    connect,
    exchange,
    get,
    read_answer,
    serving,
    starlette_app,
)
from tests.util import wait_until

# -- keep-alive and connection handling --------------------------------------------------------------------


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


def test_the_server_makes_new_ids_from_the_one_sequence_of_new_request_id(arun: Any) -> None:
    # The server makes the ids of requests that come without one itself (inline, for speed): the same prefix
    # and the same counter as new_request_id(), so ids made either way never repeat.
    made: list[str] = []

    async def scenario() -> None:
        made.append(new_request_id())
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            for _ in range(2):
                writer.write(get("/stores/a"))
                made.append((await read_answer(reader)).header("x-request-id") or "")
                made.append(new_request_id())

    arun(scenario())
    assert len(made) == 5
    prefixes = {made_id.rpartition("-")[0] for made_id in made}
    numbers = [int(made_id.rpartition("-")[2], 16) for made_id in made]
    assert len(prefixes) == 1 and all(NEW_ID.match(made_id) for made_id in made)
    assert numbers == list(range(numbers[0], numbers[0] + 5))  # consecutive: nothing else made ids meanwhile


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


def test_each_request_on_a_connection_carries_its_own_version(arun: Any) -> None:
    # The version is read without asking the parser when it can only be 1.1 (kept alive, no Connection
    # header): every other head, in any order on one connection, still reports what it said.
    heads = [
        ("1.0", "Connection: keep-alive"),
        ("1.1", None),
        ("1.0", "Connection: Keep-Alive"),
        ("1.1", "Connection: keep-alive"),
        ("1.1", "Connection: te"),
        ("1.1", None),
        ("1.1", "Connection: close"),
    ]

    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server, connect(server.port) as (reader, writer):
            for version, connection in heads:
                writer.write(get("/stores/a", *([connection] if connection else []), version=version))
                answer = await read_answer(reader)
                assert answer.status == 200
                said = "close" if connection == "Connection: close" else None
                assert answer.header("connection") == ("keep-alive" if version == "1.0" else said)
        assert [request.http_version for request in plane.handled] == [version for version, _ in heads]

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


@pytest.mark.parametrize("upgrade", [True, False])
def test_an_upgrade_request_is_answered_and_closed_and_its_upgrade_header_alone_is_not_one(
    arun: Any, upgrade: bool
) -> None:
    # We speak no other protocol: what follows an upgrading request's head is not HTTP for us. Only a request
    # with `Connection: upgrade` and an Upgrade header upgrades; the header alone is an ordinary header.
    async def scenario() -> None:
        plane = Plane()
        connection = "Connection: upgrade" if upgrade else "Connection: keep-alive"
        async with serving(plane) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/a", "Upgrade: websocket", connection) + get("/stores/b"))
            answer = await read_answer(reader)
            assert answer.status == 200 and answer.body == b"GET /stores/a "
            if upgrade:
                assert answer.header("connection") == "close"
                assert await closed_by_server(reader)
            else:
                assert answer.header("connection") is None
                assert (await read_answer(reader)).body == b"GET /stores/b "
        assert [r.path for r in plane.handled] == ([b"/stores/a"] if upgrade else [b"/stores/a", b"/stores/b"])

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


def test_an_idle_connection_is_closed_a_whole_keep_alive_timeout_after_its_last_answer() -> None:
    # Answered by the data plane, then by the app: each answer starts the idle time anew. A request waiting for
    # its answer is not idle, however long it waits.
    plane = Plane()
    wire = Wire(plane, asgi_app(_hello), keep_alive_timeout_s=1.0)
    wire.loop.advance(0.75)
    for path in ("/stores/a", "/hello"):
        wire.send(get(path))
        assert [answer.status for answer in wire.take()] == [200]
        wire.loop.advance(0.75)
        assert wire.open
    wire.send(get("/stores/hold"))
    wire.loop.advance(3.0)
    assert wire.open and wire.take() == []
    plane.held[0].answer(200, [], b"late")
    assert [answer.body for answer in wire.take()] == [b"late"]
    wire.loop.advance(0.875)
    assert wire.open
    wire.loop.advance(0.125)
    assert not wire.open and wire.take() == []  # closed without a word
    assert wire.server.connections == set()


def test_a_connection_that_never_sends_a_whole_head_is_closed_after_the_keep_alive_timeout() -> None:
    wire = Wire(Plane(), keep_alive_timeout_s=2.0)
    wire.send(b"GET /stores/a HTTP/1.1\r\nhost: te")
    wire.loop.advance(1.875)
    assert wire.open
    wire.loop.advance(0.125)
    assert not wire.open and wire.take() == []


async def _hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


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


# -- bodies, Expect, HEAD ----------------------------------------------------------------------------------


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
def test_a_body_that_does_not_arrive_in_time_is_408_and_closes(path: str) -> None:
    plane = Plane()
    wire = Wire(plane, starlette_app(), body_timeout_s=0.5)
    wire.send(get(path, "Content-Length: 100", "x-request-id: slow-1", method="POST") + b"x" * 10)
    wire.loop.advance(0.25)
    wire.send(b"x" * 10)  # more of it: the body's time runs from its first read all the same
    wire.loop.advance(0.125)
    assert wire.take() == []
    wire.loop.advance(0.125)
    (answer,) = wire.take()
    assert answer.status == 408 and answer.json() == {
        "error": "body_timeout",
        "message": "the body did not arrive within 0.5 s",
    }
    assert answer.header("connection") == "close" and answer.header("x-request-id") == "slow-1"
    # A lingering close: its side ended at once, the connection closed a while later.
    assert wire.transport.eof_written and wire.open
    wire.loop.advance(2.0)
    assert not wire.open
    assert plane.handled == [] and wire.server.refusals == {"body_timeout": 1}


def test_only_a_request_whose_body_is_still_coming_has_a_body_timer() -> None:
    wire = Wire(Plane(), body_timeout_s=0.5, keep_alive_timeout_s=5.0)
    assert wire.loop.pending() == [5.0]  # the idle timer, the connection's one timer
    # No body, or all of it in the read that brought the head: no timer is ever made.
    wire.send(get("/stores/a") + get("/stores/b", "Content-Length: 3", method="POST") + b"abc")
    assert [answer.status for answer in wire.take()] == [200, 200]
    assert wire.loop.pending() == [5.0]
    # A body still coming after the read: one timer, gone with the body's end.
    wire.send(get("/stores/c", "Content-Length: 6", method="POST") + b"abc")
    assert wire.loop.pending() == [0.5, 5.0]
    wire.send(b"def")
    assert [answer.body for answer in wire.take()] == [b"POST /stores/c abcdef"]
    assert wire.loop.pending() == [5.0]
    assert wire.server.refusals == {}


def test_no_body_timeout_with_0() -> None:
    wire = Wire(Plane(), body_timeout_s=0, keep_alive_timeout_s=0.5)
    wire.send(get("/stores/slow", "Content-Length: 4", "Expect: 100-continue", method="POST") + b"ab")
    # The interim answer leaves at the end of the read that brought the head, when a body timer would have
    # been armed.
    assert wire.transport.written == b"HTTP/1.1 100 Continue\r\n\r\n"
    wire.transport.written.clear()
    assert wire.loop.pending() == [0.5]  # the idle timer only
    wire.loop.advance(60.0)  # neither a body timeout nor idle (a request is under way)
    assert wire.open and wire.take() == []
    wire.send(b"cd")
    assert [answer.body for answer in wire.take()] == [b"POST /stores/slow abcd"]
    assert wire.server.refusals == {}


def test_the_body_timeout_does_not_run_while_the_server_has_paused_reading() -> None:
    plane = Plane()
    wire = Wire(plane, body_timeout_s=0.5, max_pipelined=2)
    # The second request's head fills the pipeline: the server stops reading before its body.
    wire.send(get("/stores/hold") + get("/stores/body", "Content-Length: 2", method="POST"))
    assert not wire.transport.reading and wire.loop.pending() == [5.0]
    wire.loop.advance(2.0)  # four body timeouts: not the client's time
    assert wire.take() == [] and wire.open
    plane.held[0].answer(200, [], b"first")
    assert [answer.body for answer in wire.take()] == [b"first"]
    assert wire.transport.reading  # reading resumed: the body has its whole time again
    wire.loop.advance(0.375)
    wire.send(b"o")
    wire.loop.advance(0.0625)
    wire.send(b"k")
    assert [answer.body for answer in wire.take()] == [b"POST /stores/body ok"]
    # And it does run out once reading: a third request whose body does not come in time.
    wire.send(get("/stores/late", "Content-Length: 2", method="POST"))
    wire.loop.advance(0.5)
    assert [answer.status for answer in wire.take()] == [408]
    assert wire.server.refusals == {"body_timeout": 1}


# -- heads and malformed requests --------------------------------------------------------------------------


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


def test_an_absolute_form_target_is_split_into_path_and_query(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server:
            answer = await exchange(server.port, b"GET http://example.com/stores/abs?x=1 HTTP/1.1\r\nhost: t\r\n\r\n")
            assert answer.body == b"GET /stores/abs "
        assert plane.handled[0].query == b"x=1"

    arun(scenario())


# -- the data plane: failures and answers ------------------------------------------------------------------


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


def test_an_exchange_ends_once_at_its_answer_and_tells_its_on_done_before_the_answer_is_written(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server, connect(server.port) as (reader, writer):
            writer.write(get("/stores/hold-1"))
            await wait_until(lambda: plane.held, message="the request held")
            held = plane.held[0]
            assert plane.ended == []
            with pytest.raises(ValueError):
                held.on_done(lambda: None)  # one callback per exchange
            held.answer(200, [], b"one")
            assert plane.ended == [b"/stores/hold-1"]  # at once, on the answer
            held.answer(200, [], b"two")
            assert (await read_answer(reader)).body == b"one"
            writer.write(get("/stores/hold-2"))  # still unanswered when the connection closes
            await wait_until(lambda: len(plane.held) == 2, message="the second request held")
        await wait_until(lambda: plane.held[1].gone, message="the connection closed")
        assert plane.ended == [b"/stores/hold-1", b"/stores/hold-2"]  # the first ended once, at its answer
        with pytest.raises(ValueError):
            held.on_done(lambda: None)  # an exchange that has ended takes no callback

    arun(scenario())


def test_an_exchange_whose_client_leaves_ends_at_once_and_its_late_answer_ends_nothing(arun: Any) -> None:
    async def scenario() -> None:
        plane = Plane()
        async with serving(plane) as server:
            async with connect(server.port) as (reader, writer):
                # Two pipelined requests: the second is answered (and held behind the first), the first not.
                writer.write(get("/stores/hold-1") + get("/stores/hold-2"))
                await wait_until(lambda: len(plane.held) == 2, message="both requests held")
                plane.held[1].answer(200, [], b"second")
                assert plane.ended == [b"/stores/hold-2"]
            await wait_until(lambda: plane.held[0].gone, message="the exchange to see the client gone")
            assert sorted(plane.ended) == [b"/stores/hold-1", b"/stores/hold-2"]  # each once
            plane.held[0].answer(200, [], b"nobody listens")
            assert sorted(plane.ended) == [b"/stores/hold-1", b"/stores/hold-2"]

    arun(scenario())


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


# -- request ids -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/stores/a", "/hello"], ids=["data-plane", "asgi"])
def test_a_valid_request_id_is_echoed_and_others_replaced(arun: Any, path: str) -> None:
    async def scenario() -> None:
        async with serving(Plane()) as server, connect(server.port) as (reader, writer):
            valid = "client-id/42:" + "x" * 115  # 128 visible characters, as keyroute.runtime.logs accepts
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
