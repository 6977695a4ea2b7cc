"""keyroute.http.asgi over real sockets: the ASGI bridge's scope, receive and send, and an app's failures."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from tests.unit.http.harness import (
    IO_TIMEOUT_S,
    NEW_ID,
    Plane,
    asgi_app,
    connect,
    exchange,
    get,
    read_answer,
    serving,
)
from tests.util import wait_until


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
