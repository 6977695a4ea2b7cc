"""keyroute.http.server: refusals counted and reported, a graceful stop, a server on a thread, and `run` (on
request, on SIGTERM, after a failed start)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette

from keyroute.http import HttpServer, ServerLimits, run
from keyroute.runtime.metrics import SERVER_REFUSALS
from tests.unit.http.harness import (
    IO_TIMEOUT_S,
    Plane,
    PrefixPlane,
    closed_by_server,
    connect,
    exchange,
    get,
    read_answer,
    starlette_app,
)
from tests.util import serve_in_thread, wait_for, wait_until

# -- refusals: counted, and reported to on_refusal ---------------------------------------------------------


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

    with caplog.at_level(logging.ERROR, logger="keyroute.http.protocol"):
        arun(scenario())
    assert any(
        r.name == "keyroute.http.protocol" and r.exc_info and "cannot count headers_too_large" in str(r.exc_info[1])
        for r in caplog.records
    )


# -- stop --------------------------------------------------------------------------------------------------


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


# -- a server on a thread, run() ---------------------------------------------------------------------------


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


def first_answer(port: int, path: str) -> bytes:
    """The start of the answer to GET `path` on `port` (ConnectionError while nothing listens there yet)."""
    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
        sock.sendall(get(path, "Connection: close"))
        return sock.recv(65536)


def test_run_stops_cleanly_on_request_and_reports_a_failed_start() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = HttpServer(starlette_app())
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run(server, "127.0.0.1", 0, sockets=[listener])))
    thread.start()
    try:
        answer = wait_for(lambda: first_answer(port, "/hello"), timeout_s=10, message="run() serving")
        assert answer.startswith(b"HTTP/1.1 200 OK")
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
        answer = wait_for(lambda: first_answer(port, "/nothing"), timeout_s=10, message="the server serving")
        assert answer.startswith(b"HTTP/1.1 404 ")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "shutdown ran" in out


# -- an admin port: the admin paths there only, the data plane on the data port only -------------------------


@pytest.mark.parametrize("plane_class", [Plane, PrefixPlane])
def test_an_admin_port_serves_the_admin_paths_and_the_data_port_refers_to_it(
    arun: Any, plane_class: type[Plane]
) -> None:
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def text(request: Any) -> Any:
        return PlainTextResponse(request.url.path)

    app = Starlette(routes=[Route(path, text) for path in ("/admin/partition-map", "/metrics", "/healthz")])

    async def scenario() -> None:
        plane = plane_class()
        server = HttpServer(app, data_plane=lambda state: plane, error_headers=[(b"x-keyroute-node", b"n1")])
        await server.start(port=0, admin_port=0)
        try:
            admin = server.admin_port
            assert admin is not None and admin != server.port
            for path in ("/admin/partition-map", "/metrics", "/healthz"):
                answer = await exchange(admin, get(path))
                assert (answer.status, answer.body) == (200, path.encode()), path
            # The data plane is the data port's: the admin port has none.
            assert (await exchange(admin, get("/stores/x"))).status == 404
            assert (await exchange(server.port, get("/stores/x"))).status == 200
            assert (await exchange(server.port, get("/healthz"))).status == 200  # probes stay on the data port
            for path in ("/admin/partition-map", "/admin", "/metrics"):
                answer = await exchange(server.port, get(path))
                assert answer.status == 404, path
                assert answer.json()["error"] == "not_found"
                assert f"admin port ({admin})" in answer.json()["message"]
                assert answer.header("x-keyroute-node") == "n1"
            # Not an admin path, though it starts like one.
            assert (await exchange(server.port, get("/metricsfoo"))).status == 404
            assert "admin port" not in (await exchange(server.port, get("/metricsfoo"))).body.decode()
        finally:
            await server.stop()
        assert server.admin_port is None

    arun(scenario())


def test_without_an_admin_port_everything_stays_on_one_port(arun: Any) -> None:
    async def scenario() -> None:
        from starlette.responses import PlainTextResponse
        from starlette.routing import Route

        app = Starlette(routes=[Route("/metrics", lambda request: PlainTextResponse("m"))])
        server = HttpServer(app)
        await server.start(port=0)
        try:
            assert server.admin_port is None
            assert (await exchange(server.port, get("/metrics"))).status == 200
        finally:
            await server.stop()

    arun(scenario())


def test_a_taken_admin_port_fails_the_start_and_frees_the_data_port(arun: Any) -> None:
    async def scenario() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            server = HttpServer(starlette_app())
            with pytest.raises(OSError):
                await server.start(port=0, admin_port=taken.getsockname()[1])
            assert server.admin_port is None
            # Nothing listens and a new start works.
            await server.start(port=0)
            await server.stop()

    arun(scenario())
