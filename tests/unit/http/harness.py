"""What the tests of keyroute.http's server share: a raw HTTP/1.1 client over asyncio streams, a data plane and
a Starlette app to serve, and a server under test on 127.0.0.1 (port 0)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import re
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from keyroute.http import Exchange, HttpServer, Request, ServerLimits
from keyroute.runtime.logs import new_request_id

# New request ids are keyroute.runtime.logs's: this process's prefix and a counter.
NEW_ID = re.compile(rf"^{re.escape(new_request_id().rpartition('-')[0])}-[0-9a-f]+$")
IO_TIMEOUT_S = 5.0


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


class Plane:
    """A data plane for /stores/: echoes what it got; /stores/hold is kept for the test to answer (its end, at
    its answer or when it is lost, recorded in `ended` by its `on_done`); /stores/boom raises; /stores/big
    answers `big` bytes."""

    def __init__(self) -> None:
        self.handled: list[Request] = []
        self.held: list[Exchange] = []
        self.ended: list[bytes] = []  # the raw paths of held exchanges, each time one ends
        self.big = b""

    def accepts(self, method: str, path: bytes) -> bool:
        return path.startswith(b"/stores/")

    def handle(self, exchange: Exchange) -> None:
        request = exchange.request
        self.handled.append(request)
        path = request.path
        if path.startswith(b"/stores/hold"):
            self.held.append(exchange)
            exchange.on_done(functools.partial(self.ended.append, path))
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


class PrefixPlane(Plane):
    """`Plane` that says its paths by `prefix`, as keyroute's data planes do: the server compares paths with it
    and never asks `accepts`."""

    prefix = b"/stores/"

    def accepts(self, method: str, path: bytes) -> bool:
        raise AssertionError("a data plane with a prefix is not asked whether it accepts a request")


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


def asgi_app(handler: Callable[[dict[str, Any], Any, Any], Coroutine[Any, Any, None]]) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return  # no lifespan support
        await handler(scope, receive, send)

    return app
