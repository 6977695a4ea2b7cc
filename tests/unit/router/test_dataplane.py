"""RouterDataPlane on keyroute's HTTP server (127.0.0.1, raw sockets): everything under /stores/ is answered by
the data plane, with the server's connection semantics intact (keep-alive, pipelining in order with the
app's answers, HTTP/1.0, HEAD), the admission checks applied on the same counters as the app's guard,
errors as the API's JSON, and everything else answered by the app. The proxy behind it is a stand-in (this
is about the HTTP side, not routing: tests/unit/router/test_app.py has the real proxy)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from keyroute.api import MAX_JSON_DEPTH, KeyNotFound, json_depth
from keyroute.http.admission import Admission
from keyroute.http.exchange import Exchange, ServerLimits
from keyroute.http.forwarding import OffsetBounds
from keyroute.http.server import HttpServer
from keyroute.http.upstream import UpstreamResponse
from keyroute.router.dataplane import RouterDataPlane
from keyroute.router.metrics import RouterMetrics
from tests.request_bodies import DEEP_BODIES, bodies
from tests.util import serve_in_thread, wait_for


@dataclass
class StandInProxy:
    """Reads every key as its own name; `absent` is not found at once (raised by `read`, as `Proxy.read`
    raises what is wrong before a node is asked), `refuse` not found later, `explode` fails unexpectedly,
    `slow-*` waits for `release`. Results are delivered from a task, later, as `Proxy.read` delivers them."""

    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    release: threading.Event = field(default_factory=threading.Event)
    waiting: int = 0
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    batches: list[tuple[str, list[Any], OffsetBounds | None]] = field(default_factory=list)

    async def batch_get(
        self, store: str, keys: list[Any], request_id: str, bounds: OffsetBounds | None = None
    ) -> list[dict[str, Any]]:
        """Every key found, as its own name; the batch and its bounds recorded."""
        self.batches.append((store, list(keys), bounds))
        return [{"key": key, "status": 200, "partition": 0, "version": 1, "value": {"v": key}} for key in keys]

    def read(self, store: str, key: str, request_id: str, on_result: Callable[[Any], None]) -> None:
        if key == "absent":
            raise KeyNotFound(f"key {key!r} is not in store {store!r}")

        def done(task: asyncio.Task[UpstreamResponse]) -> None:
            self.tasks.discard(task)
            on_result(task.exception() or task.result())

        task = asyncio.get_running_loop().create_task(self._reply(store, key, request_id))
        self.tasks.add(task)
        task.add_done_callback(done)

    async def _reply(self, store: str, key: str, request_id: str) -> UpstreamResponse:
        if key == "refuse":
            raise KeyNotFound(f"key {key!r} is not in store {store!r}")
        if key == "explode":
            raise RuntimeError("a bug in an answer")
        if key.startswith("slow-"):
            self.waiting += 1
            while not self.release.is_set():
                await asyncio.sleep(0.005)
        body = json.dumps({"store": store, "key": key, "value": {"v": key}}).encode()
        # The node echoes the id it was sent: the stand-in does the same.
        headers = [(b"content-type", b"application/json"), (b"x-keyroute-node", b"n1"), (b"x-request-id", b"")]
        headers[-1] = (b"x-request-id", request_id.encode())
        return UpstreamResponse(200, headers, body)


@dataclass
class Served:
    port: int
    proxy: StandInProxy
    admission: Admission
    by_data_plane: list[str]

    def exchange(self, raw: bytes, timeout_s: float = 10.0) -> bytes:
        """Send `raw` on a fresh connection; everything the server sends until it closes."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as sock:
            sock.sendall(raw)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


def parse_answers(data: bytes, head_requests: frozenset[int] = frozenset()) -> list[tuple[int, dict[str, str], bytes]]:
    """Answers one after another in `data`; the ones at `head_requests` indexes carry no body."""
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
    """One whole answer (with a content-length) from a connection that stays open."""
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
    limits = getattr(request, "param", ServerLimits())  # other server limits, by indirect parametrization
    proxy = StandInProxy()
    admission = Admission(max_concurrent_requests=2, retry_after_s=3)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[Route("/healthz", healthz)])
    app.state.proxy = proxy
    app.state.admission = admission
    proxy.metrics.admission = admission
    by_data_plane: list[str] = []

    class Spy(RouterDataPlane):
        def handle(self, exchange: Exchange) -> None:
            by_data_plane.append(f"{exchange.request.method} {exchange.request.path.decode()}")
            super().handle(exchange)

    server = HttpServer(app, limits, data_plane=lambda state: Spy(state.proxy, state.admission, 64))
    with serve_in_thread(server) as port:
        try:
            yield Served(port, proxy, admission, by_data_plane)
        finally:
            proxy.release.set()


def test_pipelined_requests_are_answered_in_order_by_the_data_plane_or_the_app(served: Served) -> None:
    # Pipelined data-plane requests are all in progress at once (their answers wait their turn).
    served.admission.max_concurrent_requests = 16
    raw = (
        b"GET /stores/s/keys/k1 HTTP/1.1\r\nHost: x\r\nX-Request-ID: mine-1\r\n\r\n"
        b"HEAD /stores/s/keys/k2 HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /stores/s/deeper/keys/k3 HTTP/1.1\r\nHost: x\r\n\r\n"  # looks like one, is not a key path
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /stores/s/keys/absent HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /stores/s/keys/k%2F4?q=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    answers = parse_answers(served.exchange(raw), head_requests=frozenset({1}))
    assert [status for status, _, _ in answers] == [200, 200, 404, 200, 404, 200]
    (_, h1, b1), (_, h2, b2), (_, h3, b3), (_, _, b4), (_, h5, b5), (_, h6, b6) = answers
    assert json.loads(b1)["key"] == "k1" and h1["x-request-id"] == "mine-1" and h1["x-keyroute-node"] == "n1"
    assert int(h1["content-length"]) == len(b1) and "date" in h1 and "connection" not in h1
    # HEAD: the length of the answer a GET would get, and no body (the next answer follows at once).
    assert b2 == b"" and int(h2["content-length"]) == len(json.dumps({"store": "s", "key": "k2", "value": {"v": "k2"}}))
    assert json.loads(b3) == {"error": "not_found", "message": "Not Found"} and h3["x-request-id"]
    assert json.loads(b4) == {"status": "ok"}
    assert json.loads(b5)["error"] == "key_not_found" and h5["content-type"] == "application/json"
    assert h5["x-request-id"]
    assert json.loads(b6)["key"] == "k/4" and h6["connection"] == "close"
    # Everything under /stores/ is the data plane's, pipelined or not; the probe is the app's.
    assert served.by_data_plane == [
        "GET /stores/s/keys/k1",
        "HEAD /stores/s/keys/k2",
        "GET /stores/s/deeper/keys/k3",
        "GET /stores/s/keys/absent",
        "GET /stores/s/keys/k%2F4",
    ]
    assert served.admission.active == 0
    assert served.proxy.metrics.requests.total("not_found") == 1  # the data plane's own 404 is not a read


def test_a_read_that_fails_is_a_json_error_and_the_connection_goes_on(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    served.admission.max_concurrent_requests = 16
    raw = (
        b"GET /stores/s/keys/explode HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /stores/s/keys/refuse HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /stores/s/keys/k1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    (s1, h1, b1), (s2, _, b2), (s3, _, b3) = parse_answers(served.exchange(raw))
    assert (s1, json.loads(b1)) == (500, {"error": "internal_error", "message": "internal error"})
    assert h1["x-request-id"] and b"Traceback" not in b1
    assert (s2, json.loads(b2)["error"]) == (404, "key_not_found")
    assert s3 == 200 and json.loads(b3)["key"] == "k1"
    assert served.admission.active == 0
    assert any("a bug in an answer" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


def test_other_paths_and_methods_under_stores_get_the_apis_404_and_405(served: Served) -> None:
    served.admission.max_concurrent_requests = 16
    raw = (
        b"GET /stores/s/keys/a/b HTTP/1.1\r\nHost: x\r\n\r\n"
        b"DELETE /stores/s/keys/k HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /stores/s/batch-get HTTP/1.1\r\nHost: x\r\n\r\n"
        b"PUT /stores/s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
        b"GET /stores/s/keys/%FF HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    answers = parse_answers(served.exchange(raw))
    assert [(status, json.loads(body)["error"]) for status, _, body in answers] == [
        (404, "not_found"),
        (405, "method_not_allowed"),
        (405, "method_not_allowed"),
        (404, "not_found"),
        (400, "bad_key"),
    ]
    assert "%2F" in json.loads(answers[0][2])["message"]
    assert answers[1][1]["allow"] == "GET, HEAD" and answers[2][1]["allow"] == "POST"
    assert all(headers["content-type"] == "application/json" for _, headers, _ in answers)
    assert served.admission.active == 0


def test_http_1_0_gets_its_answer_and_the_connection_closed(served: Served) -> None:
    answers = parse_answers(served.exchange(b"GET /stores/s/keys/k1 HTTP/1.0\r\n\r\n"))
    assert len(answers) == 1
    status, headers, body = answers[0]
    assert status == 200 and headers["connection"] == "close" and json.loads(body)["key"] == "k1"


def test_a_keep_alive_connection_serves_read_after_read(served: Served) -> None:
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        for i in range(20):
            sock.sendall(f"GET /stores/s/keys/k{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            ((status, _, body),) = parse_answers(read_one(sock))
            assert status == 200 and json.loads(body)["key"] == f"k{i}"
    assert len(served.by_data_plane) == 20


def test_admission_refuses_beyond_the_limit_with_the_apis_error_and_counts_it(served: Served) -> None:
    slow = [socket.create_connection(("127.0.0.1", served.port), timeout=10) for _ in range(2)]
    try:
        for i, sock in enumerate(slow):
            sock.sendall(f"GET /stores/s/keys/slow-{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        wait_for(lambda: served.proxy.waiting == 2, timeout_s=10, message="two reads in progress")
        assert served.admission.active == 2
        raw = b"GET /stores/s/keys/k1 HTTP/1.1\r\nHost: x\r\nX-Request-ID: over-1\r\nConnection: close\r\n\r\n"
        ((status, headers, body),) = parse_answers(served.exchange(raw))
        assert status == 503 and headers["retry-after"] == "3" and headers["x-request-id"] == "over-1"
        assert json.loads(body)["error"] == "overloaded"
        # A batch-get too, before its body is even looked at.
        raw = b"POST /stores/s/batch-get HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
        ((status, _, body),) = parse_answers(served.exchange(raw))
        assert status == 503 and json.loads(body)["error"] == "overloaded"
        assert served.admission.overloaded == 2
        assert 'keyroute_router_refused_requests_total{reason="overloaded"} 2.0' in served.proxy.metrics.render()
        # Probes still go through (to the app, past the limit).
        ((status, _, _),) = parse_answers(served.exchange(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"))
        assert status == 200
    finally:
        served.proxy.release.set()
        for sock in slow:
            sock.close()
    wait_for(lambda: served.admission.active == 0, timeout_s=10, message="the slow reads to end")


def test_a_client_gone_mid_read_leaves_the_server_answering(served: Served) -> None:
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
    sock.sendall(b"GET /stores/s/keys/slow-gone HTTP/1.1\r\nHost: x\r\n\r\n")
    wait_for(lambda: served.proxy.waiting == 1, timeout_s=10, message="the read in progress")
    sock.close()
    served.proxy.release.set()
    wait_for(lambda: served.admission.active == 0, timeout_s=10, message="the read to end")
    ((status, _, body),) = parse_answers(
        served.exchange(b"GET /stores/s/keys/k9 HTTP/1.1\r\nConnection: close\r\n\r\n")
    )
    assert status == 200 and json.loads(body)["key"] == "k9"


def test_a_batch_bound_written_as_an_integral_float_is_the_integer_and_a_fraction_is_refused(served: Served) -> None:
    # An outside fuzzer's find: the OpenAPI document says `integer`, and JSON Schema counts 14571.0 as one.
    def batch_get(bound: str) -> tuple[int, dict[str, str], bytes]:
        body = f'{{"keys": ["k1"], "min_offsets": {{"8525082": {bound}}}}}'.encode()
        raw = b"POST /stores/s/batch-get HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
        ((answer),) = parse_answers(served.exchange(raw % (len(body), body)))
        return answer

    status, _, body = batch_get("14571.0")
    assert status == 200 and [e["key"] for e in json.loads(body)["results"]] == ["k1"]
    assert served.proxy.batches == [("s", ["k1"], OffsetBounds(None, {8525082: 14571}))]
    assert batch_get("14571")[2] == body and served.proxy.batches[-1] == served.proxy.batches[0]
    status, headers, body = batch_get("14571.5")
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(body) == {
        "error": "bad_request",
        "message": "min_offsets[8525082] must be an offset: an integer from 0 to 9223372036854775807, got 14571.5",
    }
    assert len(served.proxy.batches) == 2  # refused before the proxy was asked
    assert served.admission.active == 0


def _as_written(text: str) -> int | float:
    try:
        number = Decimal(text)
    except ArithmeticError:  # an exponent past Decimal's reach: zero whatever it is, else a double
        return 0 if not text.lower().partition("e")[0].strip("-0.") else float(text)
    if number == number.to_integral_value() and number.adjusted() < 40:
        return int(number)
    return float(text)


def test_any_batch_body_reaches_the_proxy_as_json_gave_it_or_is_refused_with_a_4xx_json_error(served: Served) -> None:
    # An outside fuzzer's find: 100,000 nested `[` were a 500 and a RecursionError traceback in the log.
    raw = b"POST /stores/s/batch-get HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies(100))
    @example(DEEP_BODIES[0])
    @example(DEEP_BODIES[1])
    def check(body: bytes) -> None:
        asked = len(served.proxy.batches)
        ((status, headers, answer),) = parse_answers(served.exchange(raw % (len(body), body)))
        assert status in (200, 400) and headers["content-type"] == "application/json", answer[:300]
        if status == 400:
            assert json.loads(answer)["error"] == "bad_request" and len(served.proxy.batches) == asked
            if json_depth(body) > MAX_JSON_DEPTH:
                assert f"more than {MAX_JSON_DEPTH} deep" in json.loads(answer)["message"]
            return
        # The proxy got the keys as written: integral numbers as the exact ints they spell (6.9e+16 is
        # 69000000000000000, not the nearest double), other numbers as doubles.
        ((_, keys, _),) = served.proxy.batches[asked:]
        assert keys == json.loads(body, parse_float=_as_written)["keys"]
        assert [entry["key"] for entry in json.loads(answer)["results"]] == keys

    check()
    assert served.admission.active == 0
