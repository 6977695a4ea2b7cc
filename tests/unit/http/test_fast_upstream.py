"""FastUpstream against real servers on 127.0.0.1: an app on keyroute's HTTP server, as the nodes run
(compared with httpx), and a raw asyncio server of our own that misbehaves on cue (closes, hangs, breaks
off, answers twice), on asyncio and uvloop."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import httpx
import pytest
import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from keyroute.http.fast_upstream import FastUpstream
from keyroute.http.server import HttpServer
from keyroute.http.upstream import UpstreamResponse, UpstreamUnavailable
from tests.util import free_port, serve_in_thread, wait_until

T = TypeVar("T")
MIB = bytes(range(256)) * 4096
HEADERS = {"x-keyroute-router": "1", "accept-encoding": "identity"}


class Runner(Protocol):
    def __call__(self, make: Callable[[], Awaitable[T]]) -> T: ...


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    """Runs a test's coroutine on a fresh event loop of each kind (the router runs on uvloop)."""
    factory = asyncio.new_event_loop if request.param == "asyncio" else uvloop.new_event_loop

    def runner(make: Callable[[], Awaitable[T]]) -> T:
        async def main() -> T:
            return await make()

        with asyncio.Runner(loop_factory=factory) as loop:
            return loop.run(main())

    return runner  # type: ignore[return-value]


# -- an app on keyroute's HTTP server (as the nodes run) in a thread --------------------------------------


@dataclass
class AppServer:
    url: str
    client_ports: list[int]


@pytest.fixture(scope="module")
def app_server() -> Iterator[AppServer]:
    ports: list[int] = []

    async def json_answer(request: Request) -> Response:
        assert request.client is not None
        ports.append(request.client.port)
        return JSONResponse({"store": "s", "key": "k", "value": {"n": 1}}, headers={"x-keyroute-node": "n1"})

    async def status(request: Request) -> Response:
        code = int(request.path_params["code"])
        response = Response(b"" if code in (204, 304) else b"status body", status_code=code)
        response.raw_headers += [
            (b"x-keyroute-partition", b"7"),
            (b"x-multi", b"one"),
            (b"x-multi", b"two"),
            (b"x-empty", b""),
            (b"retry-after", b"3"),
        ]
        return response

    async def chunked(request: Request) -> Response:
        async def parts() -> AsyncIterator[bytes]:
            for i in range(5):
                yield f"part {i};".encode()

        return StreamingResponse(parts(), media_type="text/plain")

    async def big(request: Request) -> Response:
        return Response(MIB, media_type="application/octet-stream")

    async def big_chunked(request: Request) -> Response:
        async def parts() -> AsyncIterator[bytes]:
            for start in range(0, len(MIB), 65536):
                yield MIB[start : start + 65536]

        return StreamingResponse(parts(), media_type="application/octet-stream")

    async def echo(request: Request) -> Response:
        body = await request.body()
        headers = {
            "x-body-sha256": hashlib.sha256(body).hexdigest(),
            "x-seen-content-length": request.headers.get("content-length", ""),
            "x-seen-accept-encoding": request.headers.get("accept-encoding", ""),
            "x-seen-host": request.headers.get("host", ""),
        }
        return Response(body, headers=headers)

    app = Starlette(
        routes=[
            Route("/json", json_answer),
            Route("/status/{code:int}", status),
            Route("/chunked", chunked),
            Route("/big", big),
            Route("/big-chunked", big_chunked),
            Route("/echo", echo, methods=["POST"]),
        ]
    )
    with serve_in_thread(HttpServer(app)) as port:
        yield AppServer(f"http://127.0.0.1:{port}", ports)


# -- a raw server whose every answer the test writes -------------------------------------------------------

CLOSE = "close"  # close the connection without a (further) answer
HANG = "hang"  # read the request and never answer (until the client goes away)


def ok(body: bytes = b"hello", extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode() + body


# script(connection number, request number on that connection) -> what to send: bytes, CLOSE or HANG
Script = Callable[[int, int], list[bytes | str]]


@dataclass
class RawServer:
    script: Script
    accepted: int = 0
    open: int = 0
    requests: list[tuple[int, bytes]] = field(default_factory=list)
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        # Closing every connection ends every handler, hanging ones included (cancelling them instead makes
        # Python 3.11's stream server log the cancellation as an error).
        for writer in list(self._writers):
            writer.close()
        await asyncio.gather(*self._tasks)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        connection = self.accepted
        self.accepted += 1
        self.open += 1
        try:
            number = 0
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                self.requests.append((connection, head + body))
                for action in self.script(connection, number):
                    if action == CLOSE:
                        return
                    if action == HANG:
                        while await reader.read(65536):
                            pass
                        return
                    assert isinstance(action, bytes)
                    writer.write(action)
                    await writer.drain()
                number += 1
        finally:
            self.open -= 1
            writer.close()
            self._writers.discard(writer)
            self._tasks.discard(task)


# -- keep-alive and framing, against keyroute's HTTP server ----------------------------------------------


def test_many_requests_travel_over_one_kept_alive_connection(run: Runner, app_server: AppServer) -> None:
    async def scenario() -> list[UpstreamResponse]:
        upstream = FastUpstream()
        try:
            return [await upstream.get(app_server.url + "/json", HEADERS) for _ in range(50)]
        finally:
            await upstream.aclose()

    before = len(app_server.client_ports)
    answers = run(scenario)
    assert {a.status for a in answers} == {200}
    assert len(set(app_server.client_ports[before:])) == 1


def test_waiting_requests_get_the_one_connection_when_it_is_free(run: Runner, app_server: AppServer) -> None:
    async def scenario() -> list[UpstreamResponse]:
        upstream = FastUpstream(max_connections_per_origin=1)
        try:
            return await asyncio.gather(*(upstream.get(app_server.url + "/json", HEADERS) for _ in range(20)))
        finally:
            await upstream.aclose()

    before = len(app_server.client_ports)
    answers = run(scenario)
    assert [a.status for a in answers] == [200] * 20
    assert len(set(app_server.client_ports[before:])) == 1


@pytest.mark.parametrize("path", ["/json", "/chunked", "/big", "/big-chunked", "/status/418", "/status/204"])
def test_status_headers_and_body_are_what_httpx_sees(run: Runner, app_server: AppServer, path: str) -> None:
    async def scenario() -> tuple[UpstreamResponse, httpx.Response]:
        upstream = FastUpstream()
        async with httpx.AsyncClient(trust_env=False) as client:
            try:
                ours = await upstream.get(app_server.url + path, HEADERS)
            finally:
                await upstream.aclose()
            theirs = await client.get(app_server.url + path, headers=HEADERS)
        return ours, theirs

    ours, theirs = run(scenario)
    assert ours.status == theirs.status_code
    # Names lowercased, values as sent, order and repeats kept; the date may tick between the two requests,
    # and each request gets an id of its own.
    own = (b"date", b"x-request-id")
    expected = [(k.lower(), v) for k, v in theirs.headers.raw if k.lower() not in own]
    assert [(k, v) for k, v in ours.headers if k not in own] == expected
    assert ours.body == theirs.content
    if path.startswith("/big"):
        assert ours.body == MIB
    if path == "/chunked":
        assert ours.header(b"transfer-encoding") == b"chunked"
        assert ours.body == b"part 0;part 1;part 2;part 3;part 4;"


def test_a_post_body_arrives_exactly_with_our_framing_headers(run: Runner, app_server: AppServer) -> None:
    body = bytes(range(256)) * 1200 + b"\r\n\r\nGET / HTTP/1.1\r\n\r\n"

    async def scenario() -> UpstreamResponse:
        upstream = FastUpstream()
        try:
            # A caller's framing headers never override ours.
            headers = {**HEADERS, "content-length": "3", "host": "elsewhere", "connection": "close"}
            return await upstream.post(app_server.url + "/echo", body, headers)
        finally:
            await upstream.aclose()

    answer = run(scenario)
    assert answer.status == 200
    assert answer.body == body
    assert answer.header(b"x-body-sha256") == hashlib.sha256(body).hexdigest().encode()
    assert answer.header(b"x-seen-content-length") == str(len(body)).encode()
    assert answer.header(b"x-seen-host") == app_server.url.removeprefix("http://").encode()
    assert answer.header(b"x-seen-accept-encoding") == b"identity"


# -- keep-alive races and failures, against the raw server ------------------------------------------------


def test_a_reused_connection_the_node_closed_before_answering_is_retried_once_on_a_new_one(
    run: Runner,
) -> None:
    # Every connection answers its first request and closes on its second: the keep-alive race, every time.
    def script(connection: int, number: int) -> list[bytes | str]:
        return [ok(f"conn {connection}".encode())] if number == 0 else [CLOSE]

    async def scenario() -> tuple[list[bytes], int, int]:
        async with RawServer(script) as server:
            upstream = FastUpstream()
            try:
                bodies = [(await upstream.get(server.url + "/k", HEADERS)).body for _ in range(3)]
            finally:
                await upstream.aclose()
            return bodies, server.accepted, len(server.requests)

    bodies, accepted, requests = run(scenario)
    assert bodies == [b"conn 0", b"conn 1", b"conn 2"]
    assert accepted == 3
    assert requests == 5  # two of them met a closing connection and were sent again


def test_the_retry_happens_once_only(run: Runner) -> None:
    # The first connection answers once, then closes on the next request; every later one closes at once.
    def script(connection: int, number: int) -> list[bytes | str]:
        return [ok()] if (connection, number) == (0, 0) else [CLOSE]

    async def scenario() -> tuple[UpstreamUnavailable, int]:
        async with RawServer(script) as server:
            upstream = FastUpstream()
            try:
                assert (await upstream.get(server.url + "/k", HEADERS)).status == 200
                with pytest.raises(UpstreamUnavailable) as caught:
                    await upstream.get(server.url + "/k", HEADERS)
            finally:
                await upstream.aclose()
            return caught.value, server.accepted

    error, accepted = run(scenario)
    assert error.node_fault is True
    assert "sent again" in str(error)
    assert accepted == 2


def test_a_node_closing_idle_connections_after_each_answer_costs_no_failed_request(run: Runner) -> None:
    # The close may reach us before the next request or cross it on the wire: both must end in success.
    async def scenario() -> tuple[list[int], int]:
        async with RawServer(lambda connection, number: [ok(), CLOSE]) as server:
            upstream = FastUpstream()
            try:
                statuses = [(await upstream.get(server.url + "/k", HEADERS)).status for _ in range(20)]
            finally:
                await upstream.aclose()
            return statuses, server.accepted

    statuses, accepted = run(scenario)
    assert statuses == [200] * 20
    assert accepted == 20


def test_a_new_connection_closed_before_answering_is_a_node_fault_and_not_retried(run: Runner) -> None:
    async def scenario() -> tuple[UpstreamUnavailable, int]:
        async with RawServer(lambda connection, number: [CLOSE]) as server:
            upstream = FastUpstream()
            try:
                with pytest.raises(UpstreamUnavailable) as caught:
                    await upstream.get(server.url + "/k", HEADERS)
            finally:
                await upstream.aclose()
            return caught.value, server.accepted

    error, accepted = run(scenario)
    assert error.node_fault is True
    assert accepted == 1


@pytest.mark.parametrize("reused", [False, True])
def test_a_node_closing_mid_body_is_a_node_fault_and_not_retried(run: Runner, reused: bool) -> None:
    broken = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten.."

    def script(connection: int, number: int) -> list[bytes | str]:
        return [broken, CLOSE] if number == int(reused) else [ok()]

    async def scenario() -> tuple[UpstreamUnavailable, int]:
        async with RawServer(script) as server:
            upstream = FastUpstream()
            try:
                if reused:
                    assert (await upstream.get(server.url + "/k", HEADERS)).status == 200
                with pytest.raises(UpstreamUnavailable) as caught:
                    await upstream.get(server.url + "/k", HEADERS)
            finally:
                await upstream.aclose()
            return caught.value, server.accepted

    error, accepted = run(scenario)
    assert error.node_fault is True
    assert "mid-response" in str(error)
    assert accepted == 1


def test_a_malformed_answer_is_a_node_fault(run: Runner) -> None:
    async def scenario() -> UpstreamUnavailable:
        async with RawServer(lambda connection, number: [b"HTTP/1.1 OK\r\nnonsense\r\n\r\n"]) as server:
            upstream = FastUpstream()
            try:
                with pytest.raises(UpstreamUnavailable) as caught:
                    await upstream.get(server.url + "/k", HEADERS)
            finally:
                await upstream.aclose()
            await wait_until(lambda: server.open == 0, message="the broken connection closed")
            return caught.value

    error = run(scenario)
    assert error.node_fault is True
    assert "malformed" in str(error)


def test_a_node_that_never_answers_times_out_within_the_bound_and_loses_the_connection(run: Runner) -> None:
    async def scenario() -> tuple[UpstreamUnavailable, float]:
        async with RawServer(lambda connection, number: [HANG]) as server:
            upstream = FastUpstream(timeout_s=0.3)
            loop = asyncio.get_running_loop()  # its clock is the one FastUpstream's deadlines are read on
            started = loop.time()
            try:
                with pytest.raises(UpstreamUnavailable) as caught:
                    await upstream.get(server.url + "/k", HEADERS)
                took = loop.time() - started
                # The late answer must never be read as the answer to another request: the connection goes.
                await wait_until(lambda: server.open == 0, message="the timed-out connection closed")
            finally:
                await upstream.aclose()
            return caught.value, took

    error, took = run(scenario)
    assert error.node_fault is True
    # Ended by its deadline (the watchdog's failure, not the node's doing), and not before it.
    assert "no complete reply within 0.3s" in str(error)
    assert took >= 0.3 - 0.002  # the watchdog may fire up to a loop tick early


def test_a_refused_connection_is_a_node_fault(run: Runner) -> None:
    async def scenario() -> UpstreamUnavailable:
        upstream = FastUpstream()
        try:
            with pytest.raises(UpstreamUnavailable) as caught:
                await upstream.get(f"http://127.0.0.1:{free_port()}/k", HEADERS)
        finally:
            await upstream.aclose()
        return caught.value

    assert run(scenario).node_fault is True


def test_an_exhausted_pool_is_not_a_node_fault_and_frees_up_when_the_busy_request_ends(run: Runner) -> None:
    def script(connection: int, number: int) -> list[bytes | str]:
        return [HANG] if connection == 0 else [ok()]

    async def scenario() -> tuple[UpstreamUnavailable, float, int]:
        async with RawServer(script) as server:
            upstream = FastUpstream(max_connections_per_origin=1, pool_wait_s=0.1)
            try:
                busy = asyncio.ensure_future(upstream.get(server.url + "/slow", HEADERS))
                await wait_until(lambda: len(server.requests) == 1, message="the first request at the node")
                loop = asyncio.get_running_loop()
                started = loop.time()
                with pytest.raises(UpstreamUnavailable) as caught:
                    await upstream.get(server.url + "/k", HEADERS)
                took = loop.time() - started
                assert len(server.requests) == 1  # the refused request never reached the node
                # A cancelled exchange (a hedge that lost, say) gives its connection up, never back.
                busy.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await busy
                status = (await upstream.get(server.url + "/k", HEADERS)).status
            finally:
                await upstream.aclose()
            return caught.value, took, status

    error, took, status = run(scenario)
    assert error.node_fault is False
    # Refused for the busy pool once `pool_wait_s` was over (not the request's own 5 s timeout).
    assert "all 1 connections to" in str(error) and "stayed busy" in str(error)
    assert took >= 0.1 - 0.002
    assert status == 200


def test_a_cancelled_exchange_closes_its_connection_and_the_next_request_gets_its_own_answer(
    run: Runner,
) -> None:
    # A hedge that lost is cancelled mid-exchange; its answer may still be on the way. Were its connection
    # reused, the next request would read that answer (or, here, wait forever behind it).
    def script(connection: int, number: int) -> list[bytes | str]:
        if connection == 0:
            return [ok(b"first")] if number == 0 else [HANG]
        return [ok(f"conn {connection}".encode())]

    async def scenario() -> tuple[bytes, bytes, int, int, int]:
        async with RawServer(script) as server:
            upstream = FastUpstream()
            try:
                first = (await upstream.get(server.url + "/k", HEADERS)).body
                lost = asyncio.ensure_future(upstream.get(server.url + "/k", HEADERS))  # reuses connection 0
                await wait_until(lambda: len(server.requests) == 2, message="the second request at the node")
                lost.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await lost
                # The node sees the connection go: its hanging handler ends only when the client closes.
                await wait_until(lambda: server.open == 0, message="the cancelled exchange's connection closed")
                after = (await upstream.get(server.url + "/k", HEADERS)).body
                pool = upstream._pools[server.url]
                return first, after, server.accepted, pool.opened, len(pool.idle)
            finally:
                await upstream.aclose()

    first, after, accepted, opened, idle = run(scenario)
    assert (first, after) == (b"first", b"conn 1")
    assert accepted == 2
    assert (opened, idle) == (1, 1)  # the cancelled connection no longer counts against the cap


def test_a_request_cancelled_while_waiting_for_a_connection_gives_up_its_place(run: Runner) -> None:
    def script(connection: int, number: int) -> list[bytes | str]:
        return [HANG] if connection == 0 else [ok()]

    async def scenario() -> tuple[int, int, int, int]:
        async with RawServer(script) as server:
            upstream = FastUpstream(max_connections_per_origin=1, pool_wait_s=5.0)
            try:
                busy = asyncio.ensure_future(upstream.get(server.url + "/slow", HEADERS))
                await wait_until(lambda: len(server.requests) == 1, message="the first request at the node")
                waiting = asyncio.ensure_future(upstream.get(server.url + "/k", HEADERS))
                pool = upstream._pools[server.url]
                await wait_until(lambda: len(pool.waiters) == 1, message="the second request waiting")
                waiting.cancel()
                busy.cancel()
                for task in (waiting, busy):
                    with pytest.raises(asyncio.CancelledError):
                        await task
                status = (await upstream.get(server.url + "/k", HEADERS)).status
                return status, pool.opened, len(pool.waiters), server.accepted
            finally:
                await upstream.aclose()

    status, opened, waiters, accepted = run(scenario)
    assert status == 200
    assert (opened, waiters, accepted) == (1, 0, 2)


def test_connection_close_is_honoured_even_when_the_node_keeps_the_socket_open(run: Runner) -> None:
    async def scenario() -> tuple[list[int], int]:
        async with RawServer(lambda connection, number: [ok(extra="connection: close\r\n")]) as server:
            upstream = FastUpstream()
            try:
                statuses = [(await upstream.get(server.url + "/k", HEADERS)).status for _ in range(3)]
                await wait_until(lambda: server.open == 0, message="the client closed every connection")
            finally:
                await upstream.aclose()
            return statuses, server.accepted

    statuses, accepted = run(scenario)
    assert statuses == [200, 200, 200]
    assert accepted == 3


def test_a_connection_that_sent_bytes_nobody_asked_for_is_not_reused(run: Runner) -> None:
    def script(connection: int, number: int) -> list[bytes | str]:
        return [ok(b"first") + ok(b"unasked")]

    async def scenario() -> tuple[list[bytes], int]:
        async with RawServer(script) as server:
            upstream = FastUpstream()
            try:
                bodies = [(await upstream.get(server.url + "/k", HEADERS)).body for _ in range(2)]
            finally:
                await upstream.aclose()
            return bodies, server.accepted

    bodies, accepted = run(scenario)
    assert bodies == [b"first", b"first"]
    assert accepted == 2


def test_idle_connections_expire(run: Runner) -> None:
    async def scenario() -> int:
        async with RawServer(lambda connection, number: [ok()]) as server:
            upstream = FastUpstream(idle_expiry_s=0.05)
            try:
                assert (await upstream.get(server.url + "/k", HEADERS)).status == 200
                await wait_until(lambda: server.open == 0, message="the idle connection expired and closed")
                assert (await upstream.get(server.url + "/k", HEADERS)).status == 200
            finally:
                await upstream.aclose()
            return server.accepted

    assert run(scenario) == 2


def test_aclose_closes_every_connection_and_later_requests_are_refused(run: Runner) -> None:
    async def scenario() -> tuple[int, UpstreamUnavailable]:
        async with RawServer(lambda connection, number: [ok()]) as server:
            upstream = FastUpstream()
            answers = await asyncio.gather(*(upstream.get(server.url + "/k", HEADERS) for _ in range(8)))
            assert {a.status for a in answers} == {200}
            opened = server.accepted
            await upstream.aclose()
            await wait_until(lambda: server.open == 0, message="every connection closed")
            with pytest.raises(UpstreamUnavailable) as caught:
                await upstream.get(server.url + "/k", HEADERS)
            return opened, caught.value

    opened, error = run(scenario)
    assert opened > 1
    assert error.node_fault is False


def test_a_request_in_flight_when_the_client_closes_is_not_blamed_on_the_node(run: Runner) -> None:
    async def scenario() -> UpstreamUnavailable:
        async with RawServer(lambda connection, number: [HANG]) as server:
            upstream = FastUpstream()
            pending = asyncio.ensure_future(upstream.get(server.url + "/k", HEADERS))
            await wait_until(lambda: len(server.requests) == 1, message="the request at the node")
            await upstream.aclose()
            with pytest.raises(UpstreamUnavailable) as caught:
                await pending
            return caught.value

    assert run(scenario).node_fault is False


# -- framing oddities a node should not send, but which must still be read right --------------------------


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end", b"until the end"),
        (b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"after continue"), b"after continue"),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nx-t: 1\r\n\r\n",
            b"abcde",
        ),
    ],
    ids=["until-eof", "informational-first", "chunk-extensions-and-trailer"],
)
def test_unusual_framing_is_read_whole(run: Runner, answer: bytes, body: bytes) -> None:
    async def scenario() -> UpstreamResponse:
        async with RawServer(lambda connection, number: [answer, CLOSE]) as server:
            upstream = FastUpstream()
            try:
                return await upstream.get(server.url + "/k", HEADERS)
            finally:
                await upstream.aclose()

    got = run(scenario)
    assert (got.status, got.body) == (200, body)


def test_header_names_come_lower_cased_in_order_however_many_distinct_ones_a_node_sends(run: Runner) -> None:
    # Lower-cased names are remembered per spelling up to a bound: well past it (600 spellings over two
    # answers), every name still comes lower-cased, and the framing headers are still recognised in any case.
    spellings = [f"X-Name-{i}" if i % 2 else f"x-NAME-{i}" for i in range(300)]

    def answer(number: int) -> bytes:
        lines = "".join(f"{name}{number}: v{i}\r\n" for i, name in enumerate(spellings))
        return f"HTTP/1.1 200 OK\r\n{lines}CONTENT-Length: 4\r\nContent-ENCODING: identity\r\n\r\nbody".encode()

    async def scenario() -> list[UpstreamResponse]:
        async with RawServer(lambda connection, number: [answer(number)]) as server:
            upstream = FastUpstream()
            try:
                return [await upstream.get(server.url + "/k", HEADERS) for _ in range(2)]
            finally:
                await upstream.aclose()

    for number, got in enumerate(run(scenario)):
        expected = [(f"{name}{number}".lower().encode(), f"v{i}".encode()) for i, name in enumerate(spellings)]
        assert (got.status, got.body) == (200, b"body")
        assert list(got.headers) == [*expected, (b"content-length", b"4"), (b"content-encoding", b"identity")]


@pytest.mark.parametrize("name", ["content-encoding", "Content-Encoding", "CONTENT-ENCODING"])
def test_a_gzip_body_sent_despite_identity_is_decoded_as_httpx_would(run: Runner, name: str) -> None:
    # Header names are case-insensitive: the coding is recognised however the node spells its name.
    packed = gzip.compress(b'{"value": 1}')
    answer = ok(packed, extra=f"{name}: gzip\r\n")

    async def scenario() -> UpstreamResponse:
        async with RawServer(lambda connection, number: [answer]) as server:
            upstream = FastUpstream()
            try:
                return await upstream.get(server.url + "/k", HEADERS)
            finally:
                await upstream.aclose()

    got = run(scenario)
    assert got.body == b'{"value": 1}'
    assert got.header(b"content-encoding") is None


def test_the_request_head_is_exactly_what_we_mean(run: Runner) -> None:
    async def scenario() -> bytes:
        async with RawServer(lambda connection, number: [ok()]) as server:
            upstream = FastUpstream()
            try:
                await upstream.get(server.url + "/stores/s/keys/a%2Fb?x=1#fragment", {"X-Request-ID": "r1"})
            finally:
                await upstream.aclose()
            return server.requests[0][1]

    head = run(scenario)
    host = head.split(b"host: ", 1)[1].split(b"\r\n", 1)[0]
    assert head == (
        b"GET /stores/s/keys/a%2Fb?x=1 HTTP/1.1\r\nhost: " + host + b"\r\n"
        b"X-Request-ID: r1\r\naccept-encoding: identity\r\n\r\n"
    )


def test_each_request_carries_its_own_request_id_while_the_other_headers_are_encoded_once(run: Runner) -> None:
    async def scenario() -> tuple[list[bytes], int]:
        async with RawServer(lambda connection, number: [ok(), ok(), ok()]) as server:
            upstream = FastUpstream()
            try:
                for request_id in ("r1", "r2", "r3"):
                    await upstream.get(server.url + "/k", {"x-keyroute-router": "1", "x-request-id": request_id})
            finally:
                await upstream.aclose()
            return [head for _, head in server.requests], len(upstream._blocks)

    heads, blocks = run(scenario)
    assert [h.split(b"x-request-id: ", 1)[1].split(b"\r\n", 1)[0] for h in heads] == [b"r1", b"r2", b"r3"]
    assert all(h.count(b"x-keyroute-router: 1\r\n") == 1 for h in heads)
    assert blocks == 1


@pytest.mark.parametrize(
    ("url", "headers"),
    [
        ("https://127.0.0.1:1/k", {}),
        ("ftp://127.0.0.1:1/k", {}),
        ("127.0.0.1:1/k", {}),
        ("http://user:secret@127.0.0.1:1/k", {}),
        ("http://127.0.0.1:1/a b", {}),
        ("http://127.0.0.1:1/ключ", {}),
        ("http://127.0.0.1:1/k", {"x-id": "a\r\nx-injected: 1"}),
        ("http://127.0.0.1:1/k", {"x-request-id": "a\r\nx-injected: 1"}),
        ("http://127.0.0.1:1/k", {"bad name": "v"}),
    ],
)
def test_what_cannot_be_sent_as_is_is_a_value_error(run: Runner, url: str, headers: dict[str, str]) -> None:
    async def scenario() -> None:
        upstream = FastUpstream()
        try:
            with pytest.raises(ValueError):
                await upstream.get(url, headers)
        finally:
            await upstream.aclose()

    run(scenario)


# -- get_now: an exchange without a coroutine, on an idle connection ---------------------------------------

HEAD_LINES = b"x-keyroute-router: 1\r\naccept-encoding: identity\r\n"


async def get_now(upstream: FastUpstream, url: str) -> UpstreamResponse | Exception | None:
    """What `get_now` hands its callback, or None when it declined (nothing sent)."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[UpstreamResponse | Exception] = loop.create_future()
    if not upstream.get_now(url, HEAD_LINES, answer.set_result):
        return None
    assert not answer.done(), "the callback must never run before get_now returns"
    return await asyncio.wait_for(answer, 10)


def test_get_now_declines_without_an_idle_connection_and_then_uses_the_one_get_left(
    run: Runner, app_server: AppServer
) -> None:
    async def scenario() -> tuple[object, list[object], list[int]]:
        upstream = FastUpstream()
        try:
            before = len(app_server.client_ports)
            declined = await get_now(upstream, app_server.url + "/json")  # no connection yet
            await upstream.get(app_server.url + "/json", HEADERS)
            answers = [await get_now(upstream, app_server.url + f"/status/{code}") for code in (200, 404, 503)]
            answers.append(await get_now(upstream, app_server.url + "/json"))
            return declined, answers, app_server.client_ports[before:]
        finally:
            await upstream.aclose()

    declined, answers, ports = run(scenario)
    assert declined is None
    assert [a.status for a in answers] == [200, 404, 503, 200]  # type: ignore[union-attr]
    assert all(isinstance(a, UpstreamResponse) for a in answers)
    assert answers[1].header(b"x-multi") == b"one" and answers[1].body == b"status body"  # type: ignore[union-attr]
    assert len(set(ports)) == 1  # every exchange on the connection `get` opened


def test_get_now_at_sends_the_target_to_the_origin_as_get_now_and_declines_an_origin_spelt_otherwise(
    run: Runner,
) -> None:
    async def scenario() -> tuple[list[object], list[tuple[int, bytes]]]:
        async with RawServer(lambda connection, number: [ok(f"answer {number}".encode())]) as server:
            upstream = FastUpstream()
            loop = asyncio.get_running_loop()
            got: list[object] = []
            try:
                # No connection to the origin yet: declined, nothing sent.
                got.append(upstream.get_now_at(server.url, "/stores/s/keys/a", HEAD_LINES, got.append))
                await upstream.get(server.url + "/first", HEADERS)
                # Not spelt as the pool names the origin (a path after the port, an upper-case scheme): declined.
                for origin in (server.url + "/", server.url.replace("http", "HTTP")):
                    got.append(upstream.get_now_at(origin, "/stores/s/keys/a", HEAD_LINES, got.append))
                answer: asyncio.Future[object] = loop.create_future()
                sent = upstream.get_now_at(server.url, "/stores/s/keys/a%2Fb", HEAD_LINES, answer.set_result)
                assert sent is not None and not answer.done()
                got.append(await asyncio.wait_for(answer, 10))
            finally:
                await upstream.aclose()
            return got, server.requests

    got, requests = run(scenario)
    assert got[:3] == [None, None, None]
    assert isinstance(got[3], UpstreamResponse) and got[3].body == b"answer 1"
    assert [connection for connection, _ in requests] == [0, 0]  # on the connection `get` opened
    head_line, _, rest = requests[1][1].partition(b"\r\n")
    assert head_line == b"GET /stores/s/keys/a%2Fb HTTP/1.1"
    assert rest.split(b"\r\n", 1)[1] == HEAD_LINES + b"\r\n"


def test_get_now_sends_the_head_it_is_given(run: Runner) -> None:
    async def scenario() -> bytes:
        async with RawServer(lambda connection, number: [ok()]) as server:
            upstream = FastUpstream()
            try:
                await upstream.get(server.url + "/first", HEADERS)
                answer = await get_now(upstream, server.url + "/stores/s/keys/a%2Fb")
                assert isinstance(answer, UpstreamResponse) and answer.body == b"hello"
            finally:
                await upstream.aclose()
            return server.requests[1][1]

    head_line, _, rest = run(scenario).partition(b"\r\n")
    assert head_line == b"GET /stores/s/keys/a%2Fb HTTP/1.1"
    assert rest.split(b"\r\n", 1)[1] == HEAD_LINES + b"\r\n"  # after the host line: exactly our lines


def test_get_now_reports_a_connection_the_node_closed_while_idle_as_stale(run: Runner) -> None:
    from keyroute.http.fast_upstream import StaleConnection

    # Every connection answers its first request and closes on its second, without a byte of answer.
    def script(connection: int, number: int) -> list[bytes | str]:
        return [ok()] if number == 0 else [CLOSE]

    async def scenario() -> object:
        async with RawServer(script) as server:
            upstream = FastUpstream()
            try:
                await upstream.get(server.url + "/k", HEADERS)
                return await get_now(upstream, server.url + "/k")
            finally:
                await upstream.aclose()

    answer = run(scenario)
    assert isinstance(answer, StaleConnection) and answer.node_fault is True


@pytest.mark.parametrize("trouble", ["mid-body", "malformed", "hang"])
def test_get_now_reports_a_node_failing_mid_answer_as_unavailable_and_drops_the_connection(
    run: Runner, trouble: str
) -> None:
    from keyroute.http.fast_upstream import StaleConnection

    actions: dict[str, list[bytes | str]] = {
        "mid-body": [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten..", CLOSE],
        "malformed": [b"HTTP/1.1 OK\r\nnonsense\r\n\r\n"],
        "hang": [HANG],
    }

    def script(connection: int, number: int) -> list[bytes | str]:
        return [ok()] if number == 0 else actions[trouble]

    async def scenario() -> tuple[object, float]:
        async with RawServer(script) as server:
            upstream = FastUpstream(timeout_s=0.3)
            try:
                await upstream.get(server.url + "/k", HEADERS)
                loop = asyncio.get_running_loop()
                started = loop.time()
                answer = await get_now(upstream, server.url + "/k")
                took = loop.time() - started
                await wait_until(lambda: server.open == 0, message="the failed connection closed")
                # Nothing idle is left: the next exchange needs `get` and a new connection.
                assert await get_now(upstream, server.url + "/k") is None
                return answer, took
            finally:
                await upstream.aclose()

    answer, took = run(scenario)
    assert isinstance(answer, UpstreamUnavailable) and not isinstance(answer, StaleConnection)
    assert answer.node_fault is True
    if trouble == "hang":
        # Ended by its deadline, and not before it.
        assert "no complete reply within 0.3s" in str(answer)
        assert took >= 0.3 - 0.002


def test_get_now_in_flight_when_the_client_closes_is_not_blamed_on_the_node(run: Runner) -> None:
    async def scenario() -> object:
        def script(connection: int, number: int) -> list[bytes | str]:
            return [ok()] if number == 0 else [HANG]

        async with RawServer(script) as server:
            upstream = FastUpstream()
            loop = asyncio.get_running_loop()
            answer: asyncio.Future[object] = loop.create_future()
            await upstream.get(server.url + "/k", HEADERS)
            assert upstream.get_now(server.url + "/k", HEAD_LINES, answer.set_result)
            await wait_until(lambda: len(server.requests) == 2, message="the request at the node")
            await upstream.aclose()
            return await asyncio.wait_for(answer, 10)

    answer = run(scenario)
    assert isinstance(answer, UpstreamUnavailable) and answer.node_fault is False


def test_get_now_declines_what_needs_the_careful_path(run: Runner, app_server: AppServer) -> None:
    async def scenario() -> list[object]:
        upstream = FastUpstream()
        try:
            await upstream.get(app_server.url + "/json", HEADERS)
            unusual = [
                "https://127.0.0.1/json",  # not http://
                app_server.url + "/with space",
                app_server.url + "/caf\u00e9",
                "http://127.0.0.1:1/json",  # an origin without a pool
            ]
            return [await get_now(upstream, url) for url in unusual]
        finally:
            await upstream.aclose()

    assert run(scenario) == [None, None, None, None]
