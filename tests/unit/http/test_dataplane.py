"""The data-plane skeleton (keyroute.http.routing, keyroute.http.dataplane): the route table's FULL / PARTIAL /
NONE, 404 and 405 with Allow, and the skeleton's contract for a service's handlers (one answer, admission
released exactly once, errors as the API's JSON, tasks, counting). Exchanges are stand-ins that record their
answer and end as the server's do, except in the last tests, which run the skeleton on keyroute's HTTP
server (127.0.0.1); tests/unit/http/test_dataplane_paths.py has the real services."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from keyroute.api import BadRequest, KeyNotFound
from keyroute.http.admission import Admission
from keyroute.http.dataplane import NOT_A_KEY_PATH, Call, RoutedDataPlane
from keyroute.http.exchange import Request
from keyroute.http.routing import Match, MethodNotAllowed, Route, RouteTable
from tests.unit.http.harness import connect, exchange, get, serving
from tests.util import wait_until


def _noop(plane: Any, call: Call, *parameters: str) -> None:
    call.answer(200, [], repr(parameters).encode())


KEY = Route("/stores/{store}/keys/{key}", ("GET",), _noop, "key")
BATCH = Route("/stores/{store}/batch-get", ("POST",), _noop, "batch")
PARTITION = Route("/stores/{store}/partitions/{partition}/range", ("GET",), _noop, "range")
TABLE = RouteTable([KEY, BATCH, PARTITION, NOT_A_KEY_PATH])


def parts(path: bytes) -> list[bytes]:
    return path.split(b"/")


# -- the route table --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "match"),
    [
        ("GET", b"/stores/s/keys/k", Match.FULL),
        ("HEAD", b"/stores/s/keys/k", Match.FULL),
        ("GET", b"/stores/s/keys/", Match.FULL),  # the empty key is a key
        ("DELETE", b"/stores/s/keys/k", Match.PARTIAL),
        ("GET", b"/stores//keys/k", Match.NONE),  # a store is never empty
        ("GET", b"/stores/s/keys/k/x", Match.NONE),
        ("GET", b"/stores/s/keys", Match.NONE),
        ("GET", b"/stores/s/key/k", Match.NONE),
    ],
)
def test_a_route_matches_fully_partially_or_not_at_all(method: str, path: bytes, match: Match) -> None:
    assert KEY.matches(method, parts(path)) is match


def test_the_table_decides_404_and_405_with_the_first_partial_routes_allow() -> None:
    assert TABLE.resolve("GET", parts(b"/stores/s/keys/k")) is KEY
    assert TABLE.resolve("POST", parts(b"/stores/s/batch-get")) is BATCH
    assert TABLE.resolve("GET", parts(b"/stores/s/partitions/3/range")) is PARTITION
    assert TABLE.resolve("GET", parts(b"/stores/s/keys/a/b/c")) is NOT_A_KEY_PATH  # a GET is told why
    for method, path, allow in [
        ("DELETE", b"/stores/s/keys/k", "GET, HEAD"),
        ("PUT", b"/stores/s/keys/a/b", "GET, HEAD"),
        ("GET", b"/stores/s/batch-get", "POST"),
        ("HEAD", b"/stores/s/batch-get", "POST"),
    ]:
        refused = TABLE.resolve(method, parts(path))
        assert isinstance(refused, MethodNotAllowed) and refused.status == 405, path
        assert refused.headers == {"Allow": allow} and refused.code == "method_not_allowed"
    for path in (b"/stores/", b"/stores/s", b"/stores/s/range", b"/stores/s/partitions//range", b"/stores/s/x/y/z/w/v"):
        missing = TABLE.resolve("GET", parts(path))
        assert not isinstance(missing, Route) and (missing.status, missing.message) == (404, "Not Found"), path


def test_the_table_knows_the_prefix_every_route_shares() -> None:
    assert TABLE.prefix == b"/stores/"
    assert RouteTable([Route("/a/{x}", ("GET",), _noop), Route("/a/b/{y}", ("GET",), _noop)]).prefix == b"/a/"


@pytest.mark.parametrize(
    "template",
    ["stores/{store}", "/stores/{rest:path}/keys", "/stores/{store:int}", "/stores/x{store}", "/stores/all"],
)
def test_a_template_the_table_cannot_match_is_refused_when_the_route_is_declared(template: str) -> None:
    with pytest.raises(ValueError):
        Route(template, ("GET",), _noop)


@pytest.mark.parametrize(
    ("raw", "decoded"),
    [
        (b"/stores/s/keys/C1", ("s", "C1")),
        (b"/stores/s/keys/a%2Fb", ("s", "a/b")),
        (b"/stores/s/keys/100%25", ("s", "100%")),
        (b"/stores/b%2Fx/keys/%E6%9D%B1", ("b/x", "東")),
        (b"/stores/s/keys/", ("s", "")),
    ],
)
def test_parameters_are_decoded_segment_by_segment(raw: bytes, decoded: tuple[str, str]) -> None:
    assert KEY.decode(parts(raw), 1024) == decoded


@pytest.mark.parametrize(
    ("raw", "status", "code", "message"),
    [
        (b"/stores/s/keys/%C3%28", 400, "bad_key", "the key is not valid UTF-8 after percent-decoding"),
        (b"/stores/s/keys/\xff", 400, "bad_key", "the key is not valid UTF-8 after percent-decoding"),
        (b"/stores/%FF/keys/k", 400, "bad_request", "the store is not valid UTF-8 after percent-decoding"),
        (b"/stores/s/keys/%ZZ", 400, "bad_key", "the key holds '%ZZ', not a percent-escape (a % is written %25)"),
        (b"/stores/s/keys/a%", 400, "bad_key", "the key holds '%', not a percent-escape (a % is written %25)"),
        (b"/stores/%2x/keys/k", 400, "bad_request", "the store holds '%2x', not a percent-escape (a % is written %25)"),
        (b"/stores/s/keys/" + b"k" * 9, 414, "key_too_long", "the key is longer than 8 bytes"),
        (b"/stores/s/keys/" + b"%41" * 9, 414, "key_too_long", "the key is longer than 8 bytes"),
        (b"/stores/" + b"s" * 9 + b"/keys/k", 414, "key_too_long", "the store is longer than 8 bytes"),
    ],
)
def test_a_parameter_that_does_not_decode_is_a_400_or_a_414(raw: bytes, status: int, code: str, message: str) -> None:
    with pytest.raises(Exception) as refused:
        KEY.decode(parts(raw), 8)
    error = refused.value
    assert (getattr(error, "status", None), getattr(error, "code", None), str(error)) == (status, code, message)


# -- the skeleton's contract ------------------------------------------------------------------------------


class StandInExchange:
    """Records the answers given (the server's Exchange writes the first only) and, as the server's does,
    calls its `on_done` callback once: at the first answer, or when `lose()` plays the client leaving."""

    def __init__(self, method: str, path: bytes, query: bytes = b"") -> None:
        self.request = Request(method, path, query, [(b"host", b"x")], b"", "rid-7", "1.1")
        self.answers: list[tuple[int, list[tuple[bytes, bytes]], bytes]] = []
        self.gone = False
        self._on_done: Callable[[], None] | None = None

    def on_done(self, callback: Callable[[], None]) -> None:
        assert self._on_done is None and not self.answers and not self.gone, "set once, while open"
        self._on_done = callback

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.answers.append((status, headers, body))
        self._end()

    def lose(self) -> None:
        self.gone = True
        self._end()

    def _end(self) -> None:
        done, self._on_done = self._on_done, None
        if done is not None:
            done()


class Plane(RoutedDataPlane):
    """Handlers that exercise each way of answering."""

    def __init__(self, admission: Admission) -> None:
        self.counted: list[tuple[str, str, int]] = []
        super().__init__(
            admission, lambda *c: self.counted.append(c), max_parameter_bytes=64, error_headers=[(b"x-me", b"n1")]
        )
        self.later: list[Call] = []
        self.gate = asyncio.Event()

    def _key(self, call: Call, store: str, key: str) -> Any:
        if key == "now":
            call.answer(200, [(b"content-type", b"text/plain")], b"now")
            call.answer(201, [], b"twice")  # ignored
        elif key == "missing":
            raise KeyNotFound(f"key {key!r} is not in store {store!r}")
        elif key == "bug":
            raise RuntimeError("a bug in a handler")
        elif key == "later":
            self.later.append(call)
        elif key.startswith("task-"):
            return self._task(call, key)
        return None

    async def _task(self, call: Call, key: str) -> None:
        await self.gate.wait()
        if key == "task-bad":
            raise BadRequest("a bad request, found in a task")
        if key == "task-bug":
            raise RuntimeError("a bug in a task")
        if key == "task-cancelled":  # as the server stopping cancels it
            raise asyncio.CancelledError
        if key == "task-ok":
            call.answer_counted(200, [], b"counted by the handler")
        # task-silent: ends without answering

    routes = RouteTable([Route("/stores/{store}/keys/{key}", ("GET",), _key, "key"), NOT_A_KEY_PATH])


def handled(plane: Plane, method: str, path: bytes) -> StandInExchange:
    exchange = StandInExchange(method, path)
    plane.handle(exchange)  # type: ignore[arg-type]
    return exchange


def error_of(exchange: StandInExchange) -> tuple[int, dict[str, Any], dict[bytes, bytes]]:
    ((status, headers, body),) = exchange.answers
    return status, json.loads(body), dict(headers)


def test_an_answer_is_given_once_counted_once_and_releases_admission_once() -> None:
    admission = Admission(max_concurrent_requests=4)
    plane = Plane(admission)
    exchange = handled(plane, "GET", b"/stores/s/keys/now")
    assert exchange.answers == [(200, [(b"content-type", b"text/plain")], b"now")]
    assert plane.counted == [("s", "key", 200)] and admission.active == 0
    # Answered later, from a callback: admission held until then.
    exchange = handled(plane, "GET", b"/stores/s/keys/later")
    assert exchange.answers == [] and admission.active == 1
    plane.later[0].settle(KeyNotFound("gone missing"))
    plane.later[0].settle(RuntimeError("too late"))  # ignored: answered already
    assert error_of(exchange)[:2] == (404, {"error": "key_not_found", "message": "gone missing"})
    assert admission.active == 0 and plane.counted[-1] == ("s", "key", 404)


def test_errors_are_the_apis_json_with_the_services_headers_and_a_500_hides_the_bug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    admission = Admission()
    plane = Plane(admission)
    status, body, headers = error_of(handled(plane, "GET", b"/stores/s/keys/missing"))
    assert (status, body) == (404, {"error": "key_not_found", "message": "key 'missing' is not in store 's'"})
    assert headers == {b"content-type": b"application/json", b"x-me": b"n1"}
    status, body, headers = error_of(handled(plane, "GET", b"/stores/s/keys/bug"))
    assert (status, body) == (500, {"error": "internal_error", "message": "internal error"})
    logged = [r for r in caplog.records if r.exc_info and "a bug in a handler" in str(r.exc_info[1])]
    assert logged and logged[0].request_id == "rid-7"  # type: ignore[attr-defined]
    assert plane.counted == [("s", "key", 404), ("s", "key", 500)] and admission.active == 0


def test_404_405_and_parameters_that_do_not_decode_are_answered_by_the_skeleton() -> None:
    admission = Admission()
    plane = Plane(admission)
    status, body, headers = error_of(handled(plane, "DELETE", b"/stores/s/keys/k"))
    assert (status, body["error"], headers[b"allow"], headers[b"x-me"]) == (
        405,
        "method_not_allowed",
        b"GET, HEAD",
        b"n1",
    )
    status, body, _ = error_of(handled(plane, "GET", b"/stores/s/nope"))
    assert (status, body) == (404, {"error": "not_found", "message": "Not Found"})
    status, body, _ = error_of(handled(plane, "GET", b"/stores/s/keys/a/b"))
    assert (status, body["message"]) == (404, "not a key path: a key containing '/' must be percent-encoded as %2F")
    assert plane.counted == []  # not reads
    status, body, _ = error_of(handled(plane, "GET", b"/stores/s/keys/%FF"))
    assert (status, body["error"]) == (400, "bad_key")
    status, body, _ = error_of(handled(plane, "GET", b"/stores/%FF/keys/k"))
    assert (status, body["error"]) == (400, "bad_request")
    # Counted under the store when it decodes, under no store when it does not.
    assert plane.counted == [("s", "key", 400), ("", "key", 400)]
    assert admission.active == 0


def test_a_refusal_by_admission_takes_no_place_and_is_not_counted() -> None:
    admission = Admission(max_concurrent_requests=1)
    plane = Plane(admission)
    handled(plane, "GET", b"/stores/s/keys/later")
    status, body, headers = error_of(handled(plane, "GET", b"/stores/s/keys/now"))
    assert (status, body["error"], headers[b"retry-after"], headers[b"x-me"]) == (503, "overloaded", b"1", b"n1")
    assert admission.active == 1 and admission.overloaded == 1 and plane.counted == []
    plane.later[0].answer(200, [], b"")
    assert admission.active == 0


def test_a_handlers_task_answers_or_its_failure_does_and_admission_is_released_once() -> None:
    async def scenario() -> None:
        admission = Admission()
        plane = Plane(admission)
        exchanges = {key: handled(plane, "GET", b"/stores/s/keys/" + key.encode()) for key in
                     ("task-ok", "task-bad", "task-bug", "task-silent", "task-cancelled")}  # fmt: skip
        assert admission.active == 5 and not any(e.answers for e in exchanges.values())
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        plane.gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
        assert exchanges["task-ok"].answers == [(200, [], b"counted by the handler")]
        assert error_of(exchanges["task-bad"])[:2] == (
            400,
            {"error": "bad_request", "message": "a bad request, found in a task"},
        )
        assert error_of(exchanges["task-bug"])[1]["error"] == "internal_error"
        assert error_of(exchanges["task-silent"])[1]["error"] == "internal_error"  # a task must answer
        assert exchanges["task-cancelled"].answers == []
        # A cancelled task answers nothing: its place is given back when its exchange ends (the server
        # stopping closes the connection), not by the task.
        assert admission.active == 1
        exchanges["task-cancelled"].lose()
        assert admission.active == 0
        assert sorted(plane.counted) == [("s", "key", 400), ("s", "key", 500), ("s", "key", 500)]

    asyncio.run(scenario())


def test_an_answer_that_cannot_be_written_becomes_a_500(caplog: pytest.LogCaptureFixture) -> None:
    class Refusing(StandInExchange):
        def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
            if status != 500:
                raise UnicodeEncodeError("latin-1", "é", 0, 1, "a header that does not encode")
            super().answer(status, headers, body)

    admission = Admission()
    plane = Plane(admission)
    exchange = Refusing("GET", b"/stores/s/keys/now")
    plane.handle(exchange)  # type: ignore[arg-type]
    assert error_of(exchange)[:2] == (500, {"error": "internal_error", "message": "internal error"})
    assert admission.active == 0 and any("writing the answer" in r.getMessage() for r in caplog.records)


def test_a_request_lost_while_its_task_runs_gives_its_place_back_at_once_and_only_once() -> None:
    async def scenario() -> None:
        admission = Admission(max_concurrent_requests=1)
        plane = Plane(admission)
        lost = handled(plane, "GET", b"/stores/s/keys/task-ok")
        assert admission.active == 1
        lost.lose()  # the client left; the task still waits
        assert admission.active == 0
        assert handled(plane, "GET", b"/stores/s/keys/now").answers[0][0] == 200  # admitted: the place is free
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        plane.gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        assert lost.answers == [(200, [], b"counted by the handler")]  # given (the server drops it)
        assert admission.active == 0 and admission.overloaded == 0

    asyncio.run(scenario())


# -- the skeleton on keyroute's HTTP server -----------------------------------------------------------------


class Waiting(RoutedDataPlane):
    """Key reads answered at once, except key `wait`: answered by a task once `gate` is set."""

    def __init__(self, admission: Admission) -> None:
        self.counted: list[tuple[str, str, int]] = []
        super().__init__(admission, lambda *c: self.counted.append(c))
        self.gate = asyncio.Event()
        self.waiting = 0
        self.finished = 0

    def _key(self, call: Call, store: str, key: str) -> Any:
        if key == "wait":
            return self._wait(call)
        call.answer(200, [], b"now")
        return None

    async def _wait(self, call: Call) -> None:
        self.waiting += 1
        await self.gate.wait()
        call.answer(200, [], b"late")
        self.finished += 1

    routes = RouteTable([Route("/stores/{store}/keys/{key}", ("GET",), _key, "key")])


def test_a_client_that_leaves_while_its_handlers_task_runs_frees_its_admission_place_at_once(arun: Any) -> None:
    async def scenario() -> None:
        admission = Admission(max_concurrent_requests=1)
        plane = Waiting(admission)
        async with serving(plane) as server:  # type: ignore[arg-type]
            async with connect(server.port) as (_, writer):
                writer.write(get("/stores/s/keys/wait"))
                await wait_until(lambda: plane.waiting == 1, message="the handler's task running")
                refused = await exchange(server.port, get("/stores/s/keys/k"))
                assert (refused.status, refused.json()["error"]) == (503, "overloaded")
            # The client has gone; its handler's task still waits, and the place is free already.
            await wait_until(lambda: admission.active == 0, message="the place given back")
            assert plane.finished == 0
            admitted = await exchange(server.port, get("/stores/s/keys/k"))
            assert (admitted.status, admitted.body) == (200, b"now")
            plane.gate.set()
            await wait_until(lambda: plane.finished == 1, message="the task's late answer")
            assert admission.active == 0  # released once: the late answer gave nothing back again
            assert admission.overloaded == 1
            assert sorted(plane.counted) == [("s", "key", 200), ("s", "key", 200)]

    arun(scenario())


# -- the key read's fast path ----------------------------------------------------------------------------


class Echo(RoutedDataPlane):
    """Answers a key read with its decoded parameters; its table's first route is the key read, so a plain
    key path is matched and decoded by the skeleton's fast path (`RouteTable.fast_route`)."""

    def __init__(self) -> None:
        self.counted: list[tuple[str, str, int]] = []
        super().__init__(Admission(), lambda *c: self.counted.append(c), max_parameter_bytes=8)

    routes = RouteTable([KEY, BATCH, NOT_A_KEY_PATH])


class EchoByTable(Echo):
    """The same routes, the key read second: no fast route, every path goes through `RouteTable.resolve`."""

    routes = RouteTable([BATCH, KEY, NOT_A_KEY_PATH])


def test_only_a_first_route_of_a_store_and_a_key_is_a_fast_route() -> None:
    fast = Echo.routes.fast_route()
    assert fast is not None and fast.route is KEY and (fast.length, fast.at, fast.literal) == (5, 3, b"keys")
    assert (fast.first, fast.second, fast.second_required) == (2, 4, False)
    assert EchoByTable.routes.fast_route() is None
    assert RouteTable([PARTITION, KEY]).fast_route() is None


@pytest.mark.parametrize("method", ["GET", "HEAD", "POST", "DELETE"])
@pytest.mark.parametrize(
    "path",
    [
        b"/stores/s/keys/k",
        b"/stores/s/keys/",
        b"/stores//keys/k",
        b"/stores/s/keys/%41",
        b"/stores/s/keys/a%2Fb",
        b"/stores/s/keys/\xff",
        b"/stores/\xc3\xa9/keys/\xc3\xa9",
        b"/stores/s/keys/12345678",
        b"/stores/s/keys/123456789",
        b"/stores/123456789/keys/k",
        b"/stores/s/Keys/k",
        b"/stores/s/keys/k/",
        b"/stores/s/batch-get",
    ],
)
def test_the_fast_path_answers_every_path_as_the_route_table_does(method: str, path: bytes) -> None:
    fast, by_table = Echo(), EchoByTable()
    assert handled(fast, method, path).answers == handled(by_table, method, path).answers  # type: ignore[arg-type]
    assert fast.counted == by_table.counted
    assert fast.admission.active == by_table.admission.active == 0


def test_a_plain_key_path_is_answered_with_its_decoded_parameters_by_the_fast_path() -> None:
    plane = Echo()
    assert handled(plane, "GET", b"/stores/s/keys/\xc3\xa9").answers == [(200, [], repr(("s", "é")).encode())]  # type: ignore[arg-type]
    assert handled(plane, "HEAD", b"/stores/s/keys/").answers == [(200, [], repr(("s", "")).encode())]  # type: ignore[arg-type]
    assert plane.counted == [("s", "key", 200), ("s", "key", 200)]


def test_a_process_that_withholds_reads_answers_every_read_503_with_why_taking_no_place() -> None:
    from keyroute.api import PolicyNotSatisfied

    admission = Admission(max_concurrent_requests=4)
    plane = Plane(admission)
    admission.withheld = PolicyNotSatisfied("the cluster policy requires TLS to ZooKeeper: set --zk-tls-ca", 30)
    for path in (b"/stores/s/keys/now", b"/stores/s/nope"):
        status, body, headers = error_of(handled(plane, "GET", path))
        assert (status, body["error"], headers[b"retry-after"], headers[b"x-me"]) == (
            503,
            "policy_not_satisfied",
            b"30",
            b"n1",
        )
        assert "TLS to ZooKeeper" in body["message"]
    assert admission.active == 0 and plane.counted == []
    admission.withheld = None
    assert handled(plane, "GET", b"/stores/s/keys/now").answers[0][0] == 200
