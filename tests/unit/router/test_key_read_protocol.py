"""KeyReadProtocol on a real uvicorn server (127.0.0.1, raw sockets): key reads are answered by the protocol,
with uvicorn's connection semantics intact (keep-alive, pipelining in order, HTTP/1.0, HEAD), the admission
checks applied on the same counters as the ASGI guard, and anything that is not a key read answered by the
application. The proxy behind it is a stand-in (this is about the HTTP side, not routing)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from keyroute.core.api import KeyNotFound
from keyroute.core.http_server import CoalescingHttpToolsProtocol
from keyroute.core.request_guard import Admission
from keyroute.router.fast_path import KeyReadProtocol, key_read_protocol
from keyroute.router.metrics import RouterMetrics
from keyroute.router.upstream import UpstreamResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.util import uvicorn_in_thread, wait_for


@dataclass
class StandInProxy:
    """Answers every key with its own name; `absent` and `refuse` are not found, `explode` raises an
    unexpected error, `slow-*` waits for `release`. Both ways in: `get` (a coroutine) and `read` (a callback,
    with the errors known at once raised at once, as `Proxy.read` does)."""

    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    release: threading.Event = field(default_factory=threading.Event)
    waiting: int = 0
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def read(self, store: str, key: str, request_id: str, on_answer: Callable[[Any], None]) -> None:
        if key == "absent":
            raise KeyNotFound(f"key {key!r} is not in store {store!r}")

        def done(task: asyncio.Task[UpstreamResponse]) -> None:
            self.tasks.discard(task)
            on_answer(task.exception() or task.result())

        task = asyncio.get_running_loop().create_task(self.get(store, key, request_id))
        self.tasks.add(task)
        task.add_done_callback(done)

    async def get(self, store: str, key: str, request_id: str) -> UpstreamResponse:
        if key in ("absent", "refuse"):
            raise KeyNotFound(f"key {key!r} is not in store {store!r}")
        if key == "explode":
            raise RuntimeError("a bug in an answer")
        if key.startswith("slow-"):
            self.waiting += 1
            while not self.release.is_set():
                await asyncio.sleep(0.005)
        body = json.dumps({"store": store, "key": key, "value": {"v": key}}).encode()
        headers = [(b"content-type", b"application/json"), (b"x-keyroute-node", b"n1"), (b"x-request-id", b"ignored")]
        # The node echoes the id it was sent: the stand-in does the same.
        headers[-1] = (b"x-request-id", request_id.encode())
        return UpstreamResponse(200, headers, body)


@dataclass
class Served:
    port: int
    proxy: StandInProxy
    admission: Admission
    by_protocol: list[str]

    def exchange(self, raw: bytes, timeout_s: float = 10.0) -> bytes:
        """Send `raw` on a fresh connection; everything the server sends until it closes."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as sock:
            sock.sendall(raw)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


def parse_responses(data: bytes, head_requests: set[int] = frozenset()) -> list[tuple[int, dict[str, str], bytes]]:
    """Responses one after another in `data`; the ones at `head_requests` indexes carry no body."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            assert name.lower() not in headers, f"header {name} twice"
            headers[name.lower()] = value.strip()
        length = 0 if len(out) in head_requests else int(headers["content-length"])
        out.append((status, headers, data[:length]))
        data = data[length:]
    return out


def read_one(sock: socket.socket) -> bytes:
    """One whole response (with a content-length) from a connection that stays open."""
    data = b""
    while True:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            if len(rest) >= length:
                return data
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    options = getattr(request, "param", {})  # more uvicorn.Config options, by indirect parametrization
    proxy = StandInProxy()
    admission = Admission(max_concurrent_requests=2, retry_after_s=3)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def not_found(request: Request) -> Response:
        return JSONResponse({"error": "not_found", "message": request.url.path}, status_code=404)

    app = Starlette(routes=[Route("/healthz", healthz), Route("/{rest:path}", not_found)])
    app.state.proxy = proxy
    app.state.admission = admission
    proxy.metrics.admission = admission
    by_protocol: list[str] = []

    class Spy(key_read_protocol(app, 64, CoalescingHttpToolsProtocol)):  # type: ignore[misc]
        def express(self, cycle: Any, raw_path: bytes, target_bytes: int, headers: Any) -> Any:
            by_protocol.append(f"express {raw_path.decode()}")
            return super().express(cycle, raw_path, target_bytes, headers)

        async def _serve(self, cycle: Any, app: Any, raw: bytes) -> None:
            by_protocol.append(f"task {raw.decode()}")
            await super()._serve(cycle, app, raw)

    with uvicorn_in_thread(app, Spy, **options) as port:
        try:
            yield Served(port, proxy, admission, by_protocol)
        finally:
            proxy.release.set()


def test_pipelined_requests_are_answered_in_order_by_the_protocol_or_the_application(served: Served) -> None:
    raw = (
        b"GET /stores/s/keys/k1 HTTP/1.1\r\nHost: x\r\nX-Request-ID: mine-1\r\n\r\n"
        b"HEAD /stores/s/keys/k2 HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /stores/s/deeper/keys/k3 HTTP/1.1\r\nHost: x\r\n\r\n"  # looks like one, is not a key path
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /stores/s/keys/absent HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /stores/s/keys/k%2F4?q=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    responses = parse_responses(served.exchange(raw), head_requests={1})
    assert [status for status, _, _ in responses] == [200, 200, 404, 200, 404, 200]
    (_, h1, b1), (_, h2, b2), (_, _, b3), (_, _, b4), (_, h5, b5), (_, h6, b6) = responses
    assert json.loads(b1)["key"] == "k1" and h1["x-request-id"] == "mine-1" and h1["x-keyroute-node"] == "n1"
    assert int(h1["content-length"]) == len(b1) and "date" in h1 and "connection" not in h1
    # HEAD: the length of the answer a GET would get, and no body (the next response follows at once).
    assert b2 == b"" and int(h2["content-length"]) == len(json.dumps({"store": "s", "key": "k2", "value": {"v": "k2"}}))
    assert json.loads(b3) == {"error": "not_found", "message": "/stores/s/deeper/keys/k3"}
    assert json.loads(b4) == {"status": "ok"}
    assert json.loads(b5)["error"] == "key_not_found" and h5["content-type"] == "application/json"
    assert h5["x-request-id"]
    assert json.loads(b6)["key"] == "k/4" and h6["connection"] == "close"
    # The first is answered the express way; the others wait behind it, so go the way of uvicorn's cycle.
    assert served.by_protocol == [
        "express /stores/s/keys/k1",
        "task /stores/s/keys/k2",
        "task /stores/s/deeper/keys/k3",
        "task /stores/s/keys/absent",
        "task /stores/s/keys/k%2F4",
    ]
    assert served.admission.active == 0


def test_an_answer_that_fails_is_a_json_error_and_the_connection_goes_on(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    raw = (
        b"GET /stores/s/keys/explode HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /stores/s/keys/refuse HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /stores/s/keys/k1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    (s1, h1, b1), (s2, _, b2), (s3, _, b3) = parse_responses(served.exchange(raw))
    assert (s1, json.loads(b1)) == (500, {"error": "internal_error", "message": "internal error"})
    assert h1["x-request-id"] and b"Traceback" not in b1
    assert (s2, json.loads(b2)["error"]) == (404, "key_not_found")
    assert s3 == 200 and json.loads(b3)["key"] == "k1"
    assert served.admission.active == 0
    assert any("a bug in an answer" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


def test_http_1_0_gets_its_answer_and_the_connection_closed(served: Served) -> None:
    responses = parse_responses(served.exchange(b"GET /stores/s/keys/k1 HTTP/1.0\r\n\r\n"))
    assert len(responses) == 1
    status, headers, body = responses[0]
    assert status == 200 and headers["connection"] == "close" and json.loads(body)["key"] == "k1"


def test_a_keep_alive_connection_serves_request_after_request(served: Served) -> None:
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        for i in range(20):
            sock.sendall(f"GET /stores/s/keys/k{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            ((status, _, body),) = parse_responses(read_one(sock))
            assert status == 200 and json.loads(body)["key"] == f"k{i}"
    assert len(served.by_protocol) == 20


def test_admission_refuses_beyond_the_limit_with_the_apis_error_and_counts_it(served: Served) -> None:
    slow = [socket.create_connection(("127.0.0.1", served.port), timeout=10) for _ in range(2)]
    try:
        for i, sock in enumerate(slow):
            sock.sendall(f"GET /stores/s/keys/slow-{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        wait_for(lambda: served.proxy.waiting == 2, timeout_s=10, message="two reads in progress")
        assert served.admission.active == 2
        raw = b"GET /stores/s/keys/k1 HTTP/1.1\r\nHost: x\r\nX-Request-ID: over-1\r\nConnection: close\r\n\r\n"
        ((status, headers, body),) = parse_responses(served.exchange(raw))
        assert status == 503 and headers["retry-after"] == "3" and headers["x-request-id"] == "over-1"
        assert json.loads(body)["error"] == "overloaded"
        assert served.admission.overloaded == 1
        assert 'keyroute_router_refused_requests_total{reason="overloaded"} 1.0' in served.proxy.metrics.render()
    finally:
        served.proxy.release.set()
        for sock in slow:
            sock.close()
    wait_for(lambda: served.admission.active == 0, timeout_s=10, message="the slow reads to finish")


def test_a_client_gone_mid_read_leaves_the_server_answering(served: Served) -> None:
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
    sock.sendall(b"GET /stores/s/keys/slow-gone HTTP/1.1\r\nHost: x\r\n\r\n")
    wait_for(lambda: served.proxy.waiting == 1, timeout_s=10, message="the read in progress")
    sock.close()
    served.proxy.release.set()
    wait_for(lambda: served.admission.active == 0, timeout_s=10, message="the read to end")
    ((status, _, body),) = parse_responses(
        served.exchange(b"GET /stores/s/keys/k9 HTTP/1.1\r\nConnection: close\r\n\r\n")
    )
    assert status == 200 and json.loads(body)["key"] == "k9"


def test_the_protocol_is_uvicorns_httptools_protocol_underneath() -> None:
    # It hooks uvicorn's private `_start_asgi_task`: an upgrade of uvicorn that renames it must fail here.
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert callable(HttpToolsProtocol._start_asgi_task)
    assert issubclass(KeyReadProtocol, HttpToolsProtocol)


@pytest.mark.parametrize("served", [{"timeout_keep_alive": 1}], indirect=True)
def test_an_idle_keep_alive_connection_is_closed_a_whole_timeout_after_its_last_answer(served: Served) -> None:
    def still_open_after(seconds: float) -> None:
        sock.settimeout(seconds)
        with pytest.raises(TimeoutError):
            sock.recv(1)

    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        for path in ("/stores/s/keys/k1", "/healthz"):  # answered by the protocol, then by the application
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            ((status, _, _),) = parse_responses(read_one(sock))
            assert status == 200
            still_open_after(0.6)  # well within the timeout
        # A read still in progress when the timeout since the last answer has passed keeps the connection.
        sock.sendall(b"GET /stores/s/keys/slow-1 HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_for(lambda: served.proxy.waiting == 1, timeout_s=10, message="the slow read in progress")
        still_open_after(1.2)
        served.proxy.release.set()
        sock.settimeout(10)
        ((status, _, _),) = parse_responses(read_one(sock))
        answered = time.monotonic()
        assert status == 200
        assert sock.recv(1) == b""  # then closed by the server, a whole timeout after that answer
        idle = time.monotonic() - answered
    assert 0.9 <= idle < 3.0
