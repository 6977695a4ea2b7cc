"""The coalescing HTTP protocol: writes of one event-loop step leave as one, and answers stay byte-correct."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from keyroute.core.http_server import CoalescingHttpToolsProtocol, CoalescingWrites

from tests.util import free_port, wait_for


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_writes_of_one_step_reach_the_transport_as_one_write_at_the_next_turn() -> None:
    async def scenario() -> None:
        real = RecordingTransport()
        writes = CoalescingWrites(real, asyncio.get_running_loop())  # type: ignore[arg-type]
        writes.write(b"HTTP/1.1 200 OK\r\n\r\n")
        writes.write(b"body")
        assert real.writes == []
        await asyncio.sleep(0)
        assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        writes.write(b"next")
        await asyncio.sleep(0)
        assert real.writes[1:] == [b"next"]

    asyncio.run(scenario())


def test_close_sends_what_is_pending_first_and_other_calls_reach_the_real_transport() -> None:
    async def scenario() -> None:
        real = RecordingTransport()
        writes = CoalescingWrites(real, asyncio.get_running_loop())  # type: ignore[arg-type]
        writes.write(b"last words")
        writes.close()
        assert real.writes == [b"last words"] and real.closed
        await asyncio.sleep(0)  # the scheduled flush finds nothing left to send
        assert real.writes == [b"last words"]
        assert writes.get_extra_info("peername") == "info:peername"

    asyncio.run(scenario())


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    path = scope["path"]
    if path == "/echo":  # reads the body first: a client sending `Expect: 100-continue` waits for the 100
        received = b""
        while True:
            message = await receive()
            received += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(received))]}
        )
        await send({"type": "http.response.body", "body": received})
        return
    if path == "/stream":  # no content-length: chunked, several body messages with awaits between them
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"one", b"two", b"three"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
            await asyncio.sleep(0.001)
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/fail-after-start":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        raise RuntimeError("the app broke off its answer")
    body = path.encode()
    headers = [(b"content-length", str(len(body)).encode())]
    if path == "/close":
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=CoalescingHttpToolsProtocol, log_level="warning", lifespan="on"
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_for(lambda: srv.started, 10, message="the server to start")
    yield port
    srv.should_exit = True
    thread.join(10)


def exchange(port: int, request: bytes, until: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        received = b""
        while not received.endswith(until):
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        return received


def test_keep_alive_answers_come_back_whole_and_in_order(server: int) -> None:
    requests = b"".join(f"GET /r{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for i in range(5))
    received = exchange(server, requests, b"/r4")
    answers = received.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert [a.rsplit(b"\r\n\r\n", 1)[1] for a in answers] == [f"/r{i}".encode() for i in range(5)]
    assert all(b"content-length: 3\r\n" in a for a in answers)


def test_a_chunked_stream_and_a_closing_answer_are_complete(server: int) -> None:
    streamed = exchange(server, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n", b"0\r\n\r\n")
    assert b"transfer-encoding: chunked" in streamed
    assert streamed.endswith(b"3\r\none\r\n3\r\ntwo\r\n5\r\nthree\r\n0\r\n\r\n")
    closed = exchange(server, b"GET /close HTTP/1.1\r\nHost: x\r\n\r\n", b"never")
    assert closed.endswith(b"\r\n\r\n/close")  # everything arrived before the server closed the connection


def test_a_head_answer_and_an_answer_the_app_broke_off_still_reach_the_client(server: int) -> None:
    head = exchange(server, b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\n", b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 2\r\n" in head
    broken = exchange(server, b"GET /fail-after-start HTTP/1.1\r\nHost: x\r\n\r\n", b"never")
    assert broken.startswith(b"HTTP/1.1 200 OK\r\n")  # the head was sent, then the connection closed


def test_a_client_expecting_100_continue_gets_it_before_sending_its_body(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server), timeout=5) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\ncontent-length: 4\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(b"data")
        received = b""
        while not received.endswith(b"data"):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        assert received.startswith(b"HTTP/1.1 200 OK\r\n")
